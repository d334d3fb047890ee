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

This module imports no pydantic (nor does ``babysit.policies.types``): a worker builds its
``GradGuard`` from the settings its directive carries (``GuardSettings``, the supervisor's
validated ``GradNormConfig`` dumped) at every rank's start, where pydantic's import would add
to each rank's start-up (``docs/measured.md#ci``). The config, its fields' docs and limits are
``grad_norm.GradNormConfig``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from babysit.policies.detectors._window import SortedWindow
from babysit.policies.types import Finding, Incident, JobStep, Severity, r4


@dataclass(frozen=True, slots=True)
class GuardSettings:
    """The grad-norm settings, every field given: ``GradNormConfig`` validated and dumped (by
    the supervisor into a worker's directive, or by ``GradNormDetector``)."""

    window: int
    min_history: int
    factor: float
    z_threshold: float
    min_sigma: float


class GradGuard:
    """Flags a grad norm far above its moving median; see the module docstring. The policy's
    detector is ``grad_norm.GradNormDetector``: this, with the config's defaults when given
    none."""

    name = "grad_norm"

    def __init__(self, settings: GuardSettings) -> None:
        self.settings = settings
        self._window = SortedWindow(settings.window)
        self._log_factor = math.log(settings.factor)

    def observe(self, record: JobStep) -> Finding | None:
        g = record.grad_norm
        return None if g is None else self.observe_value(record.step, g, record.cursor)

    def observe_value(
        self, step: int, grad_norm: float, cursor: int | None = None
    ) -> Finding | None:
        if not math.isfinite(grad_norm) or grad_norm <= 0.0:
            return None
        cfg = self.settings
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
