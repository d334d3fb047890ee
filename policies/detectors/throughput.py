"""Throughput drops: steps/s (tokens/s when reported) persistently below its moving baseline.

The rate of a step is ``tokens / step_time`` when the ranks report tokens, else
``1 / step_time``, where ``step_time`` is the slowest rank's (the step as the job experiences
it). A step is slow when its rate is below ``baseline / factor``; ``patience`` slow steps in a
row give one WARNING, and no more until the rate has recovered. Slow steps stay out of the
baseline while the episode is undecided; once reported, they are let in, so a permanent change
(a smaller batch, a slower node after a relaunch) becomes the new normal instead of an alarm
that never ends.

Calling rules: one ``observe`` per merged ``StepRecord``; records without ``step_time`` (the
first step of an attempt) are skipped. Units: seconds, tokens as reported.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import Field, model_validator

from policies.detectors._base import DetectorConfig, r4
from policies.detectors._window import SortedWindow
from policies.types import Finding, Incident, Severity, StepRecord


class ThroughputConfig(DetectorConfig):
    window: int = Field(default=64, ge=4, le=100_000)
    """Accepted steps in the moving median of the rate."""
    min_history: int = Field(default=16, ge=2)
    """No verdict before this many accepted steps (the first steps compile, warm caches)."""
    factor: float = Field(default=1.5, gt=1.0)
    """Slow means rate < baseline / factor (1.5: a third slower)."""
    patience: int = Field(default=10, ge=1)
    """Consecutive slow steps before the WARNING: one slow step is a hiccup, not a trend."""

    @model_validator(mode="after")
    def _history_fits(self) -> ThroughputConfig:
        if self.min_history > self.window:
            raise ValueError(
                f"min_history ({self.min_history}) must not exceed window ({self.window})"
            )
        return self


class ThroughputDetector:
    """Warns when the job's rate stays below its moving baseline; see the module docstring."""

    name = "throughput"

    def __init__(self, config: ThroughputConfig | None = None) -> None:
        self.config = config or ThroughputConfig()
        self._window = SortedWindow(self.config.window)
        self._pending: list[float] = []
        self._onset: int | None = None
        self._reported = False

    def observe(self, record: StepRecord) -> Finding | None:
        st = record.step_time
        if st is None or not math.isfinite(st) or st <= 0.0:
            return None
        tokens = record.tokens
        unit = "tokens/s" if tokens else "steps/s"
        rate = (tokens or 1.0) / st
        w = self._window
        if len(w) < self.config.min_history:
            w.push(rate)
            return None
        baseline = w.median()
        if rate >= baseline / self.config.factor:
            self._pending.clear()
            self._onset = None
            self._reported = False
            w.push(rate)
            return None
        if self._reported:
            w.push(rate)
            return None
        if self._onset is None:
            self._onset = record.step
        self._pending.append(rate)
        if len(self._pending) < self.config.patience:
            return None
        slow = sorted(self._pending)[len(self._pending) // 2]
        for v in self._pending:
            w.push(v)
        self._pending.clear()
        self._reported = True
        return Finding(
            incident=Incident.THROUGHPUT,
            detector=self.name,
            severity=Severity.WARNING,
            step=record.step,
            onset_step=self._onset,
            message=f"throughput {slow:.4g} {unit} for {self.config.patience} steps since step "
            f"{self._onset}, below its baseline {baseline:.4g} {unit} "
            f"({baseline / slow:.2f}x slower)",
            evidence={"unit": unit, "rate": r4(slow), "baseline": r4(baseline),
                      "slowdown": r4(baseline / slow), "steps": self.config.patience},
        )

    def state_dict(self) -> dict[str, Any]:
        return {"window": self._window.state_dict(), "pending": list(self._pending),
                "onset": self._onset, "reported": self._reported}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self._window.load_state_dict(d["window"])
        self._pending = [float(v) for v in d["pending"]]
        self._onset = d["onset"]
        self._reported = bool(d["reported"])
