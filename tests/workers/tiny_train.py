"""A tiny 2-rank gloo job using the worker API, for end-to-end tests. Seconds, not minutes.

Flags inject faults at a rank and step, so tests can provoke what babysit must handle:
    --steps N            optimizer steps to run
    --step-sleep S       seconds of "work" per step
    --crash RANK:STEP    raise at that step on that rank
    --hang RANK:STEP     sleep forever at that step on that rank (outside any collective)
    --exit-code CODE     exit with CODE at the end (rank 0)
"""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

from supervisor import attach


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--step-sleep", type=float, default=0.02)
    p.add_argument("--crash", default=None)
    p.add_argument("--hang", default=None)
    p.add_argument("--exit-code", type=int, default=0)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    run = attach(model=model, optimizer=opt)
    data = (torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) for i in range(10**9))
    for x in run.batches(data):
        if run.step_count >= args.steps:
            break
        for flag, action in ((args.crash, "crash"), (args.hang, "hang")):
            if flag and flag == f"{rank}:{run.step_count + 1}":
                if action == "crash":
                    raise RuntimeError(f"injected crash at step {run.step_count + 1}")
                time.sleep(3600)
        time.sleep(args.step_sleep)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        for param in model.parameters():
            dist.all_reduce(param.grad)
        if run.step(loss=loss.item(), grad_norm=1.0, tokens=32):
            opt.step()
    print(f"rank {rank} done at step {run.step_count} pid {os.getpid()}", flush=True)
    run.close()
    dist.destroy_process_group()
    sys.exit(args.exit_code if rank == 0 else 0)


if __name__ == "__main__":
    main()
