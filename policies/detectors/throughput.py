"""Throughput drops: steps/s, tokens/s or MFU persistently below its moving baseline.

The rate of a step depends on ``metric``, with ``step_time`` the slowest rank's (the step as the
job experiences it):

- ``auto`` (the default): ``tokens / step_time`` when the ranks report tokens, else
  ``1 / step_time``;
- ``steps_per_s``: ``1 / step_time``, whatever else is reported;
- ``tokens_per_s``: ``StepRecord.tokens_per_s``; steps without tokens are skipped;
- ``mfu``: ``StepRecord.mfu`` (model FLOPs utilisation, a fraction of the job's peak); steps
  whose record lacks ``flops_per_token`` or ``peak_flops`` are skipped. MFU is tokens/s times
  constants, so it fires exactly when tokens/s would; what it adds is a number a person can
  judge without knowing the model ("MFU fell from 41 % to 20 %").

A step is slow when its rate is below ``baseline / factor``; ``patience`` slow steps in a
row give one WARNING, and no more until the rate has recovered. Slow steps stay out of the
baseline while the episode is undecided; once reported, they are let in, so a permanent change
(a smaller batch, a slower node after a relaunch) becomes the new normal instead of an alarm
that never ends.

Calling rules: one ``observe`` per merged step (a ``StepRecord``, or a multi-node leader's
``SummaryRecord``: any ``JobStep``); records without ``step_time`` (the first step of an
attempt), and records whose rate is not a positive finite number, are skipped.
Units: seconds, tokens as reported, MFU as a fraction (0.4 = 40 %).
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, model_validator

from babysit.policies.detectors._base import DetectorConfig
from babysit.policies.detectors._window import SortedWindow
from babysit.policies.types import Finding, Incident, JobStep, Severity, r4

Metric = Literal["auto", "steps_per_s", "tokens_per_s", "mfu"]

_UNITS = {"steps_per_s": "steps/s", "tokens_per_s": "tokens/s", "mfu": "MFU"}


class ThroughputConfig(DetectorConfig):
    metric: Metric = "auto"
    """What to watch: auto (tokens/s when the ranks report tokens, else steps/s), steps_per_s,
    tokens_per_s, or mfu (needs the job to declare flops_per_token and peak_flops)."""
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

    def _rate(self, record: JobStep) -> tuple[str, float] | None:
        """(metric, rate) of one step, or None when the step has no usable rate."""
        st = record.step_time
        if st is None or not math.isfinite(st) or st <= 0.0:
            return None
        metric = self.config.metric
        rate: float | None
        if metric == "auto":
            tokens = record.tokens
            metric = "tokens_per_s" if tokens else "steps_per_s"
            rate = (tokens or 1.0) / st
        elif metric == "steps_per_s":
            rate = 1.0 / st
        elif metric == "tokens_per_s":
            rate = record.tokens_per_s
        else:
            rate = record.mfu
        if rate is None or not math.isfinite(rate) or rate <= 0.0:
            return None
        return metric, rate

    def observe(self, record: JobStep) -> Finding | None:
        got = self._rate(record)
        if got is None:
            return None
        metric, rate = got
        unit = _UNITS[metric]
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
            message=f"throughput {_show(slow, metric)} for {self.config.patience} steps since "
            f"step {self._onset}, below its baseline {_show(baseline, metric)} "
            f"({baseline / slow:.2f}x slower)",
            evidence={"metric": metric, "unit": unit, "rate": r4(slow), "baseline": r4(baseline),
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


def _show(rate: float, metric: str) -> str:
    if metric == "mfu":
        return f"MFU {rate:.1%}"
    return f"{rate:.4g} {_UNITS[metric]}"
