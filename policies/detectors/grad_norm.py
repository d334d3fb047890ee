"""Gradient-norm spikes: the detector's config (the policy's ``detectors.grad_norm``).

The detector is ``grad_guard.GradGuard``, pure Python without pydantic, since every worker runs
it in process (its module says how it decides); ``GradNormDetector`` is it with this config.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from babysit.policies.detectors._base import DetectorConfig
from babysit.policies.detectors.grad_guard import GradGuard, GuardSettings


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


class GradNormDetector(GradGuard):
    """The policy's grad-norm detector: ``GradGuard`` with ``GradNormConfig`` (its defaults
    when given none)."""

    def __init__(self, config: GradNormConfig | None = None) -> None:
        self.config = config or GradNormConfig()
        super().__init__(GuardSettings(**self.config.model_dump()))
