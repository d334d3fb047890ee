"""A rollback's plan in the directive's terms: ``RollbackPlan``.

The plan itself (checkpoint, skip range, LR cut and re-warm) is decided in one place,
``policies/rollback.py``, which the rules call; it speaks plain data. This module only translates
it into the types a directive carries (``Resume``, ``SkipRange``, ``LrRamp``) once the
recovery has verified the checkpoint to resume from, and back (the LR orders in force).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from babysit.policies import rollback
from babysit.policies.rollback import Known, Orders, Plan, Ramp
from babysit.policies.types import Remedy
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
    save_at: int | None = None
    """A rerun's checkpoint at this cursor (``Plan.save_at``), when past its resume."""

    def describe(self) -> str:
        """The LR orders in words, e.g. ``LR x0.5, back to x1 over batches 251-300``."""
        return describe_lr(self.lr_scale, self.lr_ramp)


def describe_lr(scale: float, ramp: LrRamp | None) -> str:
    """An attempt's LR orders in words (journal, console, status)."""
    if ramp is None:
        return f"LR x{scale:g}"
    return (f"LR x{scale:g} from batch {ramp.cut}, back to x{ramp.to:g} over batches "
            f"{ramp.start}-{ramp.end - 1}")


def lr_orders(lr_scale: float, lr_ramp: LrRamp | None) -> Orders:
    """The directive's LR orders as the plan's plain data."""
    ramp = None if lr_ramp is None else Ramp(lr_ramp.cut, lr_ramp.start, lr_ramp.end, lr_ramp.to)
    return Orders(lr_scale, ramp)


def in_directive(plan: Plan, resume: Resume | None) -> RollbackPlan:
    """``plan`` in the directive's types, resuming from ``resume`` (the recovery's verified
    choice, which may be older than the one the plan was offered)."""
    plan = plan.resumed(resume.cursor if resume is not None else None)
    skip = None if plan.skip is None else SkipRange(plan.skip.start, plan.skip.end)
    r = plan.orders.ramp
    ramp = None if r is None else LrRamp(cut=r.cut, start=r.start, end=r.end, to=r.to)
    save_at = plan.save_at
    if save_at is not None and save_at <= (resume.cursor if resume is not None else 0):
        save_at = None  # the rerun starts there: nothing to save
    return RollbackPlan(resume, skip, plan.orders.scale, ramp, plan.base, save_at)


def plan_relaunch(remedy: Remedy | None, resume: Resume | None, cursor_at: Mapping[int, int],
                  lr_scale: float = 1.0, lr_ramp: LrRamp | None = None) -> RollbackPlan:
    """The plan for the attempt ``remedy`` causes (None: a plain start or a takeover), from the
    remedy's own sizes (``rollback.for_remedy``): for a remedy whose plan the rules' ``judge``
    did not hand over. ``cursor_at`` maps recent steps to their data cursor; ``lr_scale`` and
    ``lr_ramp`` are the LR orders in force (the last attempt's)."""
    known = Known(cursor_at=cursor_at, orders=lr_orders(lr_scale, lr_ramp))
    return in_directive(rollback.for_remedy(remedy, known), resume)
