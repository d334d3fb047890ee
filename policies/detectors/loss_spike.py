"""Loss spikes: the mean loss breaks out of its robust moving baseline.

How it decides, per observed step (all in log-loss, so multiplying the loss by a constant
changes no verdict):

- baseline: the median of the last ``window`` *accepted* log-losses. A falling curve puts the
  median above the newest value, so the steep early descent of pretraining never looks like a
  rise; points inside a spike are never accepted, so a spike cannot drag its own baseline up.
- noise: a robust sigma of the first differences of accepted log-losses (interquartile range,
  divided by sqrt 2), floored at ``min_sigma``. Differences ignore the slow trend, so a curve
  that is still descending does not look noisy. With fewer than 32 differences the estimate is
  inflated by sqrt(32 / n): a quartile of seven numbers is too small about half the time.
- breakout: ``loss >= min_ratio * baseline`` AND robust ``z >= z_threshold``. The ratio keeps
  tiny-noise curves from flagging irrelevant wiggles; the z keeps noisy curves from flagging
  their ordinary outliers.
- elevated: above the hysteresis level ``1 + recover_fraction * (min_ratio - 1)`` times the
  baseline with ``z >= recover_fraction * z_threshold``. Elevated points that have not (yet)
  broken out are held back from the baseline; if the rise subsides they join it after all.
- episode: the onset is the first step of the elevated run that ended in the breakout (the
  breakout itself when it came out of the blue), reported at once as a WARNING. The episode
  lasts while the loss stays elevated; a spike that falls back below the elevated level has
  healed, and the WARNING was all. A CRITICAL finding (the policy rolls back) follows when the
  spike hurts:

  * catastrophic: a step at ``catastrophic_ratio`` x the baseline or more and a breakout by the
    noise (``z >= z_threshold``), at once (a NaN is the non-finite detector's, also at once);
  * diverging: the loss has kept rising for ``diverge_steps`` steps: the median log-excess of
    each quarter of them is above the quarter before by ``log(min_ratio)`` or more (the worst
    healthy spike of the Pythia runs climbed for about 25 steps, then fell);
  * not healed: still elevated ``patience`` steps after the onset, and the median of the last
    ``patience // 4`` steps is still ``hold_ratio`` x the baseline or more. One that settled
    lower is a level shift, not a spike: the run's new normal, so the baseline is re-learnt
    and nothing is rolled back.

  Waiting costs little: the rollback goes to the newest good checkpoint before the onset, not
  before the detection. The defaults come from real Pythia curves (docs/detection.md): their
  spikes heal within ~50 steps and peak below 1.7x.
- after a CRITICAL finding the baseline is dropped and re-learnt from the next ``min_history``
  points: either the run is rolled back (the supervisor calls ``reset()`` anyway) or the new
  level is the run's new normal and further rises must be measured against it.

Calling rules: call ``observe`` once per step, in step order, with the merged step: a
``StepRecord``, or on a multi-node leader a ``SummaryRecord`` (any ``JobStep``).
Steps whose loss is missing, non-finite (the NaN detector's job) or not positive (log-loss needs
a positive loss; this detector is for cross-entropy-like losses) are skipped without effect.
Units: loss as reported; ``patience``, ``window`` and ``min_history`` count observed steps.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

from pydantic import Field, model_validator

from babysit.policies.detectors._base import DetectorConfig
from babysit.policies.detectors._window import SortedWindow
from babysit.policies.types import Finding, Incident, JobStep, Severity, r4

_SQRT2 = math.sqrt(2.0)
# Below this many step-to-step differences the noise estimate is inflated by sqrt(32 / n).
_FULL_SIGMA_N = 32


class LossSpikeConfig(DetectorConfig):
    window: int = Field(default=64, ge=8, le=100_000)
    """Accepted steps in the moving baseline (median of log-loss)."""
    min_history: int = Field(default=8, ge=3)
    """No verdict before this many accepted steps. Small on purpose: the ratio test, not a long
    warmup, is what keeps the early descent quiet, and a short-lived run deserves protection."""
    min_ratio: float = Field(default=1.05, gt=1.0, le=100.0)
    """A breakout needs loss >= min_ratio x baseline (1.05 = 5 % above the local level)."""
    z_threshold: float = Field(default=6.0, gt=0.0)
    """...and a robust z-score (in units of the step-to-step log-loss noise) at least this."""
    patience: int = Field(default=80, ge=1)
    """Steps a spike may stay elevated and still count as healing (WARNING only); elevated at
    onset + patience, and still at least hold_ratio x the baseline -> CRITICAL. Real spikes of
    healthy runs heal within about 50 steps."""
    hold_ratio: float = Field(default=1.2, gt=1.0, le=100.0)
    """A spike not healed after patience is rolled back only if the median loss of its last
    patience // 4 steps is at least this x the baseline; lower, it is a level shift that the
    baseline adopts (healthy runs shift by a few percent)."""
    catastrophic_ratio: float = Field(default=3.0, gt=1.0)
    """A loss at this x the baseline or more, and a breakout by the noise (``z_threshold``), is
    CRITICAL at once, patience or not (healthy spikes of the Pythia runs peak below 1.7x)."""
    diverge_steps: int = Field(default=40, ge=8)
    """A spike whose loss has kept rising for this many steps (each quarter's median
    log-excess above the previous quarter's by log(min_ratio)) is diverging: CRITICAL before
    patience runs out."""
    recover_fraction: float = Field(default=0.5, ge=0.0, le=1.0)
    """Hysteresis: the episode ends when the loss falls below
    1 + recover_fraction x (min_ratio - 1) times the baseline."""
    min_sigma: float = Field(default=0.002, gt=0.0)
    """Noise floor in log-loss units (0.002 ~ 0.2 %), so a perfectly smooth curve still has a
    finite z-score."""

    @model_validator(mode="after")
    def _history_fits(self) -> LossSpikeConfig:
        if self.min_history > self.window:
            raise ValueError(
                f"min_history ({self.min_history}) must not exceed window ({self.window})"
            )
        if self.catastrophic_ratio < self.min_ratio:
            raise ValueError(f"catastrophic_ratio ({self.catastrophic_ratio}) must be at least "
                             f"min_ratio ({self.min_ratio})")
        return self


class LossSpikeDetector:
    """Flags a loss that breaks out of its robust moving baseline; see the module docstring."""

    name = "loss_spike"

    def __init__(self, config: LossSpikeConfig | None = None) -> None:
        self.config = config or LossSpikeConfig()
        self._levels = SortedWindow(self.config.window)
        self._diffs = SortedWindow(self.config.window)
        self._episode: dict[str, Any] | None = None
        self._rise: dict[str, Any] | None = None
        cfg = self.config
        self._log_min_ratio = math.log(cfg.min_ratio)
        self._log_elevated = math.log(1.0 + cfg.recover_fraction * (cfg.min_ratio - 1.0))
        self._log_hold = math.log(cfg.hold_ratio)
        self._log_catastrophic = math.log(cfg.catastrophic_ratio)

    def reset(self) -> None:
        """Forget the baseline (after a relaunch from a checkpoint, for instance)."""
        self._levels.clear()
        self._diffs.clear()
        self._episode = None
        self._rise = None

    def observe(self, record: JobStep) -> Finding | None:
        loss = record.loss
        if loss is None or not math.isfinite(loss) or loss <= 0.0:
            return None
        return self._observe(record.step, record.cursor, loss)

    def _observe(self, step: int, cursor: int, loss: float) -> Finding | None:
        cfg = self.config
        y = math.log(loss)
        if len(self._levels) < cfg.min_history:
            self._accept(y)
            return None
        level = self._levels.median()
        resid = y - level
        if resid < self._log_elevated:
            # The common case, decided without the noise estimate: not even elevated.
            self._settle()
            self._accept(y)
            return None
        sigma = self._sigma()
        z = resid / sigma
        ratio = math.exp(resid)
        # Catastrophic: far above the baseline AND far outside this run's own noise. On a large
        # batch (low noise) a tripled loss is thousands of sigmas out; on a tiny, noisy one a
        # tenfold reading can be an ordinary outlier (z 3) that the next step forgets.
        catastrophic = resid >= self._log_catastrophic and z >= cfg.z_threshold
        elevated = z >= cfg.recover_fraction * cfg.z_threshold or catastrophic
        ep = self._episode
        if ep is not None:
            if not elevated:
                self._settle()
                self._accept(y)
                return None
            ep["n"] += 1
            ep["peak_ratio"] = max(ep["peak_ratio"], ratio)
            ep["ys"].append(resid)
            return self._judge(ep, step, loss, ratio, z, catastrophic)
        rise = self._rise
        if (resid >= self._log_min_ratio and z >= cfg.z_threshold) or catastrophic:
            # Patience counts from the start of the rise that led here, not from the breakout:
            # a spike that crept up for several elevated steps has already shown persistence.
            onset: dict[str, Any] = rise or {"step": step, "cursor": cursor, "ys": []}
            ep = self._episode = {
                "onset_step": onset["step"], "onset_cursor": onset["cursor"],
                "n": len(onset["ys"]) + 1, "peak_ratio": ratio, "baseline": math.exp(level),
                "ys": [y0 - level for y0 in onset["ys"]] + [resid],
            }
            self._rise = None
            critical = self._judge(ep, step, loss, ratio, z, catastrophic)
            return critical or self._finding(ep, Severity.WARNING, step, loss, ratio, z)
        if not elevated:
            self._settle()
            self._accept(y)
            return None
        # Elevated but not (yet) a breakout: hold the point back from the baseline until the
        # rise either breaks out (then it was part of the spike) or subsides (then it was noise).
        if rise is None:
            rise = self._rise = {"step": step, "cursor": cursor, "ys": []}
        rise["ys"].append(y)
        if len(rise["ys"]) >= self.config.window // 2:
            # Elevated for half a window without breaking out: a small level shift, not a spike.
            self._settle()
        return None

    def _judge(self, ep: dict[str, Any], step: int, loss: float, ratio: float, z: float,
               catastrophic: bool) -> Finding | None:
        """The episode's CRITICAL finding when the spike hurts (see the module docstring), else
        None; a spike that outlasted patience at a low level becomes the new baseline."""
        cfg = self.config
        why = None
        if catastrophic:
            why = "catastrophic"
        elif self._diverging(ep["ys"]):
            why = "diverging"
        elif ep["n"] > cfg.patience:
            tail = sorted(ep["ys"][-max(1, cfg.patience // 4):])
            if tail[len(tail) // 2] >= self._log_hold:
                why = "not healed"
            else:
                # Settled a few percent up: the run's new normal, to be learnt afresh.
                self.reset()
                return None
        if why is None:
            return None
        ep["why"] = why
        finding = self._finding(ep, Severity.CRITICAL, step, loss, ratio, z)
        self.reset()
        return finding

    def _diverging(self, ys: list[float]) -> bool:
        k = self.config.diverge_steps // 4
        if len(ys) < 4 * k:
            return False
        medians = [sorted(ys[len(ys) - (i + 1) * k:len(ys) - i * k])[k // 2]
                   for i in (3, 2, 1, 0)]
        return all(b - a >= self._log_min_ratio for a, b in itertools.pairwise(medians))

    def _sigma(self) -> float:
        n = len(self._diffs)
        if n < 4:
            return self.config.min_sigma
        sigma = self._diffs.iqr_sigma() / _SQRT2
        if n < _FULL_SIGMA_N:
            # A quartile of a handful of differences is itself noisy, and too small about as
            # often as too large; while history is short, err on the quiet side.
            sigma *= math.sqrt(_FULL_SIGMA_N / n)
        return max(sigma, self.config.min_sigma)

    def _settle(self) -> None:
        """End any episode; points held back by a rise that did not break out join the
        baseline after all."""
        self._episode = None
        if self._rise is not None:
            for held in self._rise["ys"]:
                self._accept(held)
            self._rise = None

    def _accept(self, y: float) -> None:
        levels = self._levels
        if len(levels):
            self._diffs.push(y - levels.last())
        levels.push(y)

    def _finding(
        self, ep: dict[str, Any], severity: Severity, step: int, loss: float, ratio: float,
        z: float,
    ) -> Finding:
        why = ep.get("why") if severity is Severity.CRITICAL else None
        since = f"{step - ep['onset_step']} steps after the onset at step {ep['onset_step']}"
        what = {
            None: f"broke out to {ratio:.3g}x its baseline {ep['baseline']:.4g}; watching "
                  f"whether it heals within {self.config.patience} steps",
            "catastrophic": f"is {ratio:.3g}x its baseline {ep['baseline']:.4g}: catastrophic "
                            f"(>= {self.config.catastrophic_ratio:g}x)",
            "diverging": f"is {ratio:.3g}x its baseline {ep['baseline']:.4g} and still "
                         f"rising, {since}: diverging",
            "not healed": f"is still {ratio:.3g}x its baseline {ep['baseline']:.4g}, {since}: "
                          "not healed",
        }[why]
        return Finding(
            incident=Incident.LOSS_SPIKE,
            detector=self.name,
            severity=severity,
            step=step,
            onset_step=ep["onset_step"],
            onset_cursor=ep["onset_cursor"],
            message=f"loss {loss:.4g} at step {step} {what} (robust z {z:.1f})",
            evidence={
                "baseline": r4(ep["baseline"]), "loss": r4(loss), "ratio": r4(ratio),
                "z": r4(z), "peak_ratio": r4(ep["peak_ratio"]), "steps_elevated": ep["n"],
                **({"verdict": why} if why else {}),
            },
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "levels": self._levels.state_dict(),
            "diffs": self._diffs.state_dict(),
            "episode": {**self._episode, "ys": list(self._episode["ys"])}
            if self._episode else None,
            "rise": {**self._rise, "ys": list(self._rise["ys"])} if self._rise else None,
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self._levels.load_state_dict(d["levels"])
        self._diffs.load_state_dict(d["diffs"])
        ep = d["episode"]
        # A state saved before episodes kept their excesses judges the rest of it without.
        self._episode = {**ep, "ys": [float(y) for y in ep.get("ys", ())]} if ep else None
        rise = d["rise"]
        self._rise = {**rise, "ys": [float(y) for y in rise["ys"]]} if rise else None
