"""What keeping the last completed step costs a training loop: the keeper's mark and hooks.

    .venv/bin/python benchmarks/mark_cost.py [--steps 4000] [--rounds 5] [--numpy]

One process, a real ``Intake`` on a real socket, ``attach(model, optimizer, scheduler)`` as a
babysat rank (the ``BABYSIT_*`` variables and a directive file), and a training loop over
``run.batches()`` with a small model (``Linear(64, 64)``, Adam, StepLR): each step draws a
batch, runs forward and backward, reports, and steps the optimizer and scheduler. The same loop
is timed with the directive's ``just_in_time`` on (the keeper marks each step's start: the
random streams into its mark file, the optimizer's step hooks, the scheduler's epoch) and off,
in alternating rounds, and the intake is drained between rounds. Printed: the median over
rounds of the microseconds per step of each and their difference (as noisy as the machine),
and the median and p90 of one mark's own time, measured inside the loop (its caches cold as
a real step leaves them).
``--numpy`` also draws from numpy's global generator every step, which makes the mark copy
numpy's state (the dearest stream: its ``get_state``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from babysit import attach
from babysit.supervisor.contract import protocol
from babysit.supervisor.contract.directive import Directive
from babysit.supervisor.node.intake import Intake


def loop(steps: int, keep: bool, numpy: bool, tmp: Path, intake: Intake,
         marks: list[float] | None = None) -> float:
    """Microseconds per training step of one round; with ``marks``, each mark's own
    microseconds appended to it."""
    directive = tmp / f"directive-{keep}.json"
    Directive(just_in_time={"marks": str(tmp / "marks"), "hold_s": 10.0} if keep else {}
              ).write(directive)
    os.environ[protocol.ENV_DIRECTIVE] = str(directive)
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100)
    run = attach(model=model, optimizer=opt, scheduler=sched)
    keeper = run._keeper
    if keep and marks is not None:
        mark = keeper.mark

        def timed(*args: object) -> None:
            t = time.perf_counter()
            mark(*args)  # type: ignore[arg-type]
            marks.append(1e6 * (time.perf_counter() - t))

        keeper.mark = timed
    x = torch.randn(8, 64)
    data = [x] * (steps + 1)
    started = time.perf_counter()
    for batch in run.batches(data):
        if run.step_count >= steps:
            break
        if numpy:
            np.random.rand()
        loss = model(batch).square().mean()
        opt.zero_grad()
        loss.backward()
        if run.step(loss=loss.item()):
            opt.step()
        sched.step()
    took = time.perf_counter() - started
    run.close()
    intake.drain()
    return 1e6 * took / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--numpy", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        run_dir = tmp / "run"
        run_dir.mkdir(mode=0o700)
        token = os.urandom(16)
        intake = Intake(run_dir / "telemetry.sock", token).open()
        os.environ.update({protocol.ENV_SOCKET: str(intake.path), protocol.ENV_TOKEN: token.hex(),
                           protocol.ENV_ATTEMPT: "0", "RANK": "0", "WORLD_SIZE": "1"})
        times: dict[bool, list[float]] = {True: [], False: []}
        marks: list[float] = []
        loop(200, True, args.numpy, tmp, intake)  # warm-up: imports, allocator
        for _ in range(args.rounds):
            for keep in (False, True):
                times[keep].append(loop(args.steps, keep, args.numpy, tmp, intake, marks))
        off, on = (statistics.median(times[k]) for k in (False, True))
        print(f"{args.steps} steps x {args.rounds} rounds, medians (us per step)"
              f"{', numpy drawn every step' if args.numpy else ''}:")
        print(f"  just_in_time off   {off:8.1f}")
        print(f"  just_in_time on    {on:8.1f}")
        print(f"  difference         {on - off:8.1f} us a step ({100 * (on - off) / off:.1f}% of "
              f"this {off / 1000:.2f} ms step; the machine's noise is of this order)")
        print(f"  one mark, in the loop: median {statistics.median(marks):.1f} us, p90 "
              f"{sorted(marks)[int(0.9 * len(marks))]:.1f} us (the rest of the keeper's cost: "
              "two optimizer hooks a step)")
        intake.close()


if __name__ == "__main__":
    main()
