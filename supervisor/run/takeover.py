"""What a supervisor taking over an unfinished run learns from the files the workers left.

The previous supervisor died (killed, OOM, reboot) while its workers trained on. What they did
then was not watched: their checkpoints stay pending until this supervisor observes their
probation steps (``Recovery.resume_latest``), and if they finished the job, this supervisor
says so and retrains nothing. ``take_over`` does all of it once, before the first launch.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from babysit.policies.types import Finding, Remedy
from babysit.supervisor.config.plan import RunPlan
from babysit.supervisor.contract.directive import closed_ranks
from babysit.supervisor.node import launcher
from babysit.supervisor.run.journal import PriorRun
from babysit.supervisor.run.watch import Watch


@dataclass(frozen=True, slots=True)
class Takeover:
    """What this supervisor inherits from the one that died."""

    prior: PriorRun
    inherited: Remedy | None
    """A remedy it decided and never launched: applied by the first launch."""
    finished_unwatched: int | None
    """The step the job finished at while no supervisor watched; None if it did not."""
    fields: dict[str, Any]
    """The ``supervisor_takeover`` journal entry's fields."""

    def ended(self) -> dict[str, Any] | None:
        """The ``run_finished`` entry's fields when the job finished unwatched, else None."""
        step = self.finished_unwatched
        if step is None:
            return None
        return {"step": step, "state": "succeeded", "exit_code": 0,
                "reason": f"every rank of attempt {self.prior.last_attempt} closed its run at "
                          f"step {step} while no supervisor watched; nothing left to train"}

    def describe(self) -> str:
        return (f"babysit: taking over an unfinished run (attempt {self.prior.last_attempt}); "
                f"stopped {len(self.fields['stopped_pids'])} leftover process(es)")


def begin(prior: PriorRun | None, plan: RunPlan, watch: Watch, journal: Callable[..., None],
          log: Callable[[str], None]) -> Takeover | None:
    """At a run's start: when this run directory's last supervisor died without finishing it
    (``prior``: its record), take its run over (``take_over``), journaled and said; None for a
    fresh or finished run."""
    if prior is None or not prior.unfinished:
        return None
    prior = dataclasses.replace(prior, last_step=high_water(plan.run_dir, prior))
    taken = take_over(prior, plan.run_dir, plan.config.launch.stop_grace_s, watch)
    journal("supervisor_takeover", **taken.fields)
    log(taken.describe())
    return taken


def high_water(run_dir: Path, prior: PriorRun, tail_bytes: int = 1 << 16) -> int:
    """The newest step the dead supervisor observed in its last attempt, the high-water mark
    of the timeline that ran (``checkpoints/lineage.py``): that attempt's newest row in
    ``metrics.jsonl`` (steps only grow within an attempt, so the file's tail has it); none yet,
    the step it resumed from (``prior.last_step``). Not the journal's step stamps: until an
    attempt's first step they still carry the step of the one before, which after a rollback
    is the abandoned timeline's."""
    try:
        with open(run_dir / "metrics.jsonl", "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - tail_bytes))
            lines = f.read().splitlines()
    except OSError:
        return prior.last_step
    for line in reversed(lines):
        try:
            row = json.loads(line)
        except ValueError:
            continue  # torn, or the tail's first, partial line
        if isinstance(row, dict) and row.get("attempt") == prior.last_attempt \
                and isinstance(row.get("step"), int):
            return int(row["step"])
    return prior.last_step


def take_over(prior: PriorRun, run_dir: Path, stop_grace_s: float, watch: Watch) -> Takeover:
    """The previous supervisor of this run died without finishing it: stop what it left
    running, keep what it had decided (its judgement, skips, LR orders), and see whether the
    job finished meanwhile. ``watch`` takes the inherited judgement."""
    stopped = launcher.stop_leftovers(prior.pids, run_dir, stop_grace_s)
    if prior.watch_state:
        watch.load_state_dict(prior.watch_state)
    if prior.directive:  # the skips and LR orders the last attempt actually ran with
        watch.adopt_orders(prior.directive)
    for stream in prior.streams:  # where its data was: an inherited skip goes out in samples
        watch.observe_stream(stream)
    inherited = None
    if prior.pending:
        inherited = Remedy.from_json(prior.pending["remedy"],
                                     Finding.from_json(prior.pending["finding"]))
    finished = finished_unwatched(run_dir / "attempts" / str(prior.last_attempt))
    fields = {"previous_attempt": prior.last_attempt, "stopped_pids": stopped,
              "watched_until_step": prior.last_step, "finished_unwatched": finished,
              "inherited_remedy": inherited.to_json() if inherited else None,
              "skip": [{"start": r.start, "end": r.end,
                        **({"samples": list(r.samples)} if r.samples else {})}
                       for r in watch.skips],
              "lr_scale": watch.lr_scale}
    return Takeover(prior, inherited, finished, fields)


def finished_unwatched(attempt_dir: Path) -> int | None:
    """The step at which every rank of the previous supervisor's last attempt closed its run
    (``run.close()``), or None. What was still running then (torchrun winding down, a rank
    stuck in its process teardown) had finished its training: the caller stopped it."""
    closed = closed_ranks(attempt_dir)
    if not closed:
        return None
    worlds = {int(r.get("world_size", 0)) for r in closed.values()}
    if len(worlds) != 1 or set(closed) != set(range(worlds.pop())):
        return None
    return max(int(r.get("step", 0)) for r in closed.values())

