"""Stragglers: one rank's own work persistently slower than its peers'.

Signals, per rank and step, each compared with the median of the *other* ranks at that step:

- ``data_wait``: seconds the rank waited for its next batch. A slow loader, a slow disk or a
  starved host shows here even under synchronous collectives, because the peers spend that
  time waiting inside the all-reduce instead, which is not data wait.
- ``compute`` = ``step_time - data_wait``: everything else the rank reports. Subtracting the
  data wait keeps a slow loader from hiding inside (or being blamed as) compute. Caveat, by
  design: under synchronous collectives (DDP, FSDP) the fast ranks wait for the slow one inside
  the collective, and the worker cannot tell that waiting from its own compute, so every rank's
  ``step_time`` comes out about equal and a compute straggler is invisible in this signal. It
  shows when ranks report their own section timing as ``step_time`` (or run without a global
  barrier per step); the hang detector and the stack dumps catch the extreme case.

A rank is slow on a signal when its value exceeds ``factor`` x the peer median by at least
``min_excess_s`` seconds and by at least ``min_excess_fraction`` of the peers' median step time
(the absolute floor keeps millisecond jitter on fast steps from counting; the relative one
keeps a wait that is large against a near-zero median but small against the step from
counting). It is reported (one WARNING naming it) after ``patience`` slow steps in a row, or
after ``immediate_steps`` when the ratio reaches ``immediate_factor``: a rank at 2-3x its peers
is not jitter, but a single slow step is a blip (a 30 ms data wait under CPU load against
peers' 0.2 ms), never a straggler. The rank is not reported again until it has been fine for
``patience`` steps in a row.

Calling rules: one ``observe`` per merged ``StepRecord``; ranks without ``step_time`` are
skipped for that step. Units: seconds.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from pydantic import Field, model_validator

from babysit.policies.detectors._base import DetectorConfig
from babysit.policies.types import Finding, Incident, RankStep, Severity, StepRecord, r4


class StragglerConfig(DetectorConfig):
    factor: float = Field(default=1.3, gt=1.0)
    """Slow means more than factor x the median of the other ranks."""
    immediate_factor: float = Field(default=2.0, gt=1.0)
    """At or above this ratio the rank is reported after immediate_steps, without patience."""
    immediate_steps: int = Field(default=2, ge=1)
    """Slow steps in a row needed even at immediate_factor: one slow step is a blip."""
    patience: int = Field(default=5, ge=1)
    """Consecutive slow steps (below immediate_factor) before the rank is reported."""
    min_excess_s: float = Field(default=0.02, ge=0.0)
    """...and the excess over the peer median must be at least this many seconds..."""
    min_excess_fraction: float = Field(default=0.1, ge=0.0)
    """...and at least this fraction of the peers' median step time."""

    @model_validator(mode="after")
    def _immediate_above_factor(self) -> StragglerConfig:
        if self.immediate_factor < self.factor:
            raise ValueError(
                f"immediate_factor ({self.immediate_factor}) must be >= factor ({self.factor})"
            )
        return self


def _signals(r: RankStep) -> dict[str, float]:
    step_time, wait = r.step_time, r.data_wait
    if step_time is None or not math.isfinite(step_time):
        return {}
    if wait is None or not math.isfinite(wait):
        return {"compute": step_time}
    return {"compute": max(step_time - wait, 0.0), "data_wait": wait}


class StragglerDetector:
    """Names the rank whose own work lags its peers; see the module docstring."""

    name = "straggler"

    def __init__(self, config: StragglerConfig | None = None) -> None:
        self.config = config or StragglerConfig()
        # Per rank (string keys: the state must survive JSON): slow streak, fine streak, onset,
        # and whether this episode was already reported.
        self._ranks: dict[str, dict[str, Any]] = {}

    def observe(self, record: StepRecord) -> Finding | None:
        cfg = self.config
        if len(record.ranks) < 2:
            return None
        per_rank = {r.rank: _signals(r) for r in record.ranks}
        per_rank = {k: v for k, v in per_rank.items() if v}
        if len(per_rank) < 2:
            return None
        report: dict[str, dict[str, Any]] = {}
        onset = record.step
        worst_of = {rank: self._worst(rank, per_rank) for rank in per_rank}
        if any(w is not None and w[1] == "data_wait" for w in worst_of.values()):
            # A rank waiting on its loader holds the others in the collective, which their
            # compute signal counts as their own: that is its mirror image, not a second straggler.
            worst_of = {k: (w if w is not None and w[1] == "data_wait" else None)
                        for k, w in worst_of.items()}
        for rank, worst in worst_of.items():
            st = self._ranks.setdefault(
                str(rank), {"slow": 0, "fine": 0, "onset": None, "reported": False}
            )
            if worst is None:
                st["slow"] = 0
                st["fine"] += 1
                if st["fine"] >= cfg.patience:
                    st["reported"] = False
                    st["onset"] = None
                continue
            st["fine"] = 0
            st["slow"] += 1
            if st["onset"] is None:
                st["onset"] = record.step
            ratio, name, value, med = worst
            if st["reported"]:
                continue
            if (ratio >= cfg.immediate_factor and st["slow"] >= cfg.immediate_steps) \
                    or st["slow"] >= cfg.patience:
                st["reported"] = True
                onset = min(onset, st["onset"])
                report[str(rank)] = {
                    "signal": name, "seconds": r4(value), "peer_median_s": r4(med),
                    "ratio": r4(ratio) if ratio != float("inf") else None,
                    "slow_steps": st["slow"],
                }
        if not report:
            return None
        ranks = tuple(sorted(int(k) for k in report))
        desc = "; ".join(
            f"rank {k}: {v['signal']} {v['seconds']}s vs peer median {v['peer_median_s']}s"
            for k, v in sorted(report.items(), key=lambda kv: int(kv[0]))
        )
        return Finding(
            incident=Incident.STRAGGLER,
            detector=self.name,
            severity=Severity.WARNING,
            step=record.step,
            onset_step=onset,
            ranks=ranks,
            message=f"straggler at step {record.step}: {desc}",
            evidence=report,
        )

    def _worst(self, rank: int, per_rank: dict[int, dict[str, float]]
               ) -> tuple[float, str, float, float] | None:
        """The signal on which ``rank`` lags its peers the most: (ratio, name, value, median)."""
        cfg = self.config
        worst: tuple[float, str, float, float] | None = None
        others = [sum(p.values()) for k, p in per_rank.items() if k != rank]
        floor = max(cfg.min_excess_s,
                    cfg.min_excess_fraction * statistics.median(others) if others else 0.0)
        for name, value in per_rank[rank].items():
            peers = [p[name] for k, p in per_rank.items() if k != rank and name in p]
            if not peers:
                continue
            med = statistics.median(peers)
            if value - med < floor or value <= cfg.factor * med:
                continue
            ratio = value / med if med > 0 else float("inf")
            if worst is None or ratio > worst[0]:
                worst = (ratio, name, value, med)
        return worst

    def state_dict(self) -> dict[str, Any]:
        return {"ranks": {k: dict(v) for k, v in self._ranks.items()}}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self._ranks = {str(k): dict(v) for k, v in d["ranks"].items()}
