"""Where the next attempt resumes from, in every mode, and one true ``resume`` entry saying so.

Three sources, asked in this order at each launch:

- a supervisor taking over a dead one's run: the newest usable checkpoint
  (``Recovery.resume_latest``);
- otherwise the remedy's: a rollback's checkpoint before the onset, a relaunch's newest one or
  the just-in-time state its fault's ranks kept (``Recovery.resume_for``);
- in stdout mode, where babysit has no checkpoint of its own, the script's own checkpoint that
  the members put back (``Members.prepare``: the copy babysit kept of it).

The journal's ``resume`` entry names what the attempt really resumes from: in stdout mode the
script's checkpoint, not babysit's empty catalog ("no usable checkpoint") that the members then
made up for. Tools read the journal, so it must not contradict ``babysit status``.

Then the attempt's timeline begins, forked from what it resumes from (``Recovery.begin``,
``checkpoints/lineage.py``): its chain goes to the ranks in the directive, and the states the
fork abandoned are fenced from then on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from babysit.checkpoints import lineage
from babysit.policies.types import Remedy
from babysit.supervisor.contract.directive import Resume
from babysit.supervisor.run.members import Entry, Members
from babysit.supervisor.run.recovery import Recovery
from babysit.supervisor.run.watch import Watch

RESTORED = "script_checkpoint_restored"


@dataclass(frozen=True, slots=True)
class Resuming:
    """What ``resuming`` found: babysit's checkpoint to restore (None: none of its own), the
    step of the script's own checkpoint put back (stdout mode), and the journal entries."""

    resume: Resume | None
    restored: int | None
    entries: list[Entry] = field(default_factory=list)
    chain: lineage.Chain = ()
    """The attempt's timeline and its links back to the run's root (the directive's
    ``lineage``)."""


def resuming(recovery: Recovery, members: Members, watch: Watch, remedy: Remedy | None,
             attempt: int, takeover_step: int | None = None, newest: int = 0) -> Resuming:
    """Where ``attempt`` (caused by ``remedy``; None: a plain start) resumes from.
    ``takeover_step``: the newest step a dead supervisor saw, when this launch takes its run
    over; ``newest``: the newest step any rank of the attempt before reported."""
    if takeover_step is not None:
        resume, entries = recovery.resume_latest(takeover_step)
    else:
        resume, entries = recovery.resume_for(remedy, watch.replayed(remedy), newest)
    prepared = members.prepare(remedy, attempt)
    put_back = next((f for event, f in prepared if event == RESTORED and f.get("from")), None)
    if put_back is None:
        chain, began = recovery.begin(attempt, resume)
        return Resuming(resume, None, [*entries, *prepared, *began], chain)
    step = int(put_back["checkpoint_step"])
    chain, began = recovery.begin(attempt, resume, restored=step)
    said = [(event, f) for event, f in entries if event != "resume" or f.get("from")]
    true: dict[str, Any] = {
        "from": put_back["from"], "checkpoint_step": step, "source": "script",
        "before_step": put_back.get("before_step"),
        "reason": f"the script's own checkpoint at step {step} (its copy, put back)"}
    return Resuming(resume, step, [*said, *prepared, ("resume", true), *began], chain)
