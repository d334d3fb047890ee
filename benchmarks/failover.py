"""The leader's node dies: how long until the run trains again, led by another node.

    .venv/bin/python benchmarks/failover.py [--repeats 3] [--loopback]

Two "nodes" (each its own ``babysit run --node-rank R``, each in its own network namespace with
its own address on a bridge, as ``tests/netns.py`` makes them; ``--loopback`` puts both on
127.0.0.1 instead), each with 2 gloo ranks of ``tests/workers/tiny_train.py`` (0.05 s steps,
a checkpoint every 5 steps), ``--nnodes 1:2``. At step 15, node 0's babysitter and every
process under it are SIGKILLed, as a dead host's would be. Node 1 then stops its own ranks,
watches node 0's lease on the shared run directory go stale, claims the next term, takes the
run over from its journal and relaunches alone from the newest good checkpoint.

Two cases: only the babysitter's process tree is killed (the host still answers: a connection
to the dead leader's port is refused), and the machine is gone (node 0's link is taken down
first, so nothing answers at all; namespaces only). Printed, medians of ``--repeats`` runs, for
the default ``nodes.heartbeat_s`` / ``nodes.lost_after_s`` (2 s / 15 s) and for a tuned
0.5 s / 3 s:

    kill -> leader_elected     the lease judged stale (lost_after_s of silence, on node 1's clock)
    elected -> relaunch        the takeover: journal read back, listening, the attempt launched
    relaunch -> first step     torchrun, rendezvous, imports, restore, the first step
    kill -> first step         the whole interruption
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests import netns  # noqa: E402  (the benchmark runs from a checkout)

WORKER = ROOT / "tests" / "workers" / "tiny_train.py"
SECRET = "failover benchmark secret"


def read(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def once(tmp: Path, beats: tuple[float, float], net: netns.Network | None,
         host_gone: bool = False) -> dict[str, float]:
    heartbeat, lost_after = beats
    run_dir = tmp / "run"
    where = (f"  rdzv-endpoint: '{net.address(0)}:29400'\n" if net is not None else "")
    leader = "" if net is not None else f"leader: '127.0.0.1:{_free_port()}', "
    config = tmp / "run.yaml"
    config.write_text(
        f"launch:\n  script: {WORKER}\n  nproc-per-node: 2\n  nnodes: '1:2'\n{where}"
        f"  args: ['--steps', '400', '--step-sleep', '0.05', '--ddp']\n"
        f"run_dir: {run_dir}\ncheckpoints: {{every_steps: 5}}\n"
        f"nodes: {{{leader}heartbeat_s: {heartbeat}, lost_after_s: {lost_after}}}\n")
    env = {**os.environ, "BABYSIT_SECRET": SECRET, "PYTHONPATH": str(ROOT),
           "OMP_NUM_THREADS": "1"}
    procs = {}
    for node in (0, 1):
        prefix = net.prefix(node) if net is not None else []
        log = open(tmp / f"node{node}.log", "w")  # noqa: SIM115 - lives as long as the node
        procs[node] = subprocess.Popen(
            [*prefix, sys.executable, "-m", "babysit", "run", "--node-rank", str(node),
             str(config)], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        _until(lambda: any(e.get("event") == "state" and e.get("new") == "running"
                           and (e.get("step") or 0) >= 1 for e in read(run_dir / "events.jsonl")),
               120, tmp)
        _until(lambda: max((json.loads(line)["step"] for line in
                            (run_dir / "metrics.jsonl").read_text().splitlines()
                            if line.strip()), default=0) >= 15, 120, tmp)
        killed = time.time()
        if host_gone:
            assert net is not None
            net.cut(0)  # the machine is gone: nothing answers at its address, not even a reset
        _kill(procs[0].pid)

        def first_step() -> dict[str, Any] | None:
            return next((e for e in read(run_dir / "events.jsonl")
                         if e.get("event") == "state" and e.get("new") == "running"
                         and e.get("attempt", 0) >= 1), None)

        _until(lambda: first_step() is not None, 240, tmp)
        elected = next(e for e in read(run_dir / "nodes" / "1" / "events.jsonl")
                       if e["event"] == "leader_elected")["time"]
        relaunch = next(e for e in read(run_dir / "events.jsonl")
                        if e["event"] == "launch" and e.get("attempt", 0) >= 1)["time"]
        step = first_step()
        assert step is not None
        return {"kill -> leader_elected": elected - killed,
                "elected -> relaunch": relaunch - elected,
                "relaunch -> first step": step["time"] - relaunch,
                "kill -> first step": step["time"] - killed}
    finally:
        for proc in procs.values():
            with contextlib.suppress(psutil.Error):
                _kill(proc.pid)


def _kill(pid: int) -> None:
    """SIGKILL a babysitter and everything under it, as a dead host."""
    root = psutil.Process(pid)
    tree = [root, *root.children(recursive=True)]
    for p in tree:
        with contextlib.suppress(psutil.Error):
            p.send_signal(signal.SIGKILL)
    psutil.wait_procs(tree, timeout=10)


def _until(check: Any, timeout: float, tmp: Path) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return
        except (OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            logs = "\n".join((tmp / f"node{n}.log").read_text()[-2000:] for n in (0, 1))
            raise SystemExit(f"timed out; logs:\n{logs}")
        time.sleep(0.1)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--loopback", action="store_true",
                   help="both nodes on 127.0.0.1 (no network namespaces: no root needed)")
    args = p.parse_args()
    why = None if args.loopback else netns.available()
    if why is not None:
        raise SystemExit(f"network namespaces unavailable ({why}); pass --loopback")
    cases = [(beats, gone) for gone in ((False, True) if not args.loopback else (False,))
             for beats in ((2.0, 15.0), (0.5, 3.0))]
    for beats, gone in cases:
        what = "the machine gone (link down, then killed)" if gone else "babysitter killed"
        rows: list[dict[str, float]] = []
        for i in range(args.repeats):
            with tempfile.TemporaryDirectory(prefix="babysit-failover-") as tmp:
                if args.loopback:
                    rows.append(once(Path(tmp), beats, None))
                else:
                    with netns.network(2) as net:
                        rows.append(once(Path(tmp), beats, net, host_gone=gone))
            print(f"  {what}, heartbeat_s={beats[0]:g} lost_after_s={beats[1]:g} run {i + 1}: "
                  + ", ".join(f"{k} {v:.2f} s" for k, v in rows[-1].items()), flush=True)
        print(f"{what}, heartbeat_s={beats[0]:g}, lost_after_s={beats[1]:g} "
              f"(median of {len(rows)}):")
        for key in rows[0]:
            print(f"  {key:26s} {statistics.median(r[key] for r in rows):6.2f} s")


if __name__ == "__main__":
    main()
