"""Where a relaunch's time goes on a GPU: process start, CUDA init, NCCL init, checkpoint load.

    .venv/bin/python benchmarks/relaunch_split.py [--nproc 1] [--repeats 3] [--n-embd 1024]

A relaunch is a cold start of the job plus a checkpoint load. This starts the same job as
babysit does (``python -m torch.distributed.run``, one process per GPU) ``--repeats`` times and
each rank stamps the wall clock as it passes each phase:

    process start    torchrun's launch -> the rank's script is running with torch imported
    CUDA init        torch.cuda.set_device + the first kernel, synchronised
    NCCL init        init_process_group("nccl") + one all-reduce, synchronised
    checkpoint load  the demo GPT and AdamW built on the device, and babysit's checkpoint
                     (DCP, model + optimizer + RNG) of it loaded back (``checkpoints.load``)

The checkpoint is saved once, first, by the same job (``checkpoints.save``). Prints the median
seconds of each phase (slowest rank of each repeat) and the checkpoint's size, for
docs/gpu.md's table. Without CUDA it says so and exits 0; ``--device cpu`` times the same phases
with gloo on the CPU, to check the script itself (not a GPU figure).
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

import torch

ROOT = Path(__file__).resolve().parent.parent
PHASES = ("process start", "CUDA init", "NCCL init", "checkpoint load")


def child(args: argparse.Namespace) -> None:
    """One rank: stamp each phase and print the stamps as one JSON line."""
    stamps = {"start": time.time()}
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "configs"))
    from demo_train import GPT

    from babysit.checkpoints.layout import step_dir
    from babysit.checkpoints.load import load
    from babysit.checkpoints.save import save

    local = int(os.environ["LOCAL_RANK"])
    if args.device == "cuda":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        torch.ones(1, device=device).add_(1)
        torch.cuda.synchronize()
    else:
        device = torch.device("cpu")
    stamps["cuda"] = time.time()
    if args.device == "cuda":
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    one = torch.ones(1, device=device)
    dist.all_reduce(one)
    if args.device == "cuda":
        torch.cuda.synchronize()
    stamps["nccl"] = time.time()
    torch.manual_seed(0)
    model = GPT(256, args.n_layer, args.n_embd, max(1, args.n_embd // 64)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if args.mode == "save":
        x = torch.randint(256, (2, 256), device=device)
        model(x, x).backward()
        opt.step()  # so the optimizer has state to save
        save(args.ckpt, step=1, cursor=1, lr_scale=1.0, model=model, optimizer=opt)
    else:
        load(step_dir(args.ckpt, 1), model, opt)
        if args.device == "cuda":
            torch.cuda.synchronize()
    stamps["load"] = time.time()
    print("STAMPS " + json.dumps(stamps), flush=True)
    dist.destroy_process_group()


def launch(args: argparse.Namespace, mode: str, ckpt: str) -> list[dict[str, float]]:
    """Start the job once; the launch time and every rank's stamps."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(args.nproc), __file__, "--child", "--mode", mode,
               "--ckpt", ckpt, "--device", args.device, "--n-embd", str(args.n_embd),
               "--n-layer", str(args.n_layer)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
        str(ROOT), os.environ.get("PYTHONPATH")])), "OMP_NUM_THREADS": "1"}
    launched = time.time()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"the {mode} job failed ({done.returncode}):\n{done.stderr[-3000:]}")
    stamps = [json.loads(line.split(" ", 1)[1]) for line in done.stdout.splitlines()
              if line.startswith("STAMPS ")]
    return [{"launch": launched, **s} for s in stamps]


def split(stamps: list[dict[str, float]]) -> dict[str, float]:
    """Each phase's seconds for the slowest rank (the job waits for it)."""
    marks = ("launch", "start", "cuda", "nccl", "load")
    return {phase: max(s[b] - s[a] for s in stamps)
            for phase, a, b in zip(PHASES, marks[:-1], marks[1:], strict=True)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=1, help="ranks (one GPU each)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--n-embd", type=int, default=1024)
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=["save", "load"], default="load", help=argparse.SUPPRESS)
    p.add_argument("--ckpt", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"skipped: CUDA not available (torch {torch.__version__}); run this on a GPU "
              "machine, or pass --device cpu to check the script")
        return
    with tempfile.TemporaryDirectory(prefix="babysit-relaunch-") as folder:
        launch(args, "save", folder)
        size = sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file())
        runs = [split(launch(args, "load", folder)) for _ in range(args.repeats)]
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU (gloo)"
    print(f"{name}, torch {torch.__version__}, {args.nproc} rank(s), demo GPT n_embd "
          f"{args.n_embd} x {args.n_layer} layers, checkpoint {size / 2**20:.0f} MiB, "
          f"median of {args.repeats}")
    print(f"| {'phase':16s} | {'seconds':>8s} |")
    print(f"| {'---':16s} | {'---:':>8s} |")
    for phase in PHASES:
        label = phase if args.device == "cuda" else phase.replace("CUDA", "device") \
            .replace("NCCL", "gloo")
        print(f"| {label:16s} | {statistics.median(r[phase] for r in runs):8.2f} |")
    total = statistics.median(sum(r.values()) for r in runs)
    print(f"| {'total':16s} | {total:8.2f} |")


if __name__ == "__main__":
    main()
