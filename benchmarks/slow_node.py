"""A slow node, kept and evicted: the same multi-node job with one node's rank under a CPU limit,
or one node's link slowed.

    sudo .venv/bin/python benchmarks/slow_node.py [--minutes 5] [--cause cpu|link]
                                                  [--quota 0.1] [--rate 1mbit] [--at 0.2]
                                                  [--runs clean,kept,evicted] [--repeat 1]
                                                  [--keep DIR]

Root is needed for the CPU limit (a cgroup's CFS quota, ``tests/cpulimit.py``) and for the
network namespaces of ``--cause link`` (``tests/netns.py``: every node on its own address, and
from ``--at`` of the steps on, node 2's link at ``--rate`` both ways, a ``tc`` token bucket).
The job is ``tests/workers/tiny_train.py`` under DDP on 3 nodes of one rank each and a hot
spare, every babysitter on this machine (loopback, or namespaces for the link), with a few ms
of real compute in each forward
(``--forward-work 40``) and 0.05 s of sleep per step, sized to ``--minutes`` of fault-free
training here (the step time measured first, on 60 steps under plain torchrun). Three runs, one
after the other, with babysit's default policy and a checkpoint every 25 steps:

- ``clean``: no limit;
- ``kept``: from ``--at`` of the steps on, node 2's rank gets ``--quota`` of one core (or its
  link ``--rate``) (``nodes.evict_slow: false``: named and alerted, never evicted);
- ``evicted``: the same limit under the default settings: named, its cost weighed, evicted for
  the spare at the attempt's next checkpoint.

``--repeat N`` makes the runs N times, interleaved (clean, kept, evicted, clean, ...: each
round sees the machine as it is then), and prints each run, then the distribution: in how
many runs the slowed node was named and evicted before the job ended, how long after the
limit (median and range), and in how many clean runs nobody was named (no ``slow_compute``
or ``slow_link`` finding at all).

babysit's ledger counts a slow rank's forward excess as straggler time, a lower bound (its
backward's excess is not seen, and a slow link not at all), so the figure that shows what a
slow node costs is the wall time for the same steps; ``pace goodput`` is the steps at the clean
run's productive step time over the wall time (the ledger's goodput is printed beside it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.goodput import calibrate, env, workdir_for  # noqa: E402
from tests import cpulimit, netns  # noqa: E402

WORKER = ROOT / "tests" / "workers" / "tiny_train.py"
NODES, SPARES = 3, 1
JOB = ["--step-sleep", "0.05", "--forward-work", "40", "--loss-every", "50", "--ddp"]


def newest_step(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        return 0
    with open(metrics, "rb") as f:
        f.seek(max(0, metrics.stat().st_size - 4096))
        lines = f.read().decode(errors="replace").splitlines()
    for line in reversed(lines):
        with contextlib.suppress(ValueError):
            return int(json.loads(line)["step"])
    return 0


def rank_of(babysitter: subprocess.Popen[str]) -> psutil.Process:
    """The training rank under a node's babysitter."""
    for p in psutil.Process(babysitter.pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if str(WORKER) in p.cmdline() and "RANK" in p.environ():
                return p
    raise RuntimeError("no rank under node 2's babysitter")


def one_run(workdir: Path, name: str, steps: int, limit_at: int | None, args: Any,
            evict: bool) -> dict[str, Any]:
    """One run of the job; from step ``limit_at`` on (None: never), node 2 is slowed by
    ``args.cause``."""
    run_dir = workdir / name
    config = workdir / f"{name}.yaml"
    with contextlib.ExitStack() as stack:
        net = stack.enter_context(netns.network(NODES + SPARES)) if args.cause == "link" \
            else None
        if net is not None:  # every node on its own address: the rendezvous on node 0's
            where, leader = f"  rdzv-endpoint: '{net.address(0)}:29400'\n", ""
        else:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                where, leader = "", f"leader: '127.0.0.1:{s.getsockname()[1]}', "
        config.write_text(
            f"launch:\n  script: {WORKER}\n  nproc-per-node: 1\n  nnodes: '{NODES}'\n{where}"
            f"  args: {json.dumps(['--steps', str(steps), *JOB])}\n"
            f"run_dir: {run_dir}\ncheckpoints: {{every_steps: 25}}\n"
            f"nodes: {{{leader}spares: {SPARES}, "
            f"evict_slow: {'true' if evict else 'false'}}}\n")
        return _run(workdir, name, run_dir, config, steps, limit_at, args, net, stack)


def _run(workdir: Path, name: str, run_dir: Path, config: Path, steps: int,
         limit_at: int | None, args: Any, net: netns.Network | None,
         stack: contextlib.ExitStack) -> dict[str, Any]:
    environ = {**env(), "BABYSIT_SECRET": "slow-node-benchmark"}
    procs: dict[int, subprocess.Popen[str]] = {}

    def start(node: int) -> None:
        log = open(workdir / f"{name}-node{node}.log", "w")  # noqa: SIM115 - lives with the run
        prefix = net.prefix(node) if net is not None else []
        procs[node] = subprocess.Popen(
            [*prefix, sys.executable, "-m", "babysit", "run", "--node-rank", str(node),
             str(config)], cwd=workdir, env=environ, stdout=log, stderr=subprocess.STDOUT,
            text=True)

    limited_at: float | None = None
    limit = (stack.enter_context(cpulimit.cpu_limit(quota_us=int(args.quota * 10000)))
             if limit_at is not None and args.cause == "cpu" else None)
    started = time.time()
    for node in range(NODES):
        start(node)
    shown = 0.0
    while any(p.poll() is None for p in procs.values()):
        time.sleep(0.5)
        step = newest_step(run_dir)
        if NODES not in procs and step >= 1:
            start(NODES)  # the spare joins a running attempt and waits
        if limited_at is None and limit_at is not None and step >= limit_at:
            if limit is not None:
                limit.add(rank_of(procs[2]).pid)
                what = f"rank limited to {args.quota:.0%} of a core"
            else:
                assert net is not None
                net.slow(2, args.rate)
                what = f"link slowed to {args.rate}"
            limited_at = time.time()
            print(f"  {name}: node 2's {what} at step {step}", flush=True)
        if time.time() - shown > 30:
            shown = time.time()
            print(f"  {name}: step {step} of {steps}, {shown - started:.0f} s", flush=True)
        if time.time() - started > 6 * 3600:
            raise SystemExit(f"{name}: still running after 6 h")
    codes = {n: p.returncode for n, p in procs.items()}
    status = subprocess.run([sys.executable, "-m", "babysit", "status", "--json", str(run_dir)],
                            cwd=workdir, env=env(), capture_output=True, text=True, check=True)
    snap = json.loads(status.stdout)
    journal = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    costs = [e for e in journal if e["event"] == "slow_node_cost"]
    evicted = [e for e in journal if e["event"] == "node_evicted"]
    named = [e["finding"]["ranks"] for e in journal if e["event"] == "finding"
             and e["finding"]["detector"] in ("slow_compute", "slow_link")]
    return {"codes": codes, "ledger": snap["goodput"], "step": snap["step"], "loss": snap["loss"],
            "named_after_s": costs[0]["time"] - limited_at if costs and limited_at else None,
            "cost": costs[0] if costs else None, "named": named,
            "evicted_after_s": evicted[0]["time"] - limited_at if evicted and limited_at
            else None,
            "launches": [sorted(e["nodes"]) for e in journal if e["event"] == "launch"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=5.0,
                   help="fault-free training time the job is sized to")
    p.add_argument("--cause", choices=("cpu", "link"), default="cpu",
                   help="what slows node 2: a CPU limit on its rank, or its link's rate")
    p.add_argument("--quota", type=float, default=0.1,
                   help="the slow node's rank's share of one core (--cause cpu)")
    p.add_argument("--rate", default="1mbit",
                   help="the slow node's link rate, both ways, in tc units (--cause link)")
    p.add_argument("--runs", default="clean,kept,evicted",
                   help="which of the runs to make, comma-separated (clean comes first)")
    p.add_argument("--at", type=float, default=0.2,
                   help="the fraction of the steps at which the limit starts")
    p.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="make the runs N times, interleaved, and print their distribution")
    p.add_argument("--keep", type=Path, metavar="DIR", help="run in DIR and keep it")
    args = p.parse_args()
    names = [n for n in ("clean", "kept", "evicted") if n in args.runs.split(",")]
    if "clean" not in names:
        raise SystemExit("--runs must include clean: the other runs' pace is measured by it")
    why = cpulimit.available() if args.cause == "cpu" else netns.available()
    if why is not None:
        raise SystemExit(f"cannot slow a node here ({args.cause}): {why}")
    with contextlib.ExitStack() as stack:
        workdir = workdir_for(stack, args.keep, "babysit-slow-node-")
        step_s, _, _ = calibrate(workdir, NODES, tuple(JOB))
        steps = int(args.minutes * 60 / step_s)
        at = int(args.at * steps)
        slowed = (f"rank limited to {args.quota:.0%} of a core" if args.cause == "cpu" else
                  f"link at {args.rate} both ways")
        print(f"job: {steps} steps of {1000 * step_s:.1f} ms (~{args.minutes:g} min fault-free "
              f"here) on {NODES} nodes and {SPARES} spare; node 2's {slowed} from step {at}",
              flush=True)
        runs: list[tuple[str, dict[str, Any]]] = []
        for i in range(args.repeat):
            for name in names:
                label = name if args.repeat == 1 else f"{name}-{i + 1}"
                runs.append((name, one_run(workdir, label, steps,
                                           None if name == "clean" else at, args,
                                           evict=name != "kept")))
        clean_step = statistics.median(r["ledger"]["seconds"]["productive"]
                                       for name, r in runs if name == "clean") / steps
        print(f"\n{'run':10} {'wall s':>8} {'pace goodput':>13} {'ledger goodput':>15} "
              f"{'step':>6} {'loss':>8}  exits / slow node")
        for i, (name, r) in enumerate(runs):
            label = name if args.repeat == 1 else f"{name}-{i // len(names) + 1}"
            print(f"{label:10} {_row(r, steps, clean_step)}", flush=True)
        if args.repeat > 1:
            print(f"\ndistribution over {args.repeat} runs of each:")
            for name in names:
                print(f"  {name:8} {_distribution([r for n, r in runs if n == name], name)}")


def _row(r: dict[str, Any], steps: int, clean_step: float) -> str:
    """One run's line: its times, goodput, and what became of the slow node."""
    ledger = r["ledger"]
    pace = steps * clean_step / ledger["wall_s"]
    note = ""
    if r["cost"]:
        c = r["cost"]
        note = (f"named {r['named_after_s']:.0f} s after the limit, {c['slowdown']:.0%} "
                f"slower, keep ~{c['keep_s']:.0f} s vs evict ~{c['evict_s']:.0f} s: "
                f"{c['verdict']}")
        if r["evicted_after_s"] is not None:
            note += f", evicted {r['evicted_after_s']:.0f} s after the limit"
    elif r["named"]:
        note = f"named ranks {r['named']} on no one node"
    return (f"{ledger['wall_s']:8.1f} {100 * pace:12.1f}% {100 * ledger['goodput']:14.1f}% "
            f"{r['step']:6} {r['loss']:8.4f}  {r['codes']} {note}")


def _distribution(runs: list[dict[str, Any]], name: str) -> str:
    """How the runs of one kind went: nobody named (clean), or the slow node named (and, in
    ``evicted``, evicted for the spare) before the job ended, and how long after the limit."""
    n = len(runs)
    if name == "clean":
        quiet = sum(1 for r in runs if not r["named"])
        return f"nobody named in {quiet} of {n}"
    named = [r["named_after_s"] for r in runs if r["named_after_s"] is not None]
    said = f"named in {len(named)} of {n}" + (f", after {_spread(named)}" if named else "")
    if name == "kept":
        return said
    spare = [r["evicted_after_s"] for r in runs if r["evicted_after_s"] is not None
             and r["launches"][-1] == [0, 1, NODES]]
    return said + f"; evicted for the spare in {len(spare)} of {n}" + \
        (f", after {_spread(spare)}" if spare else "")


def _spread(seconds: list[float]) -> str:
    return (f"median {statistics.median(seconds):.0f} s ({min(seconds):.0f}-"
            f"{max(seconds):.0f} s)")


if __name__ == "__main__":
    main()
