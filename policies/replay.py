"""Replay: run a recorded loss curve through the detectors and the rules, offline.

``babysit replay CURVE [--policy NAME|PATH] [--json]`` answers "what would babysit have done on
this run?" without launching anything. Curves come in two shapes:

- a TSV or CSV file, optionally gzip'd, with a header row: the step column is named ``step``
  (without one, the row number is the step), the loss column is the first whose name contains
  ``loss``, an optional grad-norm column is the first whose name contains ``grad``;
- a run directory holding ``metrics.jsonl``: one JSON object per line with at least ``step``
  and ``loss``, optionally ``grad_norm`` and ``time``.

Replayed steps are one rank each, one data batch per step (cursor = step) and, without a time
column, one second per step: cooldowns and budgets in seconds read as steps.

The same ``Pipeline`` (detectors + rules) is what the supervisor runs live; replay just feeds it
a file.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TextIO

from babysit.policies.detectors import (
    GradNormDetector,
    LossSpikeDetector,
    NonFiniteDetector,
    RankDepartureDetector,
    StragglerDetector,
    ThroughputDetector,
)
from babysit.policies.rules import Rules
from babysit.policies.schema import Policy
from babysit.policies.types import Action, Finding, JobStep, RankStep, StepRecord


class CurveError(Exception):
    """A curve file cannot be replayed; the message names the file and what to do."""


# -- reading curves ---------------------------------------------------------------------------


def read_curve(path: str | Path) -> Iterator[StepRecord]:
    """Yield one ``StepRecord`` per row of a curve file or run directory (see module doc).

    Raises ``CurveError`` for a missing file, a missing loss column or an unparsable number.
    Checks happen before the first record is yielded where possible, so a bad file fails fast.
    """
    p = Path(path)
    if p.is_dir():
        metrics = p / "metrics.jsonl"
        if not metrics.is_file():
            raise CurveError(f"{p} is a directory without metrics.jsonl. Give a run directory "
                             "that has one, or a TSV/CSV curve file.")
        return _read_jsonl(metrics)
    if not p.is_file():
        raise CurveError(f"Curve file {p} does not exist. Give a TSV/CSV file (optionally "
                         ".gz) with a header row, or a run directory holding metrics.jsonl.")
    return _read_table(p)


def _open_text(p: Path) -> TextIO:
    with p.open("rb") as f:
        gz = f.read(2) == b"\x1f\x8b"
    if gz:
        return io.TextIOWrapper(gzip.open(p, "rb"), encoding="utf-8", newline="")
    return p.open("r", encoding="utf-8", newline="")


def _num(text: str, p: Path, line: int, col: str) -> float | None:
    text = text.strip()
    if not text:
        return None
    try:
        return float(text)
    except ValueError:
        raise CurveError(f"{p}, line {line}: column '{col}' holds {text!r}, not a number. "
                         "Fix or remove that row.") from None


def _record(step: int, loss: float | None, grad: float | None, t: float | None) -> StepRecord:
    time = float(step) if t is None else t
    rank = RankStep(rank=0, step=step, time=time, cursor=step, loss=loss, grad_norm=grad)
    return StepRecord(step=step, time=time, ranks=(rank,), world_size=1)


def _read_table(p: Path) -> Iterator[StepRecord]:
    f = _open_text(p)
    try:
        header_line = f.readline()
    except (OSError, UnicodeDecodeError, EOFError) as e:
        f.close()
        raise CurveError(f"Cannot read curve file {p}: {e}. Is it a text or gzip'd text "
                         "file?") from None
    delim = "\t" if "\t" in header_line else ","
    header = [h.strip() for h in next(csv.reader([header_line], delimiter=delim), [])]
    lower = [h.lower() for h in header]
    loss_i = next((i for i, h in enumerate(lower) if "loss" in h), None)
    if loss_i is None:
        f.close()
        raise CurveError(f"Curve file {p} has no loss column: its header has "
                         f"{header or 'nothing'}. Name the loss column with 'loss' in it "
                         "(e.g. 'train/loss').")
    step_i = lower.index("step") if "step" in lower else None
    grad_i = next((i for i, h in enumerate(lower) if "grad" in h), None)
    return _rows(f, p, delim, header, loss_i, step_i, grad_i)


def _rows(f: TextIO, p: Path, delim: str, header: list[str], loss_i: int, step_i: int | None,
          grad_i: int | None) -> Iterator[StepRecord]:
    with f:
        for n, row in enumerate(csv.reader(f, delimiter=delim), start=2):
            if not row:
                continue
            if len(row) < len(header):
                raise CurveError(f"{p}, line {n}: {len(row)} fields, the header has "
                                 f"{len(header)}. Fix or remove that row.")
            if step_i is None:
                step = n - 1
            else:
                s = _num(row[step_i], p, n, header[step_i])
                if s is None:
                    continue
                step = int(s)
            loss = _num(row[loss_i], p, n, header[loss_i])
            grad = None if grad_i is None else _num(row[grad_i], p, n, header[grad_i])
            yield _record(step, loss, grad, None)


def _read_jsonl(p: Path) -> Iterator[StepRecord]:
    with p.open("r", encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                step = int(obj["step"])
                loss = None if obj["loss"] is None else float(obj["loss"])
            except (ValueError, KeyError, TypeError) as e:
                what = f"missing key {e}" if isinstance(e, KeyError) else str(e)
                raise CurveError(f"{p}, line {n}: not a metrics record ({what}). Each line "
                                 "must be a JSON object with at least 'step' and 'loss'.") from None
            g = obj.get("grad_norm")
            t = obj.get("time")
            yield _record(step, loss, None if g is None else float(g),
                          None if t is None else float(t))


# -- the pipeline -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Decision:
    """One finding and what the policy decided about it."""

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


SCOPES: dict[str, tuple[str, ...]] = {
    "all": ("nonfinite", "loss_spike", "grad_norm", "straggler", "rank_departure", "throughput"),
    "node": ("nonfinite", "straggler", "rank_departure"),
    "job": ("loss_spike", "grad_norm", "throughput"),
}
"""Which step detectors a ``Pipeline`` runs, by scope (detector names, in the order they run).

- ``all``: every step detector, on ``StepRecord``s holding every rank's report: a single-node
  supervisor, and replay.
- ``node``: the detectors that name ranks from per-rank values (non-finite, straggler, rank
  departure). They need ``StepRecord.ranks``, which only the node that received the ranks'
  reports has, so each node's supervisor runs them over its own ranks. A non-finite value and
  a departure from a rank's own past are a rank's own business; a straggler is then measured
  against its node's peers (a node of one rank has none, so it cannot flag one).
- ``job``: the detectors of job-wide signals (loss spike, grad norm, throughput). One node's
  ranks would give a partial mean loss and a partial tokens/s, so the leader runs them on the
  nodes' merged summaries (``babysit.supervisor.node.sketch.SummaryRecord``, a ``JobStep``).

``node`` and ``job`` split ``all``: between them they run each step detector exactly once.
"""


class _StepDetector(Protocol):
    name: str

    def observe(self, record: StepRecord) -> Finding | None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, d: dict[str, Any]) -> None: ...


_MAKE: dict[str, Callable[[Policy], _StepDetector]] = {
    "nonfinite": lambda p: NonFiniteDetector(p.detectors.nonfinite),
    "loss_spike": lambda p: LossSpikeDetector(p.detectors.loss_spike),
    "grad_norm": lambda p: GradNormDetector(p.detectors.grad_norm),
    "straggler": lambda p: StragglerDetector(p.detectors.straggler),
    "rank_departure": lambda p: RankDepartureDetector(p.detectors.rank_departure),
    "throughput": lambda p: ThroughputDetector(p.detectors.throughput),
}

_JobDetector = LossSpikeDetector | GradNormDetector | ThroughputDetector
"""The detectors that read only ``JobStep`` attributes (the ``job`` scope)."""


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
        self.detectors: list[_StepDetector] = [_MAKE[name](policy) for name in SCOPES[scope]]
        self.rules = Rules(policy)

    def new_attempt(self) -> None:
        """The workers were relaunched: forget state that spans the gap. A spike pending in the
        old attempt must not carry over, and a rate measured across the relaunch (or over the
        new attempt's warm-up against the old one's pace) is no throughput regression. Other
        baselines (grad norm, stragglers, each rank's loss level) stay valid: the model did not
        change character, and a rank that departed still sits where it did."""
        self.detectors = [
            _MAKE[det.name](self.policy) if det.name in ("loss_spike", "throughput") else det
            for det in self.detectors
        ]

    def findings(self, record: JobStep) -> list[Finding]:
        """What the step detectors see in ``record``, before the rules judge it. ``record`` is a
        ``StepRecord``, or for a ``scope="job"`` pipeline any ``JobStep``; ``TypeError``
        otherwise (the per-rank detectors need every rank's values)."""
        if isinstance(record, StepRecord):
            return [f for det in self.detectors if (f := det.observe(record)) is not None]
        if self.scope != "job":
            raise TypeError(
                f"A {type(record).__name__} carries no per-rank values, so only a "
                f"Pipeline(scope='job') can observe it; this pipeline's scope is "
                f"'{self.scope}'.")
        job: list[_JobDetector] = [det for det in self.detectors if isinstance(det, _JobDetector)]
        return [f for det in job if (f := det.observe(record)) is not None]

    def observe(self, record: JobStep, now: float | None = None) -> list[Decision]:
        t = record.time if now is None else now
        return [self.decide(finding, t) for finding in self.findings(record)]

    def decide(self, finding: Finding, now: float) -> Decision:
        remedy = self.rules.on_finding(finding, now)
        return Decision(
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


def replay(records: Iterable[StepRecord], policy: Policy) -> list[Decision]:
    """Every decision the policy takes over ``records`` (including ignored findings)."""
    pipe = Pipeline(policy)
    out: list[Decision] = []
    for record in records:
        out.extend(pipe.observe(record))
    return out


_INTERVENTIONS = {Action.ROLLBACK.value, Action.RELAUNCH.value, Action.STOP.value}


def run_replay(curve_path: str, policy: str, as_json: bool, out: TextIO) -> int:
    """``babysit replay``: print each decision (human lines or JSON lines) to ``out``.

    Returns 0 when babysit would only have watched or alerted, 1 when it would have intervened
    (rolled back, relaunched or stopped), so scripts can ask "would it have stepped in?".
    Raises ``CurveError`` / ``PolicyError`` (one-paragraph messages) for bad inputs.
    """
    from babysit.policies.loader import load_policy

    pol = load_policy(policy, {})
    n = 0
    last_step: int | None = None
    decisions: list[Decision] = []
    pipe = Pipeline(pol)
    for record in read_curve(curve_path):
        n += 1
        last_step = record.step
        for dec in pipe.observe(record):
            decisions.append(dec)
            if as_json:
                out.write(json.dumps(dec.to_json(), default=str) + "\n")
            else:
                out.write(_human(dec) + "\n")
    if n == 0:
        raise CurveError(f"Curve {curve_path} has a header but no rows: nothing to replay.")
    counts = Counter(d.action for d in decisions)
    if not as_json:
        summary = ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) or "no findings"
        out.write(f"replayed {n} steps (last step {last_step}) with policy '{policy}': "
                  f"{summary}\n")
    return 1 if _INTERVENTIONS & set(counts) else 0


def _human(d: Decision) -> str:
    return (f"step {d.step:>7}  {d.detector:<11} {d.severity:<8} -> {d.action:<9} "
            f"{d.message}")
