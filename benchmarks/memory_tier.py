"""Memory copies against checkpoints on disk: the training thread's stall, and the resume.

    .venv/bin/python benchmarks/memory_tier.py [--sizes tiny,1g] [--copies 6] [--rounds 3]
        [--device cuda --ranks 1]   # the model on the GPU: one rank (NCCL), no peer

Each size runs a real ``torchrun`` job of 2 gloo ranks, each rank its own "node" (its own
folder in shared memory, ``GROUP_RANK`` set apart, so every copy is also sent to the other
rank: the replica a peer node keeps), with an FSDP2 model (``fully_shard``: each rank holds
half of every layer) and Adam. ``tiny`` is ``tests/workers/tiny_train.py``'s model; ``1g`` is
about 1 GiB of state per rank (parameters and Adam's two moments). Side by side, in one run,
interleaved within each round:

- **stall**: what the training thread paid for a memory copy (``Copier.copy``: the copy into
  host memory) and for an asynchronous checkpoint on disk (``checkpoints.save``: the same
  copy, and the collectives that start its write), each at the same steps of the same model;
  and what the copy's thread took to write it and swap it with the peer (``write``).
- **resume**: ``checkpoints.load`` of the newest memory copy with every file on its node
  (a rank died, its node lives), of the same copy after the second node's folder was wiped
  (a node lost: its rank's files come from the peer over gloo), and of the checkpoint on disk
  (here a local disk, the page cache emptied first so that it is read from the disk, as a
  relaunch on a new node reads it; ``--warm-disk`` reads it where its write left it).
- **host memory** per node: what its shared-memory folder holds (its ranks' copies and its
  peer's, ``checkpoints.memory.KEEP`` of each).

Medians over ``--rounds`` rounds of ``--copies`` copies (the first of each round dropped: it
sets up the copier's gloo group). The figures: ``docs/measured.md#memory-tier``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SIZES = {"tiny": 0, "256m": 1 << 28, "1g": 1 << 30}
"""Bytes of state per rank (0: tiny_train's model)."""


def build(size: int, device: Any, ranks: int = 2) -> tuple[Any, Any]:
    """The model and its optimizer: ``size`` bytes of state per rank across ``ranks`` FSDP2
    ranks."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    if size == 0:
        layers = [torch.nn.Linear(16, 32), torch.nn.Linear(32, 1)]
    else:  # params + exp_avg + exp_avg_sq, float32, split across the ranks: 12 / ranks bytes
        width = 4096
        count = max(1, round(size * ranks / 12 / (width * width)))
        layers = [torch.nn.Linear(width, width, bias=False) for _ in range(count)]
    model = torch.nn.Sequential(*layers).to(device)
    mesh = init_device_mesh(device.type, (ranks,))
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(2, layers[0].in_features, device=device)
    model(x).sum().backward()  # Adam's moments exist: the state is its full size
    opt.step()
    opt.zero_grad()
    return model, opt


def worker(args: argparse.Namespace) -> None:
    """One rank: copies and saves at the same steps, then the three resumes; rank 0 prints
    one JSON line of figures."""
    import torch
    import torch.distributed as dist

    from babysit import checkpoints
    from babysit.checkpoints import memory, memory_copy

    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, ranks = dist.get_rank(), dist.get_world_size()
    size = SIZES[args.size]
    work = Path(args.work)
    node_root = work / f"node{rank}"
    disk = work / "disk"
    model, opt = build(size, device, ranks)
    events: list[dict[str, Any]] = []
    copier = memory_copy.Copier(node_root, rank=rank, world_size=ranks, local_world_size=1,
                                node=rank, every=1, model=model, optimizer=opt, scheduler=None,
                                emit=lambda kind, **f: events.append({"kind": kind, **f}))
    copy_stalls, save_stalls, writes = [], [], []
    for step in range(1, args.copies + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()  # the step's kernels are not the copy's
        started = time.perf_counter()
        copier.copy(step, step, 1.0, None)
        copy_stalls.append(time.perf_counter() - started)
        copier.close()  # the copy's write ends before the save's starts: no overlap
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        handle = checkpoints.save(disk, step, step, 1.0, model, opt, async_save=True)
        save_stalls.append(time.perf_counter() - started)
        handle.wait()
    writes = [e["write_s"] for e in events if e["kind"] == "memory_copy"]
    parts: list[Any] = [None] * ranks
    [copied] = [e for e in events if e["kind"] == "memory_copy" and e["step"] == args.copies]
    dist.all_gather_object(parts, copied)
    catalog = work / "catalog"
    if rank == 0:
        memory.commit(catalog, args.copies, {r: memory.Part.from_event(r, p)
                                             for r, p in enumerate(parts)}, ranks, node_root)
    dist.barrier()
    held = sum(f.stat().st_size for f in node_root.rglob("*") if f.is_file())
    step_dir = checkpoints.step_dir(catalog, args.copies)
    here = memory.copy_dir(node_root, args.copies)

    def timed(load: Any) -> float:
        dist.barrier()
        started = time.perf_counter()
        load()
        dist.barrier()
        return time.perf_counter() - started

    fresh, fresh_opt = build(size, device, ranks)
    # The supervisor checks the files a node holds as it chooses the copy (as it checks a
    # checkpoint on disk): the ranks check what they fetch.
    local = timed(lambda: checkpoints.load(step_dir, fresh, fresh_opt, memory=here,
                                           checked=True))
    fetched = None
    if ranks > 1:
        if rank == 1:  # node 1 lost: its folder gone, its rank's files only on node 0 now
            shutil.rmtree(node_root)
        fetched = timed(lambda: checkpoints.load(step_dir, fresh, fresh_opt, memory=here,
                                                 checked=True))
    if rank == 0 and args.cold_disk:
        _drop_caches()  # the disk's bytes read from the disk, as on a new node
    from_disk = timed(lambda: checkpoints.load(checkpoints.step_dir(disk, args.copies), fresh,
                                               fresh_opt))
    if rank == 0:
        drop = 1  # the first copy and save set up their gloo groups
        print(json.dumps({
            "copy_stall": copy_stalls[drop:], "save_stall": save_stalls[drop:],
            "write": writes[drop:], "local": local, "fetched": fetched, "disk": from_disk,
            "held": held, "state": copied["files"] and sum(f["size"] for f in copied["files"])
        }), flush=True)
    dist.destroy_process_group()


def _drop_caches() -> None:
    """Empty the page cache (root only): the checkpoint on disk is then read from the disk,
    not from memory where its write left it."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as exc:
        print(f"the page cache could not be emptied ({exc.strerror}): the disk's figure is a "
              "read from memory", file=sys.stderr, flush=True)


def run_size(args: argparse.Namespace, size: str) -> dict[str, Any]:
    """One torchrun job of 2 ranks for ``size``; rank 0's figures."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    work = Path(tempfile.mkdtemp(prefix="babysit-bench-", dir=base))
    disk = Path(tempfile.mkdtemp(prefix="babysit-bench-disk-"))
    try:
        (work / "disk").symlink_to(disk)  # the checkpoints on disk, not in shared memory
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                   str(args.ranks),
                   "--master-port", str(29600 + os.getpid() % 300), __file__, "--worker",
                   "--size", size, "--copies", str(args.copies), "--device", args.device,
                   "--work", str(work), *(["--cold-disk"] if args.cold_disk else [])]
        # Each rank its own node: torchrun gives both GROUP_RANK 0, and a load's fetch reads
        # it, so the worker sets it from its rank (BABYSIT_BENCH_OWN_NODES).
        done = subprocess.run(command, env={**env, "BABYSIT_BENCH_OWN_NODES": "1"},
                              capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            raise SystemExit(f"the {size} job failed:\n{done.stdout[-3000:]}\n"
                             f"{done.stderr[-5000:]}")
        line = [x for x in done.stdout.splitlines() if x.startswith("{")][-1]
        return dict(json.loads(line))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)


def _ms(values: list[float]) -> str:
    return f"{1000 * statistics.median(values):.1f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", default="tiny,1g")
    p.add_argument("--copies", type=int, default=6)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--ranks", type=int, default=2, help="2 (each its own node) or 1 (no peer)")
    p.add_argument("--warm-disk", dest="cold_disk", action="store_false",
                   help="read the checkpoint on disk from the page cache where its write left "
                        "it (by default the cache is emptied first: root)")
    p.add_argument("--cold-disk", action="store_true", default=True, help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--size", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        if os.environ.get("BABYSIT_BENCH_OWN_NODES"):
            os.environ["GROUP_RANK"] = os.environ.get("RANK", "0")
        worker(args)
        return
    sizes = args.sizes.split(",")
    got: dict[str, list[dict[str, Any]]] = {s: [] for s in sizes}
    for round_ in range(args.rounds):
        for size in sizes:  # interleaved: both sizes meet the machine's noise alike
            got[size].append(run_size(args, size))
            # each run's raw figures as they come: a later size that fails keeps these
            print(json.dumps({"round": round_ + 1, "size": size, **got[size][-1]}),
                  file=sys.stderr, flush=True)
        print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    print(f"\n## Memory copies against checkpoints on disk ({args.device}, {args.ranks} FSDP2 "
          f"rank(s), each its own node; medians of {args.rounds} rounds)\n")
    print("| state per rank | copy: stall ms | disk save: stall ms | stall ratio | copy: write "
          "ms | resume from memory s | from memory, a node lost s | from disk s | disk / "
          "memory | host memory per node MiB |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for size in sizes:
        runs = got[size]
        copy = [v for r in runs for v in r["copy_stall"]]
        save = [v for r in runs for v in r["save_stall"]]
        write = [v for r in runs for v in r["write"]]
        local = statistics.median(r["local"] for r in runs)
        lost = [r["fetched"] for r in runs if r["fetched"] is not None]
        fetched = f"{statistics.median(lost):.3f}" if lost else "(one rank)"
        disk = statistics.median(r["disk"] for r in runs)
        state = statistics.median(r["state"] for r in runs)
        held = statistics.median(r["held"] for r in runs)
        print(f"| {size} ({state / 2**20:.1f} MiB) | {_ms(copy)} | {_ms(save)} | "
              f"{statistics.median(save) / statistics.median(copy):.2f} | {_ms(write)} | "
              f"{local:.3f} | {fetched} | {disk:.3f} | {disk / local:.2f} | "
              f"{held / 2**20:.1f} |")


if __name__ == "__main__":
    main()
