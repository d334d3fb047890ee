"""How long a hung rank takes to be named: its last step -> babysit's hang diagnosis.

    .venv/bin/python benchmarks/hang_naming.py [--ranks 2 8 24] [--at 3 30 300] [--repeats 3]
                                               [--what hang SIGSTOP]

One node, ``tests/workers/tiny_train.py`` (DDP, gloo, 0.05 s of sleep per step) under ``babysit
run`` with the default policy; on the first attempt, rank N-3 stops just before step ``--at``:
``hang`` sleeps outside the all-reduce the others then wait in (only the stacks tell it apart),
``SIGSTOP`` stops the process (its state says it). The figure is the time from rank 0's last
step to the ``hang_diagnosis`` entry, split into the stall's suspicion (the hang timer:
``max(floor_s, k x p99 step)``) and its confirmation (process states, CPU, stacks). Each case is
stopped once the diagnosis is journaled: the relaunch is ``benchmarks/recovery.py``'s figure.

The step at which the rank stops decides what else the machine does then: at step 3 the job
has barely started; at 30 (a few seconds in) the warm standby is starting (every rank of the
next attempt importing torch); at 300 it is ready and idle. Medians of ``--repeats`` runs,
cases interleaved.
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

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "workers" / "tiny_train.py"


def one(workdir: Path, ranks: int, at: int, what: str) -> dict[str, float]:
    """One run: the seconds from rank 0's last step to the diagnosis, and its split."""
    log = workdir / "steps.log"
    config = workdir / "run.yaml"
    args = ["--steps", str(at + 40), "--step-sleep", "0.05", "--ddp",
            "--at", f"0:{ranks - 3 if ranks > 2 else 1}:{at}:{what}", "--step-log", str(log)]
    config.write_text(f"launch:\n  script: {WORKER}\n  nproc-per-node: {ranks}\n"
                      f"  args: {json.dumps(args)}\n"
                      f"run_dir: {workdir / 'run'}\n"
                      f"checkpoints: {{every_steps: 10, probation_steps: 5}}\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    events = workdir / "run" / "events.jsonl"
    with open(workdir / "babysit.out", "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "babysit", "run", str(config)],
                                cwd=workdir, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        diagnosis = None
        deadline = time.monotonic() + 600
        while diagnosis is None and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
            if events.exists():
                diagnosis = next((e for e in map(json.loads, events.read_text().splitlines())
                                  if e["event"] == "hang_diagnosis"), None)
        with contextlib.suppress(ProcessLookupError):  # babysit's own session
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if diagnosis is None:
        tail = (workdir / "babysit.out").read_text()[-3000:]
        raise SystemExit(f"{ranks} ranks, step {at}, {what}: no hang diagnosis; babysit said:\n"
                         f"{tail}")
    last = max(float(t) for t, attempt, _ in (line.split() for line in
                                              log.read_text().splitlines()) if attempt == "0")
    named = diagnosis["suspects"] == [ranks - 3 if ranks > 2 else 1]
    return {"last step -> named": diagnosis["time"] - last,
            "  last step -> suspected": diagnosis["time"] - diagnosis["seconds"] - last,
            "  confirmation": diagnosis["seconds"],
            "named the right rank (1 = yes)": float(named)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 8, 24])
    parser.add_argument("--at", type=int, nargs="+", default=[3, 30, 300],
                        help="the step the rank stops at (3: at once; 30: while the warm "
                        "standby starts; 300: after it is ready)")
    parser.add_argument("--what", nargs="+", default=["hang", "SIGSTOP"],
                        choices=["hang", "SIGSTOP"])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cases = [(n, at, what) for n in args.ranks for at in args.at for what in args.what]
    results: dict[tuple[int, int, str], list[dict[str, float]]] = {c: [] for c in cases}
    for i in range(args.repeats):
        for case in cases:
            with tempfile.TemporaryDirectory(prefix="babysit-hang-naming-") as tmp:
                results[case].append(one(Path(tmp), *case))
            print(f"repeat {i + 1}/{args.repeats}: {case} done", file=sys.stderr, flush=True)
    print(f"seconds, median of {args.repeats} (this machine: {os.cpu_count()} cores)")
    print("| ranks | stops at step | how | last step -> named | suspected | confirmation "
          "| right rank |\n| ---: | ---: | --- | ---: | ---: | ---: | ---: |")
    for (n, at, what), runs in results.items():
        def median(key: str, runs: list[dict[str, float]] = runs) -> float:
            return statistics.median(r[key] for r in runs)
        right = sum(int(r["named the right rank (1 = yes)"]) for r in runs)
        print(f"| {n} | {at} | {what} | {median('last step -> named'):.2f} "
              f"| {median('  last step -> suspected'):.2f} | {median('  confirmation'):.2f} "
              f"| {right}/{len(runs)} |")


if __name__ == "__main__":
    main()
