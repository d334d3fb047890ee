"""The live detector pipeline: a policy's step detectors, then its rules.

The supervisor runs it on every merged step (``babysit.supervisor.run.watch``); ``babysit
replay`` runs the same object over a recorded curve (``babysit.policies.replay``).

Adding a detector touches three places: its module in ``policies/detectors/`` (the detector and
its config), its entry in ``REGISTRY`` below, and its field in the policy schema
(``policies/schema.py``'s ``DetectorsConfig``, which gives it a documented YAML section). A new
kind of trouble also needs an ``Incident`` and its response in the schema.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any, Protocol

from babysit.policies.detectors import (
    GradNormDetector,
    LossSpikeDetector,
    NonFiniteDetector,
    RankDepartureDetector,
    SlowComputeDetector,
    SlowLinkDetector,
    StragglerDetector,
    ThroughputDetector,
)
from babysit.policies.rules import Rules
from babysit.policies.schema import Policy
from babysit.policies.types import Finding, JobStep, StepRecord


@dataclass(frozen=True, slots=True)
class ReplayDecision:
    """One finding and what the policy decided about it (what ``babysit replay`` reports)."""

    step: int
    detector: str
    incident: str
    severity: str
    action: str
    evidence: dict[str, Any]
    reason: str
    onset_step: int
    message: str
    remedy: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "detector": self.detector, "incident": self.incident,
                "severity": self.severity, "action": self.action, "onset_step": self.onset_step,
                "message": self.message, "evidence": self.evidence, "reason": self.reason,
                "remedy": self.remedy}


class StepDetector(Protocol):
    """What every step detector offers. ``observe`` takes a ``StepRecord`` (per-rank
    detectors) or any ``JobStep`` (detectors of the ``job`` scope)."""

    name: str

    def observe(self, record: Any) -> Finding | None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, d: dict[str, Any]) -> None: ...


@dataclass(frozen=True, slots=True)
class DetectorEntry:
    """One step detector, as the pipeline builds and runs it."""

    name: str
    """Its name in findings, and its section under ``detectors:`` in a policy."""
    make: Callable[[Any], StepDetector]
    """Builds it from its config section (``policy.detectors.<name>``)."""
    scope: str
    """``node``: it names ranks from every rank's values (``StepRecord.ranks``), so it runs
    where the ranks report. ``job``: it reads job-wide signals only (any ``JobStep``), so a
    multi-node leader runs it on the nodes' merged summaries."""
    forget_on_relaunch: bool
    """Its state spans the relaunch gap and would misjudge the new attempt: a baseline of the
    model (loss, grad norm, a rank's loss level) learnt on the abandoned stretch, while the new
    attempt trains an older checkpoint's model or a fresh one (whose grad norm at step 1 is
    many times a trained model's); a spike pending in the old attempt; a rate measured across
    the gap. Such a detector re-learns over its own warm-up. Others (stragglers: the hardware's
    pace) keep their baselines."""


REGISTRY: tuple[DetectorEntry, ...] = (
    DetectorEntry("nonfinite", NonFiniteDetector, "node", False),
    DetectorEntry("loss_spike", LossSpikeDetector, "job", True),
    DetectorEntry("grad_norm", GradNormDetector, "job", True),
    DetectorEntry("straggler", StragglerDetector, "node", False),
    DetectorEntry("rank_departure", RankDepartureDetector, "node", True),
    DetectorEntry("throughput", ThroughputDetector, "job", True),
    DetectorEntry("slow_compute", SlowComputeDetector, "job", True),
    DetectorEntry("slow_link", SlowLinkDetector, "job", True),
)
"""Every step detector, in the order they run on a step."""

SCOPES: dict[str, tuple[str, ...]] = {
    "all": tuple(e.name for e in REGISTRY),
    "node": tuple(e.name for e in REGISTRY if e.scope == "node"),
    "job": tuple(e.name for e in REGISTRY if e.scope == "job"),
}
"""Which step detectors a ``Pipeline`` runs, by scope (detector names, in the order they run).

- ``all``: every step detector, on ``StepRecord``s holding every rank's report: a single-node
  supervisor, and replay.
- ``node``: the detectors that name ranks from per-rank values (non-finite, straggler, rank
  departure). They need ``StepRecord.ranks``, which only the node that received the ranks'
  reports has, so each node's supervisor runs them over its own ranks. A non-finite value and
  a departure from a rank's own past are a rank's own business; a straggler is then measured
  against its node's peers (a node of one rank has none, so it cannot flag one).
- ``job``: the detectors of job-wide signals (loss spike, grad norm, throughput, the
  slowest rank's forward against every rank's: ``slow_compute``, so a whole slow node
  shows; and the slowest node's link against the others': ``slow_link``). One node's
  ranks would give a partial mean loss and a partial tokens/s, so the leader runs them on
  the nodes' merged summaries (``babysit.supervisor.node.sketch.SummaryRecord``, a
  ``JobStep``).

``node`` and ``job`` split ``all``: between them they run each step detector exactly once.
"""

_ENTRIES = {e.name: e for e in REGISTRY}


class Pipeline:
    """The step detectors of a policy (those of ``scope``, see ``SCOPES``), then its rules.

    Call ``observe(record)`` once per merged step, in order; ``now`` defaults to
    ``record.time``. A ``StepRecord`` suits every scope; a ``scope="job"`` pipeline also takes
    any other ``JobStep`` (a ``SummaryRecord``). Hangs and crashes are not step-driven: the
    supervisor feeds the ``HangDetector`` and ``classify`` itself and hands their findings to
    ``decide(finding)``. Nor are fingerprints: the supervisor feeds each rank's digests to its
    ``SdcDetector``.
    """

    def __init__(self, policy: Policy, scope: str = "all") -> None:
        if scope not in SCOPES:
            raise ValueError(f"Pipeline scope must be one of {sorted(SCOPES)}, got {scope!r}.")
        self.policy = policy
        self.scope = scope
        self.detectors: list[StepDetector] = [self._make(name) for name in SCOPES[scope]]
        self.rules = Rules(policy)

    def _make(self, name: str) -> StepDetector:
        return _ENTRIES[name].make(getattr(self.policy.detectors, name))

    def new_attempt(self) -> None:
        """The workers were relaunched: detectors whose state spans the gap start over
        (``DetectorEntry.forget_on_relaunch``): no detector judges the resumed or restarted
        model against statistics learnt after its resume point. Stragglers' baselines (the
        hardware's pace) stay valid."""
        self.detectors = [self._make(det.name) if _ENTRIES[det.name].forget_on_relaunch
                          else det for det in self.detectors]

    def findings(self, record: JobStep, skip: Collection[str] = ()) -> list[Finding]:
        """What the step detectors see in ``record``, before the rules judge it. ``record`` is a
        ``StepRecord``, or for a ``scope="job"`` pipeline any ``JobStep``; ``TypeError``
        otherwise (the per-rank detectors need every rank's values). The detectors named in
        ``skip`` neither judge nor learn from this record."""
        if isinstance(record, StepRecord):
            return [f for det in self.detectors
                    if det.name not in skip and (f := det.observe(record)) is not None]
        if self.scope != "job":
            raise TypeError(
                f"A {type(record).__name__} carries no per-rank values, so only a "
                f"Pipeline(scope='job') can observe it; this pipeline's scope is "
                f"'{self.scope}'.")
        job = [det for det in self.detectors
               if _ENTRIES[det.name].scope == "job" and det.name not in skip]
        return [f for det in job if (f := det.observe(record)) is not None]

    def observe(self, record: JobStep, now: float | None = None) -> list[ReplayDecision]:
        t = record.time if now is None else now
        return [self.decide(finding, t) for finding in self.findings(record)]

    def decide(self, finding: Finding, now: float) -> ReplayDecision:
        """The rules' remedy for ``finding``, as replay records it."""
        remedy = self.rules.on_finding(finding, now)
        return ReplayDecision(
            step=finding.step, detector=finding.detector, incident=finding.incident.value,
            severity=finding.severity.name.lower(), action=remedy.action.value,
            evidence=finding.evidence, reason=remedy.reason, onset_step=finding.onset_step,
            message=finding.message, remedy=remedy.to_json(),
        )

    def state_dict(self) -> dict[str, Any]:
        return {"detectors": {d.name: d.state_dict() for d in self.detectors},
                "rules": self.rules.state_dict()}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """A detector missing from ``d`` (a state saved by an older babysit, before it
        existed) starts fresh instead of failing the takeover."""
        saved = d["detectors"]
        for det in self.detectors:
            if det.name in saved:
                det.load_state_dict(saved[det.name])
        self.rules.load_state_dict(d["rules"])
