"""Gradient-norm spikes: one step's grad norm far above its moving median.

Works in log grad-norm, so the verdict does not depend on the model's scale. A value is a spike
when it is at least ``factor`` times the median of the last ``window`` accepted values AND its
robust z-score (log units, sigma from the interquartile range, floored at ``min_sigma``) is at
least ``z_threshold``. Flagged values never enter the baseline, so a burst of spikes cannot
teach the detector that spikes are normal.

Two entry points, same state:

- ``observe_value(step, grad_norm)``: the worker's in-process guard ("skip this optimizer
  step?"). Pure Python, no numpy, O(window) with a small window: a few microseconds. Call it
  once per optimizer step, before ``optimizer.step()``, with the (pre-clipping) total norm as a
  Python float.
- ``observe(record)``: the supervisor's view of the same signal from a merged step (a
  ``StepRecord``, or a multi-node leader's ``SummaryRecord``: any ``JobStep``).

Non-finite norms return ``None`` here: they are the NaN detector's (CRITICAL) business and must
not poison the baseline.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import Field, model_validator

from babysit.policies.detectors._base import DetectorConfig, r4
from babysit.policies.detectors._window import SortedWindow
from babysit.policies.types import Finding, Incident, JobStep, Severity


class GradNormConfig(DetectorConfig):
    window: int = Field(default=128, ge=8, le=100_000)
    """Accepted steps in the moving median of log grad norm."""
    min_history: int = Field(default=20, ge=3)
    """No verdict before this many accepted steps (grad norms are wild at the start)."""
    factor: float = Field(default=3.0, gt=1.0)
    """A spike is at least factor x the moving median."""
    z_threshold: float = Field(default=6.0, gt=0.0)
    """...and at least this robust z-score in log grad-norm units."""
    min_sigma: float = Field(default=0.05, gt=0.0)
    """Noise floor in log units (0.05 ~ 5 %): grad norms are never that steady."""

    @model_validator(mode="after")
    def _history_fits(self) -> GradNormConfig:
        if self.min_history > self.window:
            raise ValueError(
                f"min_history ({self.min_history}) must not exceed window ({self.window})"
            )
        return self


class GradNormDetector:
    """Flags a grad norm far above its moving median; see the module docstring."""

    name = "grad_norm"

    def __init__(self, config: GradNormConfig | None = None) -> None:
        self.config = config or GradNormConfig()
        self._window = SortedWindow(self.config.window)
        self._log_factor = math.log(self.config.factor)

    def observe(self, record: JobStep) -> Finding | None:
        g = record.grad_norm
        return None if g is None else self.observe_value(record.step, g, record.cursor)

    def observe_value(
        self, step: int, grad_norm: float, cursor: int | None = None
    ) -> Finding | None:
        if not math.isfinite(grad_norm) or grad_norm <= 0.0:
            return None
        cfg = self.config
        y = math.log(grad_norm)
        w = self._window
        if len(w) < cfg.min_history:
            w.push(y)
            return None
        med = w.median()
        resid = y - med
        if resid < self._log_factor:
            w.push(y)
            return None
        z = resid / max(w.iqr_sigma(), cfg.min_sigma)
        if z < cfg.z_threshold:
            w.push(y)
            return None
        median = math.exp(med)
        ratio = math.exp(resid)
        return Finding(
            incident=Incident.GRAD_SPIKE,
            detector=self.name,
            severity=Severity.WARNING,
            step=step,
            onset_step=step,
            onset_cursor=cursor,
            message=f"grad norm {grad_norm:.4g} at step {step} is {ratio:.3g}x its moving "
            f"median {median:.4g} (robust z {z:.1f})",
            evidence={"grad_norm": r4(grad_norm), "median": r4(median), "ratio": r4(ratio),
                      "z": r4(z)},
        )

    def state_dict(self) -> dict[str, Any]:
        return {"window": self._window.state_dict()}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self._window.load_state_dict(d["window"])
