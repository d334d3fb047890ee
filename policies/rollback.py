"""What a rollback does, decided in one place: the checkpoint, the batches skipped, the LR cut.

``plan(finding, section, memory, known) -> Plan`` computes a whole rollback from plain data:
the finding, the policy's ``rollback`` section, the escalation memory (the regions earlier
rollbacks skipped), and what the supervisor knows (``Known``: the checkpoints on the shelf, the
step -> data-cursor memory, the LR orders in force). The rules call it when their ladder says
rollback (``Rules.judge``); the supervisor writes the plan into the next attempt's directive
and only verifies the chosen checkpoint on disk. Pure: no I/O, no clock, no supervisor types.

- checkpoint: the newest *good* checkpoint strictly before the onset. A loss or grad spike's
  rollback needs one saved at least ``probation_steps`` before the onset (the anomaly makes the
  ones after that suspect); without one the run would restart from scratch, which loses more
  than the spike, so the plan is not ``possible`` and the rules alert instead. Relaunches after
  a hang or a crash resume from the newest checkpoint before the next step, pending included
  (``resume_bound``).
- skip sizes: ``skip_before`` / ``skip_after`` batches around the onset. An onset within
  ``escalation_window`` batches of an earlier rollback's skipped region is the same region
  again: the sizes grow by ``escalation_skip_factor`` per repeat. The onset is the finding's
  own cursor (the step where it has none), so escalation reads the same after a takeover.
- skip range: ``[cursor(onset) - 1 - skip_before, cursor(detected) + skip_after)`` in batches
  (the batch behind step s is cursor(s) - 1), never starting before the resumed checkpoint's
  cursor (what it trained on is in its weights); the finding's onset cursor stands in for an
  empty cursor memory (after a takeover).
- LR: the scale drops to ``base x lr_factor`` where the skipped batches begin (the replayed
  steps before them trained well the first time, at ``base``) and returns linearly to ``base``
  over ``lr_rewarm_steps`` batches past them. A repeat of the same region keeps the lower scale
  for the rest of the run (it becomes the new base, from the resume point on).
- SDC: the hardware's fault, not the data's or the LR's: nothing skipped, the LR orders in force
  kept, and no region left behind for escalation.
- a hang or a crash that follows the data (``policies/cause.py``: it came back at the same
  batches): back to the newest checkpoint before it, pending ones too, and past exactly the
  batches of the step it struck in (``skip_data``); the LR orders in force kept.
- a spike or a NaN whose cause is not known yet (``policies/rerun.py``: ``rerun.asked``): back
  to the same checkpoint as its rollback, nothing skipped and the LR orders kept, to rerun the
  same steps; the skip and the cut come only if it comes back there (``rerun.reproduced``).

Units: steps are optimizer steps; cursors and skip ranges are global batches consumed; LR
scales multiply the script's own LR.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from babysit.policies import rerun
from babysit.policies.cause import Batches, Fault
from babysit.policies.types import Action, Finding, Incident, Remedy

if TYPE_CHECKING:
    from babysit.policies.schema import Rollback as Section

SPIKES = (Incident.LOSS_SPIKE, Incident.GRAD_SPIKE)
"""Anomalies a run survives unaided: only a checkpoint from before them makes a rollback pay."""
NEEDS_OLDER = (*SPIKES, Incident.RESUME)
"""Rollbacks that pay only with a good checkpoint before the onset: a spike's (else the run
restarts from scratch for a bump), a failed resume's (the next older one is the point)."""
KEEPS_DATA = (Incident.SDC, Incident.GPU_FAULT, Incident.RESUME)
"""Rollbacks that are no fault of the data or the LR: nothing skipped, the LR orders kept."""
WEIGHT_ANOMALIES = (Incident.LOSS_SPIKE, Incident.NONFINITE, Incident.GRAD_SPIKE)
"""Anomalies that say something about the weights around them (a hang or a crash does not)."""


@dataclass(frozen=True, slots=True)
class Saved:
    """A committed checkpoint as the catalog last listed it."""

    step: int
    cursor: int
    good: bool
    """It passed probation (a rollback may use it); False: still pending."""
    just_in_time: bool = False
    """Written after a fault by the ranks still alive (``checkpoints/just_in_time.py``): a
    relaunch resumes from it, a rollback for the weights' or the machine's fault never."""


@dataclass(frozen=True, slots=True)
class Shelf:
    """The checkpoints a rollback could go back to, as plain data."""

    saved: tuple[Saved, ...] = ()
    probation_steps: int = 0
    """Checkpoints saved this close before an onset turn suspect with it."""

    def newest_good_before(self, step: int, just_in_time: bool = False) -> Saved | None:
        """The newest good checkpoint before ``step``; a just-in-time one only if asked."""
        return max((c for c in self.saved
                    if c.good and c.step < step and (just_in_time or not c.just_in_time)),
                   key=lambda c: c.step, default=None)


@dataclass(frozen=True, slots=True)
class Span:
    """Global batches ``start <= cursor < end`` (the directive's ``SkipRange``)."""

    start: int
    end: int


@dataclass(frozen=True, slots=True)
class Ramp:
    """A temporary LR cut in cursor space (the directive's ``LrRamp``): ``to`` up to ``cut``,
    the attempt's scale until ``start``, then linearly back to ``to`` by ``end``."""

    cut: int
    start: int
    end: int
    to: float


@dataclass(frozen=True, slots=True)
class Orders:
    """An attempt's LR orders: ``scale`` from its first step, worn off by ``ramp`` (or not)."""

    scale: float = 1.0
    ramp: Ramp | None = None

    @property
    def base(self) -> float:
        """The scale the run returns to once the ramp has worn off."""
        return self.ramp.to if self.ramp is not None else self.scale


@dataclass(frozen=True, slots=True)
class Region:
    """Batches ``lo <= cursor < hi`` an earlier rollback skipped, and its escalation generation
    (0: a first rollback there)."""

    lo: int
    hi: int
    gen: int


@dataclass(frozen=True, slots=True)
class Known:
    """What the supervisor knows when a rollback is decided."""

    shelf: Shelf | None = None
    """The checkpoints; None: not known (replay, or a caller that vouches one exists)."""
    cursor_at: Mapping[int, int] = field(default_factory=dict)
    """Recent steps -> their data cursor (empty after a takeover)."""
    orders: Orders = Orders()
    """The LR orders of the attempt running now."""
    skips: Sequence[Batches] = ()
    """The batches the attempt running now skips (the run's skip ranges so far)."""
    step_s: float | None = None
    """The run's median step time in seconds (None: not measured yet)."""


NOTHING_KNOWN = Known()
"""No checkpoints known (one is assumed), no cursors, the LR untouched: replay's view."""


@dataclass(frozen=True, slots=True)
class Plan:
    """What the attempt a remedy causes is told beyond the run's standing orders."""

    finding: Finding | None
    """The finding the rollback answers; None: a plain start or a takeover."""
    rollback: bool
    """False: a relaunch (or a start) that keeps the LR orders in force and skips nothing."""
    possible: bool = True
    """False: a spike with no good checkpoint before it: rolling back would restart the run."""
    checkpoint: Saved | None = None
    """The checkpoint the shelf offers (None: none known, or from scratch)."""
    skip_before: int = 0
    skip_after: int = 0
    lr_factor: float = 1.0
    lr_rewarm: int | None = None
    """Batches past the skipped ones over which the cut wears off; None: the cut stays."""
    region: Region | None = None
    """What this rollback adds to the escalation memory (None: nothing, as for SDC)."""
    note: str = ""
    """Why the sizes are what they are, in words (appended to the remedy's reason)."""
    skip: Span | None = None
    """New batches to skip (added to the earlier ones), or None."""
    orders: Orders = Orders()
    """The LR orders of the attempt, from its first step."""
    save_at: int | None = None
    """A rerun's: the cursor its data's rollback would skip from, were the rerun to reproduce
    the anomaly; the rerun saves a checkpoint there, for that rollback to resume from."""

    @property
    def base(self) -> float:
        return self.orders.base

    def resumed(self, cursor: int | None) -> Plan:
        """The plan once the supervisor verified the checkpoint it resumes from (``cursor``;
        None: from scratch), which may be older than the shelf's offer. Only a rollback without
        a skip range (no cursor known at all) anchors its LR ramp there."""
        ramp = self.orders.ramp
        cut_here = self.rollback and self.lr_factor != 1.0 and self.lr_rewarm is not None
        if not cut_here or self.skip is not None or ramp is None:
            return self
        start = cursor if cursor is not None else 0
        return replace(self, orders=replace(self.orders, ramp=replace(
            ramp, cut=start, start=start, end=start + (self.lr_rewarm or 0))))


def resume_bound(remedy: Remedy) -> tuple[int, bool]:
    """Which checkpoint the attempt after ``remedy`` may resume from: one strictly before the
    returned step, pending ones (and just-in-time ones) too when the flag says so. A rollback
    goes back before the onset to a good one, never a just-in-time one; a relaunch after a hang
    or a crash, and the rollback past a fault that follows the data (``skip_data``), may use the
    newest one: they say nothing of the weights."""
    if remedy.action is Action.ROLLBACK and not follows_data(remedy.finding):
        return remedy.finding.onset_step, False
    return remedy.finding.step + 1, True


def suspect_window(incident: Incident, probation_steps: int) -> int | None:
    """How many steps before its onset an acted-on anomaly makes checkpoints suspect (those
    after the onset too); None: it says nothing about the weights. Silent corruption began
    after the last agreeing check (onset - 1), which vouches for the checkpoints up to it."""
    if incident in (Incident.SDC, Incident.GPU_FAULT):
        return 0
    return probation_steps if incident in WEIGHT_ANOMALIES else None


def offer(finding: Finding, shelf: Shelf) -> Saved | None:
    """The checkpoint a rollback for ``finding`` will find: the newest good one from before
    the checkpoints the anomaly makes suspect (``suspect_window``); a just-in-time one only for
    a fault that follows the data (the weights were never in question)."""
    window = suspect_window(finding.incident, shelf.probation_steps) or 0
    return shelf.newest_good_before(finding.onset_step - window, follows_data(finding))


def can_roll_back(finding: Finding, shelf: Shelf) -> bool:
    """Whether a rollback for ``finding`` pays: a spike needs a good checkpoint the anomaly will
    not make suspect, a resume that did not take an older good one; anything else always pays
    (a NaN cannot be trained through)."""
    return finding.incident not in NEEDS_OLDER or offer(finding, shelf) is not None


def follows_data(finding: Finding) -> bool:
    """``finding`` is a hang or a crash that came back at the same batches (``skip_data``)."""
    return finding.evidence.get("follows") == "data"


def skip_data(finding: Finding, fault: Fault) -> Finding:
    """``finding``, a hang or a crash that follows the data (``policies/cause.py``), marked for
    its rollback: back to the newest checkpoint before it, pending ones too, and past the
    batches of the step it struck in (its onset: the step after the fault's, whose cursor would
    have been ``fault.end``). ``for_remedy`` places exactly that skip and keeps the LR orders
    in force: the data was bad, not the optimisation."""
    return replace(finding, onset_step=fault.step + 1, onset_cursor=fault.end,
                   evidence={**finding.evidence, "follows": "data", "fault": fault.to_json()})


def plan(finding: Finding, section: Section, memory: Sequence[Region],
         known: Known = NOTHING_KNOWN) -> Plan:
    """The whole rollback for ``finding``; see the module docstring. ``memory``: the regions
    of the run's earlier rollbacks (``Plan.region`` of each one the rules chose)."""
    shelf = known.shelf
    possible = shelf is None or can_roll_back(finding, shelf)
    checkpoint = offer(finding, shelf) if shelf is not None else None
    onset, same = _same_region(finding, section, memory)
    gen = 1 + max((r.gen for r in same), default=-1)
    widen = section.escalation_skip_factor ** gen
    before = round(section.skip_before * widen)
    after = round(section.skip_after * widen)
    if finding.incident in KEEPS_DATA or rerun.asked(finding):
        # Not a bad region of data (or not known to be one yet): skipping batches or lowering
        # the LR would change the run for nothing. Roll back to before the corruption (or to the
        # checkpoint before the one whose restore did not take) and replay the same steps.
        # A rerun saves where the data's rollback would skip from.
        skip = _place(finding, before, after, 1.0, None, known, None)[0] \
            if rerun.asked(finding) else None
        return Plan(finding, True, possible, checkpoint, orders=known.orders,
                    note=_kept_why(finding, checkpoint),
                    save_at=skip.start if skip is not None else None)
    note = ""
    if gen:
        note = (f"; onset {onset} is inside the region of {len(same)} earlier rollback(s), so "
                f"skip x{widen:g} and LR x{section.lr_factor:g} for the rest of the run")
    rewarm = None if gen else section.lr_rewarm_steps
    skip, orders = _place(finding, before, after, section.lr_factor, rewarm, known,
                          checkpoint.cursor if checkpoint is not None else None)
    return Plan(finding, True, possible, checkpoint, before, after, section.lr_factor, rewarm,
                Region(max(0, onset - before), onset + after, gen), note, skip, orders)


def _same_region(finding: Finding, section: Section,
                 memory: Sequence[Region]) -> tuple[int, list[Region]]:
    """``finding``'s onset (its own cursor, else its step) and the earlier rollbacks' regions
    it falls within ``escalation_window`` of: the same region failing again."""
    onset = finding.onset_cursor if finding.onset_cursor is not None else finding.onset_step
    window = section.escalation_window
    return onset, [r for r in memory if r.lo - window <= onset < r.hi + window]


def _kept_why(finding: Finding, checkpoint: Saved | None) -> str:
    """Why a rollback skips nothing and keeps the LR, in words."""
    if rerun.asked(finding):
        start = f"from step {checkpoint.step + 1} " if checkpoint is not None else ""
        return (f"; rerun steps {start}to {finding.step} first, nothing skipped and the LR "
                "kept: back at the same batches -> the data's (skipped then), not back -> a "
                "transient fault of the machine")
    whose = {Incident.SDC: "silent data corruption is the hardware's fault",
             Incident.GPU_FAULT: "a GPU fault is the machine's"}.get(
        finding.incident, "a restore that did not take is the resume's")
    return f"; {whose}, not the data's or the LR's: no batches skipped, LR kept"


def rerun_pays(finding: Finding, section: Section, memory: Sequence[Region],
               known: Known = NOTHING_KNOWN) -> bool:
    """Whether the rollback for ``finding`` (a spike or a NaN) first reruns its steps
    (``policies/rerun.py``): with a data cursor that says which batches they were, within the
    policy's bounds (``rerun_max_steps``, and
    ``rerun_max_s`` at the measured step time) from the checkpoint it would use, and not in a
    region an earlier rollback skipped (the same region again is the data's without asking)."""
    if finding.incident not in rerun.RERUNNABLE or section.rerun_max_steps <= 0 \
            or finding.evidence.get("rerun") is not None:
        return False
    if not finding.onset_cursor:
        # No data cursor (the script does not read through ``run.batches()``, stdout mode):
        # nothing says the rerun would meet the same batches, so it could tell nothing.
        return False
    if _same_region(finding, section, memory)[1]:
        return False
    if known.shelf is None:  # one is vouched for: the rerun is at least the anomaly's steps
        since = finding.onset_step
    else:
        checkpoint = offer(finding, known.shelf)
        since = checkpoint.step if checkpoint is not None else 0
    steps = finding.step - since
    if steps > section.rerun_max_steps:
        return False
    return section.rerun_max_s is None or known.step_s is None \
        or steps * known.step_s <= section.rerun_max_s


def for_remedy(remedy: Remedy | None, known: Known = NOTHING_KNOWN,
               resume_cursor: int | None = None) -> Plan:
    """The plan behind a remedy whose ``plan`` this process did not keep (one inherited from
    the journal, or built by hand): the remedy's own sizes and LR, placed with ``known``'s
    cursors and orders. A relaunch that is not a rollback (or None: a plain start or a
    takeover) keeps the orders in force: the ramp is in cursor space, so it holds wherever
    the attempt resumes."""
    if remedy is None or remedy.action is not Action.ROLLBACK:
        return Plan(remedy.finding if remedy is not None else None, False, orders=known.orders)
    finding = remedy.finding
    if finding.incident in KEEPS_DATA or rerun.asked(finding):
        return Plan(finding, True, orders=known.orders)
    skip, orders = _place(finding, remedy.skip_before, remedy.skip_after, remedy.lr_scale,
                          remedy.lr_rewarm, known, resume_cursor)
    if follows_data(finding):
        orders = known.orders
    return Plan(finding, True, True, None, remedy.skip_before, remedy.skip_after,
                remedy.lr_scale, remedy.lr_rewarm, None, "", skip, orders)


def _place(finding: Finding, before: int, after: int, factor: float, rewarm: int | None,
           known: Known, resume_cursor: int | None) -> tuple[Span | None, Orders]:
    """The skip range in batches and the attempt's LR orders (see the module docstring)."""
    base = known.orders.base
    onset = known.cursor_at.get(finding.onset_step, finding.onset_cursor)
    detected = known.cursor_at.get(finding.step, onset)
    if onset is not None and detected is not None:
        detected = max(detected, onset)  # a fault's onset is the step after the last it saw
    skip = None
    if onset is not None and detected is not None:
        # Not before the resume: batches the resumed checkpoint trained on are in its weights
        # (saves denser than skip_before), and a skip over them would only overstate it.
        skip = Span(max(0, onset - 1 - before, resume_cursor or 0), detected + after)
    if factor == 1.0:
        return skip, Orders(base)
    cut = base * factor
    if rewarm is None:  # the same region again: the lower scale stays
        return skip, Orders(cut)
    start = skip.end if skip is not None else (resume_cursor if resume_cursor is not None else 0)
    cut_at = skip.start if skip is not None else start
    return skip, Orders(cut, Ramp(cut=cut_at, start=start, end=start + rewarm, to=base))
