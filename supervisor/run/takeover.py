"""What a supervisor taking over an unfinished run learns from the files the workers left.

The previous supervisor died (killed, OOM, reboot) while its workers trained on. What they did
then was not watched: their checkpoints stay pending until this supervisor observes their
probation steps (``Recovery.resume_latest``), and if they finished the job, this supervisor
says so and retrains nothing.
"""

from __future__ import annotations

from pathlib import Path

from babysit.supervisor.contract.directive import closed_ranks


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
