"""Whose fault is a hang or a crash that came back: the data's, the code's, or not known yet.

A fault is where it struck: the incident, the rank(s) named, the step, the global batches of the
step it struck in (the data cursor: what the ranks were drawing or training on), and for a crash
its signature. Held against the faults before it in the run:

- the same incident on the same rank(s) at the same batches (a crash: with the same signature)
  follows the **data**: a corrupt sample, a file the loader deadlocks on. A relaunch from the
  newest checkpoint walks into it again; rolling back before it and skipping those batches
  lets the run go on (``rollback.skip_data``).
- the same incident and signature at the same step over other batches (the data under the step
  changed, and it struck all the same) follows the **step count**: an evaluation, a save, a
  schedule at step N. That is the code's, and nothing babysit can skip: the run stops.
- anything else has not shown what it follows (a first fault, one that moved): the machine's
  or a transient glitch until it repeats; the ladders answer it.
- where no batches are known (stdout mode, or no ``run.batches()``), a hang on the same
  rank(s) at the same step follows **the step** (``at_step``): the data's or the code's,
  which cannot be told apart without a cursor nor skipped; a relaunch would meet it again, so
  the run stops and says so.

A fault is placed only when the script reads its data through ``run.batches()`` (the cursor
moved): without a cursor, every fault would sit at "batch 0" and look like the data's. And only
when its ranks can have met a batch of their attempt (``trained``): a rank that died before its
hello (killed in its start-up or its restore, or while it waited as a warm standby) or a hang
while a rank still starts up trained no batch, and cannot reproduce a batch's fault.
Pure: no I/O, no clock.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from babysit.policies.types import Finding, Incident
from babysit.policies.wording import said_ranks

PLACED = (Incident.HANG, Incident.CRASH)
"""The incidents whose repeats are held against each other."""
KEEP = 64
"""Faults remembered (the newest); older ones say nothing about a repeat now."""


class Batches(Protocol):
    """Global batches ``start <= cursor < end`` (``rollback.Span``, the directive's
    ``SkipRange``: this module may not import them)."""

    @property
    def start(self) -> int: ...
    @property
    def end(self) -> int: ...


class Follows(enum.Enum):
    DATA = "data"
    CODE = "code"
    NOTHING_YET = "nothing yet"
    THE_STEP = "the step"
    """Back at the same step on the same rank where no batches are known (stdout mode, or a
    script that does not read through ``run.batches()``): the data's or the code's, which
    babysit cannot tell apart and cannot skip; a relaunch would meet it again."""


@dataclass(frozen=True, slots=True)
class Fault:
    """Where one hang or crash struck."""

    incident: str
    ranks: tuple[int, ...]
    step: int
    """The last step the ranks completed before it struck."""
    start: int
    """The first global batch of the step it struck in (the cursor after ``step``)."""
    end: int
    """One past its last batch (``start`` plus the batches a step draws)."""
    signature: str = ""
    """A crash's normalised error (``detectors.crash``); empty for a hang."""

    @property
    def placed(self) -> bool:
        """Its batches are known (``start`` and ``end`` are -1 when not: ``at_step``)."""
        return self.start >= 0

    def batches(self) -> str:
        """The batches in words: "batch 150", "batches 150-153"."""
        return f"batch {self.start}" if self.end - self.start == 1 \
            else f"batches {self.start}-{self.end - 1}"

    def where(self) -> str:
        """``"global batch 150 on rank 1"``, ``"global batches 150-153 on ranks 0 and 1"``."""
        return f"global {self.batches()} on " + \
            (said_ranks(self.ranks) if self.ranks else "every rank")

    def to_json(self) -> dict[str, Any]:
        """Batches not known are null (the -1 is this class's own)."""
        return {"incident": self.incident, "ranks": list(self.ranks), "step": self.step,
                "start": self.start if self.placed else None,
                "end": self.end if self.placed else None, "signature": self.signature}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Fault:
        start, end = d.get("start"), d.get("end")
        return cls(str(d["incident"]), tuple(int(r) for r in d["ranks"]), int(d["step"]),
                   -1 if start is None else int(start), -1 if end is None else int(end),
                   str(d.get("signature", "")))


def place(finding: Finding, cursor_at: Mapping[int, int],
          skips: Sequence[Batches] = ()) -> Fault | None:
    """Where ``finding`` (a hang or a crash) struck, from the step -> cursor memory and the
    batches the attempt skips (the next step draws the first batch past them); None when it
    cannot be placed (another incident, no cursor: the script does not use ``run.batches()``,
    or it struck before the attempt's first step)."""
    if finding.incident not in PLACED or not trained(finding):
        return None
    start = cursor_at.get(finding.step)
    if not start:  # 0 or unknown: no data read through run.batches() yet
        return None
    after = start
    while True:  # the skip ranges the next draw passes over (``Run.batches``)
        skip = next((s for s in skips if s.start <= after < s.end), None)
        if skip is None:
            break
        after = skip.end
    before = cursor_at.get(finding.step - 1)
    per_step = start - before if before is not None and start - before > 0 else 1
    signature = str(finding.evidence.get("signature", "")) \
        if finding.incident is Incident.CRASH else ""
    return Fault(finding.incident.value, finding.ranks, finding.step, after, after + per_step,
                 signature)


ATTACHED = "attached"
"""A crash's evidence key, False where the rank it names never said hello in its attempt
(``Watch.classify_crash``): it died before its restore was done and its batches began."""


def trained(finding: Finding) -> bool:
    """Whether the rank(s) ``finding`` (a hang or a crash) names can have met a batch of their
    attempt: not a crash of a rank that never said hello in it (evidence ``attached`` False),
    nor a hang while a rank still waited for its start-up (no hello either)."""
    if finding.incident is Incident.CRASH:
        return finding.evidence.get(ATTACHED) is not False
    stalled = finding.evidence.get("stalled") or {}
    return not any(isinstance(v, Mapping) and v.get("waiting_in") == "startup"
                   for v in stalled.values())


def at_step(finding: Finding) -> Fault | None:
    """Where a hang struck when ``place`` cannot say which batches: its step alone (a fault
    with no batches, ``start = end = -1``). None before any step, and while a rank waited for
    its start-up or first step (which a slow file system or node explains as well as any
    data). A crash needs no such place: the same error at the same step is already
    ``deterministic`` (``detectors.crash``), which stops the run."""
    if finding.incident is not Incident.HANG or finding.step <= 0:
        return None
    stalled = finding.evidence.get("stalled") or {}
    if any(isinstance(v, Mapping) and v.get("waiting_in") != "step" for v in stalled.values()):
        return None
    return Fault(finding.incident.value, finding.ranks, finding.step, -1, -1)


def follows(fault: Fault, earlier: Sequence[Fault]) -> tuple[Follows, Fault | None]:
    """What ``fault`` follows, held against the ``earlier`` faults of the run (oldest first),
    and the earlier fault that shows it (None: nothing yet)."""
    for old in reversed(earlier):
        if old.incident != fault.incident or old.signature != fault.signature:
            continue
        if not (old.placed and fault.placed):
            if not old.placed and not fault.placed and old.step == fault.step \
                    and _same_ranks(old, fault):
                return Follows.THE_STEP, old
            continue
        if (old.start, old.end) == (fault.start, fault.end) and _same_ranks(old, fault):
            return Follows.DATA, old
        if old.step == fault.step and old.start != fault.start:
            return Follows.CODE, old
    return Follows.NOTHING_YET, None


def _same_ranks(a: Fault, b: Fault) -> bool:
    """The same rank(s) struck: one named by the stacks may come with its waiting peers the
    other time, so any rank in common counts (none named: every rank)."""
    return not a.ranks or not b.ranks or bool(set(a.ranks) & set(b.ranks))
