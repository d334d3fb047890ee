"""What keeping the last completed step costs a training loop: the keeper's mark and hooks.

    .venv/bin/python benchmarks/mark_cost.py [--steps 4000] [--rounds 5] [--numpy]
                                             [--loop batches|while|both]

One process, a real ``Intake`` on a real socket, ``attach(model, optimizer, scheduler)`` as a
babysat rank (the ``BABYSIT_*`` variables and a directive file), and a training loop with a
small model (``Linear(64, 64)``, Adam, StepLR): each step draws a batch, runs forward and
backward, reports, and steps the optimizer and scheduler. The loop draws from
``run.batches(data)`` with ``next()`` at each step's start (``--loop batches``, the default: a
``for`` loop costs the same), or is nanoGPT's ``while run.step_count < steps:`` drawing its
batch itself (``--loop while``), where the point between steps comes from the optimizer's hooks
alone (``supervisor/rank/boundary.py``); ``both`` times the two side by side. Each loop is
timed with the directive's ``just_in_time`` on (the keeper marks each step's end: the random
streams into its mark file, the optimizer's step hooks, the scheduler's epoch, the bookkeeping
of where a step ends; the model's forward pre-hook in the ``while`` loop, the check at the top
of ``run.batches()`` in the other) and off (no hooks at all in the ``while`` loop), in
alternating rounds, and the intake is drained between rounds.

Printed for each loop: the whole step's CPU time (median over rounds; as noisy as a busy
machine, far noisier than the work measured), then the median of each part of the step where
babysit works (drawing the batch, the forward, ``run.step()``, ``opt.step()``: wall time, each
step timed), off and on; their differences summed are the work babysit adds to a step, which a
busy machine moves far less than the whole step. Last, the median and p90 of one mark's own
time, measured inside the loop (its caches cold as a real step leaves them).
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

SEGMENTS = ("draw", "forward", "report", "update")
"""The parts of a step where babysit works: drawing the batch (the top of ``run.batches()``),
the forward (the model's pre-hook), ``run.step()``, and ``opt.step()`` (its hooks, the mark at
the step's end)."""


def loop(steps: int, keep: bool, numpy: bool, tmp: Path, intake: Intake,
         marks: list[float] | None = None, shape: str = "batches",
         parts: dict[str, list[float]] | None = None) -> float:
    """Microseconds per training step of one round of the ``shape`` loop; with ``marks``, each
    mark's own microseconds appended to it; with ``parts``, each step's microseconds in each
    of ``SEGMENTS``."""
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

        def timed(*args: object, **kw: object) -> None:
            t = time.perf_counter()
            mark(*args, **kw)  # type: ignore[arg-type]
            marks.append(1e6 * (time.perf_counter() - t))

        keeper.mark = timed
    x = torch.randn(8, 64)
    data = [x] * (steps + 1)
    # The batches loop draws with next() at each step's start (torchtitan's shape; a for loop
    # costs the same), so that the draw can be timed apart.
    batches = iter(run.batches(data)) if shape == "batches" else None
    clock = time.perf_counter
    started = time.thread_time()
    while run.step_count < steps:
        if numpy:
            np.random.rand()
        t0 = clock()
        batch = next(batches) if batches is not None else data[run.step_count]
        t1 = clock()
        loss = model(batch).square().mean()
        t2 = clock()
        opt.zero_grad()
        loss.backward()
        value = loss.item()
        t3 = clock()
        keep_step = run.step(loss=value)
        t4 = clock()
        if keep_step:
            opt.step()
        t5 = clock()
        sched.step()
        if parts is not None:
            for i, (a, b) in enumerate(((t0, t1), (t1, t2), (t3, t4), (t4, t5))):
                parts[SEGMENTS[i]].append(1e6 * (b - a))
    took = time.thread_time() - started
    run.close()
    intake.drain()
    return 1e6 * took / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--numpy", action="store_true")
    p.add_argument("--loop", choices=["batches", "while", "both"], default="batches")
    args = p.parse_args()
    shapes = ["batches", "while"] if args.loop == "both" else [args.loop]
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        run_dir = tmp / "run"
        run_dir.mkdir(mode=0o700)
        token = os.urandom(16)
        intake = Intake(run_dir / "telemetry.sock", token).open()
        os.environ.update({protocol.ENV_SOCKET: str(intake.path), protocol.ENV_TOKEN: token.hex(),
                           protocol.ENV_ATTEMPT: "0", "RANK": "0", "WORLD_SIZE": "1"})
        times: dict[tuple[str, bool], list[float]] = {
            (shape, keep): [] for shape in shapes for keep in (False, True)}
        parts: dict[tuple[str, bool], dict[str, list[float]]] = {
            key: {name: [] for name in SEGMENTS} for key in times}
        marks: dict[str, list[float]] = {shape: [] for shape in shapes}
        for shape in shapes:  # warm-up: imports, allocator
            loop(200, True, args.numpy, tmp, intake, shape=shape)
        for _ in range(args.rounds):
            for shape in shapes:
                for keep in (False, True):
                    times[shape, keep].append(loop(args.steps, keep, args.numpy, tmp, intake,
                                                   marks[shape], shape, parts[shape, keep]))
        numpy_note = ", numpy drawn every step" if args.numpy else ""
        print(f"{args.steps} steps x {args.rounds} rounds{numpy_note}; us per step, medians; "
              "just_in_time off -> on:")
        for shape in shapes:
            off, on = (statistics.median(times[shape, k]) for k in (False, True))
            print(f"  {shape} loop: the whole step (CPU time) {off:.1f} -> {on:.1f} "
                  f"({on - off:+.1f}; the machine's noise is of this order)")
            added = 0.0
            for name in SEGMENTS:
                a, b = (statistics.median(parts[shape, k][name]) for k in (False, True))
                added += b - a
                print(f"    {name:8s} {a:7.1f} -> {b:7.1f}  ({b - a:+.1f})")
            mine = sorted(marks[shape])
            print(f"    babysit's work added to a step: {added:.1f} us, of which one mark "
                  f"{statistics.median(mine):.1f} (p90 {mine[int(0.9 * len(mine))]:.1f})")
        intake.close()


if __name__ == "__main__":
    main()
