"""What ``run.step()`` costs a training loop, with and without ``scalars=``.

    .venv/bin/python benchmarks/step_cost.py [--calls 20000]

A real ``Intake`` listens on a real socket in a temporary folder; ``attach()`` connects to it
as a rank of a babysat run does (the ``BABYSIT_*`` variables), with no model or optimizer.
Calls are timed in batches of 500 with ``time.perf_counter``, and the intake is drained between
batches (outside the timing) as the supervisor's loop does each tick, so no report is dropped
for a full queue. Printed: the median over batches of the microseconds per call for the plain
call (``loss``, ``grad_norm``, ``tokens``) and for the same call with one scalar
(``scalars={"eval_loss": x}``, which a script passes only at its eval steps).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from babysit import attach
from babysit.supervisor.contract import protocol
from babysit.supervisor.node.intake import Intake

BATCH = 500


def measure(calls: int, scalars: bool) -> tuple[float, int]:
    """Median µs per call over batches, and how many reports the intake received."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        run_dir.mkdir(mode=0o700)
        token = os.urandom(16)
        intake = Intake(run_dir / "telemetry.sock", token).open()
        os.environ.update({protocol.ENV_SOCKET: str(intake.path),
                           protocol.ENV_TOKEN: token.hex(), "RANK": "0", "WORLD_SIZE": "1"})
        run = attach()
        per_call, received = [], 0
        try:
            for _ in range(calls // BATCH):
                extra = {"eval_loss": 2.5} if scalars else None
                t0 = time.perf_counter()
                for i in range(BATCH):
                    run.step(loss=1.0 + i * 1e-6, grad_norm=0.5, tokens=4096, scalars=extra)
                per_call.append((time.perf_counter() - t0) / BATCH * 1e6)
                received += len(intake.drain())
        finally:
            run.close()
            intake.close()
        return statistics.median(per_call), received


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=20_000)
    args = parser.parse_args()
    for label, scalars in (("step()", False), ("step(scalars={1 name})", True)):
        micros, received = measure(args.calls, scalars)
        print(f"{label:<24} {micros:6.2f} µs per call (median of {args.calls // BATCH} batches "
              f"of {BATCH}; {received} reports received)")


if __name__ == "__main__":
    main()
