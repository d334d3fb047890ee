"""A 2-rank job that saves and loads its own checkpoints and tells babysit about them.

    --crash RANK:STEP   raise at that step on the first attempt
"""

import argparse
import os

import torch
import torch.distributed as dist

from babysit import attach


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--crash", default=None)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    run = attach()  # no model: this script restores its own state
    if run.resume is not None:
        state = torch.load(run.resume.path, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        print(f"loaded my checkpoint of step {state['step']}", flush=True)
    saves = os.path.join(os.environ["BABYSIT_RUN_DIR"], "my_saves")
    data = (torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) for i in range(10**9))
    for x in run.batches(data):
        if run.step_count >= args.steps:
            break
        if run.directive.attempt == 0 and args.crash == f"{rank}:{run.step_count + 1}":
            raise RuntimeError("injected crash")
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        for param in model.parameters():
            dist.all_reduce(param.grad)
        opt.step()
        run.step(loss=loss.item())
        if run.step_count % 5 == 0:
            path = os.path.join(saves, f"step{run.step_count}.pt")
            if rank == 0:
                os.makedirs(saves, exist_ok=True)
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                            "step": run.step_count}, path)
            run.checkpoint_saved(path)  # collective: after every rank's part of the save
    run.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
