"""Whose fault is a spike or a NaN: rerun the same steps before remedying it.

A loss spike, a grad-norm spike or a non-finite loss is the data's fault (a poisoned stretch of
batches) or a transient fault of the machine (a weight flipped by a glitch, a bad reduction).
Skipping batches and cutting the LR is right for the first and costs good data and a perturbed
LR for the second. Which one it is shows when the same steps run again: roll back to the
checkpoint the rollback would use anyway, skip nothing, keep the LR, and replay the same batches
in the same order with the restored RNG. A rerun that meets the anomaly again at the same
batches says the data's: roll back once more, skip them and cut the LR (``rollback.plan``). A
rerun that passes the steps where it struck says a transient fault: nothing is skipped, the LR
stays, and the run simply goes on from there (the rerun *is* the continuation).

The verdict compares the rerun's signal with what the first pass saw at the same steps (and the
same batches), never with what a detector re-learning its baseline after the relaunch says:
its warm-up may be longer than the replayed stretch. At each step from the onset to the
detection, the *excess* is how far the signal is above the baseline the detector had before
the onset, in log units (non-finite: infinitely far). Reproduced: the rerun's mean excess is at
least ``REPRODUCED_FRACTION`` of the first pass's (on CPU a data spike reruns bit-exact; on a GPU
nondeterministic kernels move it a little, never by half).

Pure: no I/O, no clock. ``Trace`` is what the supervisor remembers of the steps it saw;
``Rerun`` is one rerun in flight, serialisable for a supervisor taking over.
"""

from __future__ import annotations

import math
import statistics
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from babysit.policies.types import Finding, Incident

RERUNNABLE = (Incident.LOSS_SPIKE, Incident.GRAD_SPIKE, Incident.NONFINITE)
"""Anomalies of the numbers whose cause a rerun of the same steps tells apart."""
REPRODUCED_FRACTION = 0.5
"""The rerun's mean excess over the baseline, as a fraction of the first pass's, from which
the anomaly counts as reproduced."""
ASKED, REPRODUCED, TRANSIENT = "asked", "reproduced", "transient"
"""``Finding.evidence["rerun"]``: a rerun was launched for it / it came back on the rerun / it
did not (the last is only journaled: nothing is remedied)."""
UNDECIDED = "undecided"
"""The rerun could not replay the same samples (its global batch is another: a node lost at its
relaunch, with an ``ElasticSampler``): it tells nothing, and the anomaly is taken as the data's
without it (rolled back to before it, skipped, the LR cut: the remedy the rerun stood in for)."""


@dataclass(frozen=True, slots=True)
class Seen:
    """What one step looked like: its data cursor, the job's loss and grad norm, and each
    rank's loss (empty above ``Trace``'s ``per_rank_limit``)."""

    cursor: int
    loss: float | None
    grad_norm: float | None
    rank_loss: Mapping[int, float] = field(default_factory=dict)


class Trace:
    """The newest ``keep`` steps the supervisor saw, step -> ``Seen``."""

    def __init__(self, keep: int = 4096) -> None:
        self.keep = keep
        self._steps: OrderedDict[int, Seen] = OrderedDict()

    def add(self, step: int, seen: Seen) -> None:
        self._steps[step] = seen
        self._steps.move_to_end(step)
        while len(self._steps) > self.keep:
            self._steps.popitem(last=False)

    def between(self, first: int, last: int) -> dict[int, Seen]:
        """The remembered steps ``first <= step <= last``."""
        return {s: v for s, v in self._steps.items() if first <= s <= last}

    def cursors(self) -> dict[int, int]:
        return {s: v.cursor for s, v in self._steps.items()}

    def losses(self) -> dict[int, float | None]:
        return {s: v.loss for s, v in self._steps.items()}


def asked(finding: Finding) -> bool:
    """``finding``'s rollback reruns the same steps (no skip, the LR kept) to see whose it is."""
    return finding.evidence.get("rerun") == ASKED


def reproduced(finding: Finding) -> bool:
    """``finding`` is an anomaly that came back on its rerun: the data's."""
    return finding.evidence.get("rerun") == REPRODUCED


def taken_as_data(finding: Finding) -> bool:
    """``finding``'s rerun said the data's: it came back, or it could not replay the same
    samples (``UNDECIDED``: the remedy the rerun stood in for)."""
    return finding.evidence.get("rerun") in (REPRODUCED, UNDECIDED)


def ask(finding: Finding) -> Finding:
    """``finding`` marked for a rerun (see ``asked``)."""
    return replace(finding, evidence={**finding.evidence, "rerun": ASKED})


def signal_of(incident: Incident) -> str:
    """The signal a rerun compares: the grad norm for a grad spike, else the loss."""
    return "grad_norm" if incident is Incident.GRAD_SPIKE else "loss"


def _value(seen: Seen, signal: str) -> float | None:
    return seen.grad_norm if signal == "grad_norm" else seen.loss


def _excess(value: float | None, baseline: float) -> float | None:
    """How far ``value`` is above ``baseline``, in log units (0 at or below it; inf when
    non-finite or not positive while the baseline is)."""
    if value is None:
        return None
    if not math.isfinite(value):
        return math.inf
    if baseline <= 0.0:
        return max(0.0, value - baseline)
    if value <= 0.0:
        return 0.0
    return max(0.0, math.log(value / baseline))


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the rerun of ``finding``'s steps showed."""

    finding: Finding
    reproduced: bool
    steps: tuple[int, int]
    """The steps compared (from the onset to the detection)."""
    batches: tuple[int, int]
    """Their global batches, ``start <= cursor < end``."""
    first: float
    """The first pass's mean excess over the baseline there (log units; inf: non-finite)."""
    again: float
    """The rerun's."""
    moved_first: tuple[int, ...] = ()
    """The ranks whose loss left the baseline first in the first pass (empty: not known, or
    all at once)."""
    undecided: str | None = None
    """Why the rerun could not replay the same samples (``UNDECIDED``), else None."""

    def summary(self) -> str:
        a, b = self.batches
        where = f"batch {a}" if b - a == 1 else f"batches {a}-{b - 1}"
        name = self.finding.incident.value.replace("_", " ")
        if self.undecided is not None:
            return (f"{name} of step {self.finding.step}: the rerun of {where} {self.undecided}, "
                    "so it cannot tell whose it is -> taken as the data's")
        if self.reproduced:
            return f"{name} reproduced on the rerun at {where} -> the data's: skipped"
        moved = f"; rank {', '.join(map(str, self.moved_first))} moved first" \
            if self.moved_first else ""
        return (f"{name} of step {self.finding.step} not reproduced on the rerun of {where} -> "
                f"a transient fault of the machine: nothing skipped, LR unchanged{moved}")

    def to_json(self) -> dict[str, Any]:
        return {"incident": self.finding.incident.value, "detected_step": self.finding.step,
                "onset_step": self.finding.onset_step, "reproduced": self.reproduced,
                "verdict": UNDECIDED if self.undecided is not None
                else REPRODUCED if self.reproduced else TRANSIENT,
                "steps": list(self.steps), "batches": list(self.batches),
                "first_excess": _json_num(round(self.first, 6)),
                "rerun_excess": _json_num(round(self.again, 6)),
                "moved_first": list(self.moved_first), "summary": self.summary()}

    def as_finding(self) -> Finding:
        """The anomaly as it came back (``reproduced``): the original finding, its message
        saying so, marked for the data's rollback (``rollback.plan`` skips and cuts)."""
        evidence = {**self.finding.evidence, "rerun": UNDECIDED if self.undecided is not None
                    else REPRODUCED, "rerun_verdict": self.to_json()}
        return replace(self.finding, message=f"{self.summary()} ({self.finding.message})",
                       evidence=evidence)


def _json_num(x: float | None) -> float | str | None:
    """``x`` as the journal writes numbers: a non-finite one as its repr ("inf", "nan")."""
    return x if x is None or math.isfinite(x) else repr(x)


@dataclass
class Rerun:
    """One rerun in flight: ``finding`` (the anomaly, ``asked``), what the first pass saw at
    its steps, and what the rerun has seen there so far."""

    finding: Finding
    baseline: float
    first: dict[int, Seen]
    """The first pass, from the onset to the detection (by step)."""
    again: dict[int, Seen] = field(default_factory=dict)
    before: int | None = None
    """The data cursor before the onset (where its batches begin), when remembered."""

    @classmethod
    def start(cls, finding: Finding, trace: Trace) -> Rerun | None:
        """The rerun of ``finding``'s steps, from what ``trace`` remembers of the first pass;
        None when it remembers none of them (a supervisor that took over in between)."""
        first = trace.between(finding.onset_step, finding.step)
        signal = signal_of(finding.incident)
        if not any(_value(v, signal) is not None for v in first.values()):
            return None
        prior = trace.between(finding.onset_step - 1, finding.onset_step - 1)
        before = prior[finding.onset_step - 1].cursor if prior else None
        return cls(finding, _baseline(finding, trace, signal), first, before=before)

    @property
    def signal(self) -> str:
        return signal_of(self.finding.incident)

    def observe(self, step: int, seen: Seen) -> Verdict | None:
        """The rerun's step ``step``; the verdict once it reached the step the anomaly was
        detected at (or met a non-finite value where the first pass had one)."""
        if step in self.first:
            self.again[step] = seen
        came_back = step in self.first and _excess(_value(seen, self.signal),
                                                   self.baseline) == math.inf \
            and _excess(_value(self.first[step], self.signal), self.baseline) == math.inf
        if step < self.finding.step and not came_back:
            return None
        return self.verdict()

    def verdict(self) -> Verdict:
        steps = sorted(s for s in self.again if s in self.first)
        first = _mean_excess([self.first[s] for s in steps], self.signal, self.baseline)
        again = _mean_excess([self.again[s] for s in steps], self.signal, self.baseline)
        same_data = all(self.first[s].cursor == self.again[s].cursor for s in steps)
        came_back = bool(steps) and same_data and first > 0.0 and \
            (again == math.inf if first == math.inf else again >= REPRODUCED_FRACTION * first)
        span = steps or sorted(self.first)
        lo, hi = span[0], span[-1]
        prior = self.first.get(lo - 1)
        start = prior.cursor if prior is not None else \
            self.before if self.before is not None else self.first[lo].cursor - 1
        batches = (max(0, start), max(start + 1, self.first[hi].cursor))
        return Verdict(self.finding, came_back, (lo, hi), batches, first, again,
                       () if came_back else _moved_first(self.first, self.baseline))

    def undecided(self, why: str) -> Verdict:
        """The verdict of a rerun that cannot replay the first pass's samples (``why``):
        ``UNDECIDED``, its finding (``as_finding``) the data's rollback without a rerun."""
        first = _mean_excess(list(self.first.values()), self.signal, self.baseline)
        return replace(self.verdict(), reproduced=False, first=first, again=math.nan,
                       moved_first=(), undecided=why)

    def to_json(self) -> dict[str, Any]:
        return {"finding": self.finding.to_json(), "baseline": self.baseline,
                "first": {str(s): _seen_json(v) for s, v in self.first.items()},
                "again": {str(s): _seen_json(v) for s, v in self.again.items()},
                "before": self.before}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Rerun:
        return cls(Finding.from_json(d["finding"]), float(d["baseline"]),
                   {int(s): _seen_from(v) for s, v in d["first"].items()},
                   {int(s): _seen_from(v) for s, v in d.get("again", {}).items()},
                   None if d.get("before") is None else int(d["before"]))


def _mean_excess(seen: Sequence[Seen], signal: str, baseline: float) -> float:
    values = [e for v in seen if (e := _excess(_value(v, signal), baseline)) is not None]
    if not values:
        return 0.0
    return math.inf if math.inf in values else sum(values) / len(values)


def _baseline(finding: Finding, trace: Trace, signal: str) -> float:
    """The level the anomaly rose from: the detector's own baseline when it says it, else the
    median of the remembered finite values before the onset (0: none)."""
    said = finding.evidence.get("baseline" if signal == "loss" else "median")
    if isinstance(said, (int, float)) and math.isfinite(said):
        return float(said)
    before = [x for v in trace.between(finding.onset_step - 64, finding.onset_step - 1).values()
              if (x := _value(v, signal)) is not None and math.isfinite(x)]
    return statistics.median(before) if before else 0.0


def _moved_first(first: Mapping[int, Seen], baseline: float,
                 ratio: float = 1.05) -> tuple[int, ...]:
    """The ranks whose own loss left ``baseline`` (by ``ratio``, or went non-finite) at the
    first step any did, when not every rank did: evidence for a verdict on a node later."""
    for step in sorted(first):
        per_rank = first[step].rank_loss
        out = sorted(r for r, x in per_rank.items()
                     if not math.isfinite(x) or (baseline > 0 and x >= ratio * baseline))
        if out:
            return tuple(out) if len(out) < len(per_rank) else ()
    return ()


def _seen_json(v: Seen) -> dict[str, Any]:
    return {"cursor": v.cursor, "loss": _json_num(v.loss), "grad_norm": _json_num(v.grad_norm),
            "rank_loss": {str(r): _json_num(x) for r, x in v.rank_loss.items()}}


def _seen_from(d: Mapping[str, Any]) -> Seen:
    def num(x: Any) -> float | None:
        return None if x is None else float(x)
    return Seen(int(d["cursor"]), num(d.get("loss")), num(d.get("grad_norm")),
                {int(r): float(x) for r, x in d.get("rank_loss", {}).items()})
