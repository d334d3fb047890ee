"""What a relaunch changes for the run, computed in one place: ``RollbackPlan``.

A remedy (the rules' answer), the step -> data-cursor memory of the watch and the checkpoint
the recovery chose go in; out come the checkpoint to resume from, the batches to skip and the
LR scale with its re-warm. Nothing else decides these, and ``plan_relaunch`` is pure, so every
case is a fast test:

- skip: ``[cursor(onset) - 1 - skip_before, cursor(detected) + skip_after)`` in data-cursor
  batches (the batch behind step s is cursor(s) - 1). After a supervisor takeover the cursor
  memory is empty and the finding's own onset cursor stands in.
- LR: a rollback cuts the scale to ``base x lr_scale`` where the skipped batches begin (the
  replayed steps before them trained well the first time, at ``base``); past the skipped
  batches it returns linearly to ``base`` over ``lr_rewarm`` batches (the ramp). When the same
  region spiked again (``lr_rewarm`` None) the lower scale becomes the new base, from the
  resume point on, and stays.
- SDC rollbacks skip nothing and keep the LR (the rules ask for neither); relaunches after a
  hang or a crash change neither.

Units: cursors are global batches consumed; ``base`` is the LR multiplier the run returns to.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from babysit.policies.types import Action, Incident, Remedy
from babysit.supervisor.contract.directive import LrRamp, Resume, SkipRange


@dataclass(frozen=True, slots=True)
class RollbackPlan:
    """What the next attempt is told beyond the run's standing orders."""

    resume: Resume | None
    """The checkpoint to resume from (the recovery's choice); None: from scratch."""
    skip: SkipRange | None
    """New batches to skip (added to the earlier ones), or None."""
    lr_scale: float
    """The LR scale from the first step of the attempt."""
    lr_ramp: LrRamp | None
    """How the scale returns to ``base`` after the skipped batches, or None (no cut, or a cut
    that stays)."""
    base: float
    """The scale the run returns to, and keeps after this attempt's ramp."""

    def describe(self) -> str:
        """The LR orders in words, e.g. ``LR x0.5, back to x1 over batches 251-300``."""
        return describe_lr(self.lr_scale, self.lr_ramp)


def describe_lr(scale: float, ramp: LrRamp | None) -> str:
    """An attempt's LR orders in words (journal, console, status)."""
    if ramp is None:
        return f"LR x{scale:g}"
    return (f"LR x{scale:g} from batch {ramp.cut}, back to x{ramp.to:g} over batches "
            f"{ramp.start}-{ramp.end - 1}")


def plan_relaunch(remedy: Remedy | None, resume: Resume | None, cursor_at: Mapping[int, int],
                  lr_scale: float = 1.0, lr_ramp: LrRamp | None = None) -> RollbackPlan:
    """The plan for the attempt ``remedy`` causes (None: a plain start or a takeover).

    ``cursor_at`` maps recent steps to their data cursor; ``lr_scale`` and ``lr_ramp`` are the
    LR orders in force (the last attempt's), which a relaunch that is not a rollback keeps: the
    ramp is in cursor space, so it holds wherever the attempt resumes.
    """
    base = lr_ramp.to if lr_ramp is not None else lr_scale
    keep = RollbackPlan(resume, None, lr_scale, lr_ramp, base)
    if remedy is None or remedy.action is not Action.ROLLBACK \
            or remedy.finding.incident is Incident.SDC:
        return keep
    finding = remedy.finding
    onset = cursor_at.get(finding.onset_step, finding.onset_cursor)
    detected = cursor_at.get(finding.step, onset)
    skip = None
    if onset is not None and detected is not None:
        skip = SkipRange(max(0, onset - 1 - remedy.skip_before), detected + remedy.skip_after)
    cut = base * remedy.lr_scale
    if remedy.lr_scale == 1.0:
        return RollbackPlan(resume, skip, base, None, base)
    if remedy.lr_rewarm is None:  # the same region again: the lower scale stays
        return RollbackPlan(resume, skip, cut, None, cut)
    start = skip.end if skip is not None else (resume.cursor if resume is not None else 0)
    cut_at = skip.start if skip is not None else start
    ramp = LrRamp(cut=cut_at, start=start, end=start + remedy.lr_rewarm, to=base)
    return RollbackPlan(resume, skip, cut, ramp, base)
