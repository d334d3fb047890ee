"""Hang detection latency and time to recover, beside what plain torchrun would do, in one run.

    .venv/bin/python benchmarks/recovery.py [--repeats 3] [--floor-s 10]

Each repeat runs the real CLI on ``tests/workers/tiny_train.py`` (2 gloo ranks, checkpoints
every 10 steps) with rank 1 hanging at step 40, outside the all-reduce rank 0 then waits in.
Every figure comes from the run's own journal and metrics:

- detection latency: the last step any rank reported -> the hang detector firing;
- recovery: detection -> the first step of the relaunched attempt, split into stack diagnosis,
  stopping the workers, and the relaunch itself (torchrun start, rendezvous, import torch,
  checkpoint load, first step);
- cold start: the first attempt's launch -> its first step, the same job without a checkpoint.

torchrun alone notices a rank stuck in a collective only when the process group times out:
the figure printed for it is torch's own default (``default_pg_timeout``), not waited for here.
The hang allowance is ``max(floor_s, k x p99 step time)``; the default policy's floor is 120 s,
this benchmark uses ``--floor-s`` (10 s by default) so a repeat takes under a minute.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def one_run(workdir: Path, floor_s: float) -> dict[str, float]:
    policy = workdir / "policy.yaml"
    policy.write_text(f"detectors:\n  hang:\n    floor_s: {floor_s}\n")
    config = workdir / "run.yaml"
    config.write_text(
        f"launch:\n  script: {ROOT / 'tests' / 'workers' / 'tiny_train.py'}\n"
        f"  nproc-per-node: 2\n  args: [--steps, '60', --hang, '1:40']\n"
        f"run_dir: {workdir / 'run'}\n"
        f"checkpoints: {{every_steps: 10, probation_steps: 5}}\n"
        f"policy: {{name: {policy}}}\n")
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-m", "babysit", "run", str(config)],
                          cwd=workdir, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"babysit failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    journal = read(workdir / "run" / "events.jsonl")
    metrics = read(workdir / "run" / "metrics.jsonl")

    def first(event: str, attempt: int | None = None) -> dict[str, Any]:
        return next(e for e in journal if e["event"] == event
                    and (attempt is None or e["attempt"] == attempt))

    diagnosis = first("hang_diagnosis")
    detected = diagnosis["time"] - diagnosis["seconds"]
    last_progress = max(m["time"] for m in metrics if m["attempt"] == 0)
    first_step = {a: min(m["time"] for m in metrics if m["attempt"] == a) for a in (0, 1)}
    stopped = first("workers_stopped", 0)["time"]
    relaunched = first("launch", 1)["time"]
    return {
        "detection latency": detected - last_progress,
        "recovery: detection -> first healthy step": first_step[1] - detected,
        "  stack diagnosis": diagnosis["seconds"],
        "  stop workers": stopped - diagnosis["time"],
        "  relaunch -> first step (incl. checkpoint load)": first_step[1] - relaunched,
        "cold start: launch -> first step": first_step[0] - first("launch", 0)["time"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--floor-s", type=float, default=10.0)
    args = parser.parse_args()
    from torch.distributed.constants import default_pg_timeout

    runs = []
    for i in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="babysit-bench-") as tmp:
            runs.append(one_run(Path(tmp), args.floor_s))
        print(f"repeat {i + 1}/{args.repeats} done", file=sys.stderr)
    print(f"{'seconds (median of ' + str(len(runs)) + ')':50s} {'babysit':>9s} {'torchrun':>9s}")
    timeout = default_pg_timeout.total_seconds()
    for key in runs[0]:
        median = statistics.median(r[key] for r in runs)
        other = f"{timeout:9.0f}" if key == "detection latency" else f"{'':9s}"
        print(f"{key:50s} {median:9.2f} {other}")
    print(f"\ntorchrun's figure is torch's default process-group timeout for gloo "
          f"({timeout:.0f} s): a rank stuck outside a collective is invisible to torchrun until "
          f"then. babysit's allowance here: max({args.floor_s:g} s floor, 10 x p99 step time).")


if __name__ == "__main__":
    main()
