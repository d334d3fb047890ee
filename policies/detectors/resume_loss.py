"""A resume that did not take, seen in the loss: the first steps after a resume against what the
run recorded up to the checkpoint's step.

A relaunch resumes from a checkpoint saved at step S; the model it restored computed a loss the
run recorded at the steps up to S. A script that loads other weights over the restored ones
(a "load pretrained" line placed after the restore), or restores nothing at all, starts over
with a loss near its initial value: far above. babysit's API checks the parameters themselves
at the first forward (``Run._check_restore``); this check needs only the loss, so it also
covers stdout mode (the script's own checkpoints and printed losses) and what a digest cannot
see (an optimizer or scheduler state left behind shows in the loss a few steps later).

How it decides, in log-loss (a constant factor changes no verdict):

- recorded: the finite losses of the ``history`` steps up to S the run saw (its first pass);
  at least 4, else no verdict. Their median is the level; the noise is a robust sigma of their
  step-to-step differences (median absolute deviation x 1.4826 / sqrt 2), inflated by
  sqrt(32 / n) below 32 differences as the loss-spike detector does, floored at ``min_sigma``.
- seen: the median of the first ``steps`` finite losses after S.
- did not take: ``seen >= min_ratio x level`` AND the difference of the two medians is at
  least ``z_threshold`` of its own noise (a median of k samples moves by about 1.25 sigma /
  sqrt k). The ratio keeps a smooth curve's small bumps from counting; the z keeps a noisy
  curve's.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Mapping

from pydantic import Field

from babysit.policies.detectors._base import DetectorConfig
from babysit.policies.types import Finding, Incident, Severity, r4


class ResumeLossConfig(DetectorConfig):
    """Whether a resume took, judged from the loss of its first steps."""

    steps: int = Field(default=5, ge=1)
    """First steps after a resume whose median loss is compared (0 would judge nothing)."""
    history: int = Field(default=16, ge=4)
    """Steps up to the checkpoint's, as the run recorded them, that make the reference."""
    min_ratio: float = Field(default=1.5, gt=1.0)
    """The resumed loss must be at least this many times the recorded one..."""
    z_threshold: float = Field(default=6.0, gt=0.0)
    """...and this many of its noise units above it."""
    min_sigma: float = Field(default=0.01, gt=0.0)
    """Noise floor of the recorded log-loss (a curve smoother than this counts as this)."""


def _log(x: float | None) -> float | None:
    return math.log(x) if x is not None and math.isfinite(x) and x > 0.0 else None


class ResumeLoss:
    """One resume's check: ``start`` at the launch, ``observe`` each step of the attempt."""

    name = "resume_loss"

    def __init__(self, config: ResumeLossConfig, checkpoint_step: int,
                 recorded: list[float], last_step: int | None = None) -> None:
        self.config, self.checkpoint_step = config, checkpoint_step
        self.last_step = checkpoint_step if last_step is None else last_step
        """The last step before the resumed ones (the first it judges is the next)."""
        self.level = statistics.median(recorded)
        diffs = [b - a for a, b in itertools.pairwise(recorded)]
        mid = statistics.median(diffs) if diffs else 0.0
        mad = statistics.median(abs(d - mid) for d in diffs) if diffs else 0.0
        inflate = math.sqrt(32 / len(diffs)) if 0 < len(diffs) < 32 else 1.0
        self.sigma = max(config.min_sigma, 1.4826 * mad / math.sqrt(2) * inflate)
        self.n_recorded = len(recorded)
        self.seen: list[float] = []
        self.done = False

    @classmethod
    def start(cls, config: ResumeLossConfig, last_step: int,
              losses: Mapping[int, float | None],
              checkpoint_step: int | None = None) -> ResumeLoss | None:
        """The check of an attempt that resumed after ``last_step``, from the ``losses`` the run
        recorded (step -> loss); None with fewer than 4 finite ones in the ``history`` steps up
        to it. ``checkpoint_step``: the checkpoint as the supervisor knows it, which the finding
        names (a script's own checkpoint may be registered at a step a poll saw a little
        earlier); None: ``last_step``."""
        first = last_step - config.history + 1
        recorded = [y for s in sorted(losses) if first <= s <= last_step
                    and (y := _log(losses[s])) is not None]
        if len(recorded) < 4:
            return None
        named = last_step if checkpoint_step is None else checkpoint_step
        return cls(config, named, recorded, last_step)

    def observe(self, step: int, loss: float | None) -> Finding | None:
        """A step of the resumed attempt; the finding once its first ``steps`` losses say the
        restore did not take (then, and after any verdict, it judges no more)."""
        y = _log(loss)
        if self.done or step <= self.last_step or y is None:
            return None
        self.seen.append(y)
        if len(self.seen) < self.config.steps:
            return None
        self.done = True
        seen = statistics.median(self.seen)
        noise = 1.25 * self.sigma * math.sqrt(1 / len(self.seen) + 1 / self.n_recorded)
        z = (seen - self.level) / noise
        ratio = math.exp(seen - self.level)
        if ratio < self.config.min_ratio or z < self.config.z_threshold:
            return None
        recorded, now = math.exp(self.level), math.exp(seen)
        s = self.checkpoint_step
        return Finding(
            incident=Incident.RESUME, detector=self.name, severity=Severity.CRITICAL, step=s,
            onset_step=s,
            message=f"resume from step {s}: loss {now:.4g} vs {recorded:.4g} recorded "
                    f"({ratio:.3g}x, robust z {z:.1f}) -> the restore did not take (weights "
                    "loaded over the restored ones, or not restored at all? an optimizer or "
                    "scheduler state left behind?)",
            evidence={"checkpoint_step": s, "recorded_loss": r4(recorded), "seen_loss": r4(now),
                      "ratio": r4(ratio), "z": r4(z), "steps_seen": len(self.seen),
                      "steps_recorded": self.n_recorded})
