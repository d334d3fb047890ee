"""The stall a checkpoint costs the training thread, side by side with another tree's babysit.

    .venv/bin/python benchmarks/save_stall.py [--ranks 2] [--saves 150] [--rounds 3]
        [--baseline-tree DIR]     # e.g. a `git worktree add /tmp/base HEAD~1`
        [--device cuda]           # the model on the GPU: the save stages it to host memory

Each round runs a real ``torchrun`` job of ``--ranks`` gloo ranks per tree, interleaved (this
tree, then the baseline, then this tree ...). A rank trains ``tests/workers/tiny_train.py``'s
model (DDP, Adam, a StepLR schedule) and calls ``babysit.checkpoints.save`` every ``--every``
steps, asynchronously (the default) or with ``--sync``; a step is its forward, backward and
optimizer step plus ``--step-sleep`` seconds, so each save's write overlaps training as in a
run. The figure is what ``save`` held the training thread (rank 0's, the first ``--warmup``
saves dropped), the stall the goodput ledger counts as ``checkpoint``: the median and p90 over
every round's saves, per tree, and the ratio of the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def worker(args: argparse.Namespace) -> None:
    """One rank: train and save; rank 0 prints its stalls as one JSON line."""
    sys.path.insert(0, args.tree)
    import torch
    import torch.distributed as dist

    from babysit import checkpoints

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    device = torch.device(args.device)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(32, 1)).to(device)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, 100)
    x, y = torch.randn(8, 16, device=device), torch.randn(8, 1, device=device)
    stalls, handle = [], None
    for step in range(1, args.saves * args.every + 1):
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        time.sleep(args.step_sleep)
        if handle is not None:
            handle.poll()
        if step % args.every == 0:
            started = time.perf_counter()
            if device.type == "cuda":
                torch.cuda.synchronize()  # the step's kernels are the step's, not the save's
            handle = checkpoints.save(args.root, step, step, 1.0, ddp, opt, sched,
                                      async_save=not args.sync)
            stalls.append(time.perf_counter() - started)
    checkpoints.wait_pending()
    if dist.get_rank() == 0:
        print("STALLS " + json.dumps(stalls[args.warmup:]), flush=True)
    dist.destroy_process_group()


def run_once(tree: str, args: argparse.Namespace) -> list[float]:
    with tempfile.TemporaryDirectory(prefix="save_stall.") as root:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
               str(args.ranks), __file__, "--worker", "--tree", tree, "--root", root,
               "--saves", str(args.saves), "--every", str(args.every),
               "--step-sleep", str(args.step_sleep), "--warmup", str(args.warmup),
               "--device", args.device]
        if args.sync:
            cmd.append("--sync")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("STALLS ")), None)
        if out.returncode != 0 or line is None:
            sys.exit(f"the job in {tree} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
        return [float(s) for s in json.loads(line[len("STALLS "):])]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--saves", type=int, default=150, help="saves per job")
    p.add_argument("--every", type=int, default=5, help="steps between saves")
    p.add_argument("--step-sleep", type=float, default=0.02, help="seconds added to each step")
    p.add_argument("--warmup", type=int, default=10, help="first saves of a job not counted")
    p.add_argument("--rounds", type=int, default=3, help="jobs per tree, interleaved")
    p.add_argument("--sync", action="store_true", help="synchronous saves")
    p.add_argument("--device", default="cpu", help="cpu, or cuda (every rank on GPU 0, gloo)")
    p.add_argument("--baseline-tree", help="another checkout of babysit to compare with")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tree", default=str(HERE), help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    trees = {"this tree": str(HERE)}
    if args.baseline_tree:
        trees["baseline"] = str(Path(args.baseline_tree).resolve())
    stalls: dict[str, list[float]] = {name: [] for name in trees}
    for r in range(args.rounds):
        for name, tree in trees.items():
            stalls[name] += run_once(tree, args)
            print(f"round {r + 1}/{args.rounds}: {name} done", file=sys.stderr, flush=True)
    mode = "synchronous" if args.sync else "asynchronous"
    print(f"\n## {mode} saves, {args.ranks} gloo ranks, tiny_train's model on {args.device}, "
          f"{args.rounds} x {args.saves - args.warmup} saves per tree\n")
    print("| tree | median ms | p90 ms |\n| --- | ---: | ---: |")
    for name, values in stalls.items():
        q = statistics.quantiles(values, n=10)
        print(f"| {name} ({trees[name]}) | {1e3 * statistics.median(values):.2f} | "
              f"{1e3 * q[-1]:.2f} |")
    if "baseline" in stalls:
        ratio = statistics.median(stalls["this tree"]) / statistics.median(stalls["baseline"])
        print(f"\nthis tree / baseline (medians): {ratio:.2f}x")


if __name__ == "__main__":
    main()
