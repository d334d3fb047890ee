"""A slow machine: one rank's own compute lagging the others' for minutes, whatever its data.

The signal is each rank's training forward time (``RankStep.forward_time``, timed by
``attach(model=...)``): under DDP it holds no collective, so it is the rank's own work, where a
step time is not (every rank waits for the slowest inside the all-reduce, see
``straggler.py``). Each step gives the slowest rank's forward and the median of all
(``JobStep.slowest_forward``: every rank on one node, the nodes' merged summaries on a leader),
so a whole slow node is seen against the others.

A step is *slow* when the slowest forward exceeds ``factor`` x the median by at least
``min_excess_s``. The machine is reported (one WARNING) once the last ``window_s`` seconds of
steps were slow in at least ``min_share`` of them: for minutes, and so across many batches
(each step draws new data; a long sequence or a large image slows one step, not minutes of
them). The finding names the fewest ranks that were the slowest in ``min_share`` of the slow
steps (a healthy rank a busy moment made the slowest of a step or two is left out; how often
each was, in its evidence): a multi-node leader evicts a node only when they are all on it
(``cluster.eviction``), and a slowness that follows the data names many ranks. The episode
ends when fewer than half the window's steps are slow; a new one is reported again.

Its evidence also carries what the slow machine costs the job: ``slowdown``, the fraction of
the job's pace lost, from the job's step time now against its step time before the episode
(``baseline_step_time_s``: the median of the last healthy steps, those not slow and within
1.25x of the pace so far, or of any pace in a window without a slow step), or, with no healthy step
seen yet, from the forward's excess over the median alone (a lower bound: the backward's
excess is not counted).

Calling rules: one ``observe`` per merged step (any ``JobStep``); steps without forward times
(a script that passes no model to ``attach()``) are ignored. Units: seconds.
"""

from __future__ import annotations

import statistics
from collections import Counter, deque
from typing import Any

from pydantic import Field

from babysit.policies.detectors._base import DetectorConfig, r4
from babysit.policies.types import Finding, Incident, JobStep, Severity


class SlowComputeConfig(DetectorConfig):
    factor: float = Field(default=1.5, gt=1.0)
    """A step is slow when its slowest rank's forward is above factor x the ranks' median."""
    min_excess_s: float = Field(default=0.002, ge=0.0)
    """...and above it by at least this many seconds (millisecond jitter is no machine)."""
    window_s: float = Field(default=120.0, gt=0.0)
    """How long the steps must have been slow: minutes, so across many batches."""
    min_share: float = Field(default=0.8, gt=0.0, le=1.0)
    """The share of the window's steps that must be slow."""
    baseline_steps: int = Field(default=50, ge=1)
    """Healthy steps whose median is the job's pace before the episode (its cost)."""


class SlowComputeDetector:
    """Names the rank (or node) whose forward lags the others'; see the module docstring."""

    name = "slow_compute"

    def __init__(self, config: SlowComputeConfig | None = None) -> None:
        self.config = config or SlowComputeConfig()
        # Each step of the window: time, step, slowest rank when slow (else -1), its forward,
        # the median forward, the job's step time.
        self._window: deque[tuple[float, int, int, float, float, float | None]] = deque()
        self._first: float | None = None
        self._healthy: deque[float] = deque(maxlen=self.config.baseline_steps)
        self._reported = False

    def observe(self, record: JobStep) -> Finding | None:
        spread = record.slowest_forward
        if spread is None:
            return None
        cfg = self.config
        now = record.time
        slow = spread.value > cfg.factor * spread.median \
            and spread.value - spread.median >= cfg.min_excess_s
        self._window.append((now, record.step, spread.rank if slow else -1, spread.value,
                             spread.median, record.step_time))
        if self._first is None:
            self._first = now
        while self._window and self._window[0][0] < now - cfg.window_s:
            self._window.popleft()
        share = sum(1 for w in self._window if w[2] >= 0) / len(self._window)
        if self._reported:
            if share < 0.5:
                self._reported = False
            return None
        if not slow and self._healthy_pace(record.step_time, share):
            self._healthy.append(record.step_time)  # type: ignore[arg-type]
        if share < cfg.min_share or now - self._first < cfg.window_s:
            return None
        self._reported = True
        return self._finding(record.step, share)

    def _healthy_pace(self, step_time: float | None, share: float) -> bool:
        """Is this step's time the job's healthy pace? Not a step whose forward was fine while
        the slow machine held every rank up in the backward (a CPU limit throttles in bursts):
        within 1.25x of the pace so far, or any pace once the window holds no slow step."""
        if step_time is None or step_time <= 0:
            return False
        if share == 0.0 or len(self._healthy) < 10:
            return True
        return step_time <= 1.25 * statistics.median(self._healthy)

    def _finding(self, step: int, share: float) -> Finding:
        slow = [w for w in self._window if w[2] >= 0]
        counts = Counter(w[2] for w in slow)
        forward = statistics.median(w[3] for w in slow)
        median = statistics.median(w[4] for w in slow)
        times = [w[5] for w in slow if w[5] is not None]
        now_s = statistics.median(times) if times else None
        base = statistics.median(self._healthy) if self._healthy else None
        if now_s is not None and base is not None and now_s > 0:
            slowdown, source = max(0.0, 1.0 - base / now_s), "step times before"
        elif now_s:
            slowdown, source = min(1.0, (forward - median) / now_s), "forward excess"
        else:
            slowdown, source = None, None
        ranks = _dominant(counts, cfg_share=self.config.min_share)
        top = counts.most_common(1)[0][0]
        span = slow[-1][0] - self._window[0][0]
        return Finding(
            incident=Incident.STRAGGLER, detector=self.name, severity=Severity.WARNING,
            step=step, onset_step=slow[0][1], ranks=ranks,
            message=(f"slow compute at step {step}: rank {top}'s forward {forward:.3g}s vs "
                     f"median {median:.3g}s in {share:.0%} of the steps of the last "
                     f"{span:.0f}s"
                     + (f"; the job runs {slowdown:.0%} slower for it" if slowdown else "")),
            evidence={"signal": "forward", "slowest": {str(k): n for k, n in counts.items()},
                      "share": r4(share), "window_s": r4(span), "forward_s": r4(forward),
                      "median_s": r4(median), "ratio": r4(forward / median) if median else None,
                      "step_time_s": r4(now_s) if now_s is not None else None,
                      "baseline_step_time_s": r4(base) if base is not None else None,
                      "slowdown": r4(slowdown) if slowdown is not None else None,
                      "slowdown_from": source})

    def state_dict(self) -> dict[str, Any]:
        return {"window": [list(w) for w in self._window], "first": self._first,
                "healthy": list(self._healthy), "reported": self._reported}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self._window = deque(tuple(w) for w in d["window"])
        self._first = d["first"]
        self._healthy = deque(d["healthy"], maxlen=self.config.baseline_steps)
        self._reported = bool(d["reported"])


def _dominant(counts: Counter[int], cfg_share: float) -> tuple[int, ...]:
    """The fewest ranks that were the slowest in ``cfg_share`` of the slow steps, most often
    first: the slow machine's ranks, without the healthy rank that a busy moment made the
    slowest of a step or two."""
    total, chosen, covered = sum(counts.values()), [], 0
    for rank, n in counts.most_common():
        chosen.append(rank)
        covered += n
        if covered >= cfg_share * total:
            break
    return tuple(sorted(chosen))
