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
them). The finding names the ranks that were the slowest in at least a quarter as many slow
steps as the rank most often slowest (a healthy rank a busy moment made the slowest of a few
steps is left out; how often each was, in its evidence): a multi-node leader evicts a node
only when they are all on it (``cluster.eviction``), and a slowness that follows the data
names many ranks. A finding that names more than half the ranks (a busy host whose every rank
is late by turns, long sequences landing anywhere) is no one machine's; if fewer of them then
stand out, the slowest in ``min_share`` of the steps on their own (a machine throttled on a
host that was noisy already), they are reported again, by themselves. The episode ends when
fewer than half the window's steps are slow; a new one is reported again.

Its evidence also carries what the slow machine costs the job: ``slowdown``, the fraction of
the job's pace lost, from the job's step time now against its step time before the episode
(``baseline_step_time_s``: the median of the last steps the named ranks did not hold up:
neither the slowest of that step nor of more than 2 of the 10 before it; a busy host whose
leader node is often a little slow still has a pace to compare with), as it stood a quarter
of ``window_s`` before the episode began (a signal can lag the slowdown: a slow link's round
trip climbs as its queue fills, and the job's steps are slow before it crosses the line; the
paces are marked every twelfth of ``window_s``, the oldest mark standing in when none is that
old), or, with no such step seen yet, from the forward's excess over the median alone (a lower
bound: the backward's excess is not counted). The episode began where the named ranks began
holding the job up in most steps (each mark also counts who held it up since the one before;
the start of the stretch whose tally leads the most), not at the window's first slow step: a
machine throttled in bursts can take minutes to be slow in ``min_share`` of a window, and by
then the window starts long after the slowdown did.

Calling rules: one ``observe`` per merged step (any ``JobStep``); steps without forward times
(a script that passes no model to ``attach()``) are ignored. Units: seconds.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, deque
from typing import Any

from pydantic import Field

from babysit.policies.detectors._base import DetectorConfig, r4
from babysit.policies.types import Finding, Incident, JobStep, Severity, Spread

CALM = 10
"""The steps before a step that say which rank, if any, was holding the job up then..."""
CALM_SLOW = 2
"""...the one the slowest in more than this many of them."""
PACES = 4
"""Paces kept, one per rank that held the job up (and one for none), the latest first."""
MARKS = 36
"""Marks of the paces kept, one every twelfth of ``window_s``: three windows back."""

Held = Counter[int | None]
"""Steps by the rank holding the job up then (None: nobody), between two marks."""
Mark = tuple[float, list[tuple[int | None, float]], Held]
"""(time, each pace's median, the latest last, who held the job up since the mark before)."""


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
    """Steps whose median is the job's pace before the episode (its cost): the last ones the
    named ranks did not hold up."""


class _Bucket:
    """The steps of one slice of the window (``window_s / BUCKETS`` seconds): how many, how
    many slow, who was the slowest in those, and the sums their means come from."""

    __slots__ = ("first_slow", "forward", "median", "n", "ranks", "slow", "start", "timed",
                 "times")

    def __init__(self, start: float) -> None:
        self.start, self.n, self.slow = start, 0, 0
        self.ranks: Counter[int] = Counter()
        self.forward = self.median = self.times = 0.0
        self.timed = 0
        self.first_slow: int | None = None

    def to_json(self) -> list[Any]:
        return [self.start, self.n, self.slow, {str(k): v for k, v in self.ranks.items()},
                self.forward, self.median, self.times, self.timed, self.first_slow]

    @classmethod
    def from_json(cls, d: list[Any]) -> _Bucket:
        b = cls(float(d[0]))
        b.n, b.slow = int(d[1]), int(d[2])
        b.ranks = Counter({int(k): int(v) for k, v in d[3].items()})
        b.forward, b.median, b.times, b.timed = float(d[4]), float(d[5]), float(d[6]), int(d[7])
        b.first_slow = d[8]
        return b


BUCKETS = 120
"""Slices of the window: its state and each step's cost stay the same at any step rate."""


class SlowComputeDetector:
    """Names the rank (or node) whose forward lags the others'; see the module docstring.

    A subclass watches another per-step spread the same way (``slow_link``: a node's network
    round trip) by setting ``name``, ``signal``, ``said`` and ``spread``."""

    name = "slow_compute"
    signal = "forward"
    """The evidence's ``signal``, and its ``<signal>_s`` field."""
    said = ("compute", "forward")
    """How the message says it: "slow compute at step N: rank R's forward ..."."""

    @staticmethod
    def spread(record: JobStep) -> Spread | None:
        """The step's slowest rank against the median, or None: this detector's signal."""
        return record.slowest_forward

    def __init__(self, config: SlowComputeConfig | None = None) -> None:
        self.config = config or SlowComputeConfig()
        self._window: deque[_Bucket] = deque()
        self._slowest: Counter[int] = Counter()
        """The window's buckets' ``ranks`` added up, kept as buckets come and go."""
        self._first: float | None = None
        self._paces: dict[int | None, deque[float]] = {}
        self._marks: deque[Mark] = deque(maxlen=MARKS)
        self._held: Held = Counter()
        """Who held the job up in the steps since the last mark."""
        self._named: tuple[int, ...] | None = None
        """The ranks this episode's finding named; None: no finding in this episode."""
        self._recent: deque[int | None] = deque(maxlen=CALM)

    def observe(self, record: JobStep) -> Finding | None:
        spread = self.spread(record)
        if spread is None:
            return None
        cfg = self.config
        now = record.time
        slow = spread.value > cfg.factor * spread.median \
            and spread.value - spread.median >= cfg.min_excess_s
        self._add(now, record.step, slow, spread.rank, spread.value, spread.median,
                  record.step_time)
        if self._first is None:
            self._first = now
        n = sum(b.n for b in self._window)
        share = sum(b.slow for b in self._window) / n
        self._held[self._pace(spread.rank if slow else None, record.step_time)] += 1
        if self._paces and (not self._marks
                            or now >= self._marks[-1][0] + cfg.window_s / (MARKS / 3)):
            self._marks.append((now, [(held, statistics.median(pace))
                                      for held, pace in self._paces.items() if pace],
                                self._held))
            self._held = Counter()
        if self._named is not None:
            if share < 0.5:
                self._named = None
            # Told already, unless fewer of the ranks it named now hold the job up in most
            # steps on their own: a machine standing out of what was everyone's.
            if self._named is None or len(self._named) == 1 or not self._narrower(n):
                return None
        elif share < cfg.min_share or now - self._first < cfg.window_s:
            return None
        finding = self._finding(record.step, share, spread.count)
        self._named = finding.ranks
        return finding

    def _narrower(self, steps: int) -> bool:
        """Fewer of the ranks named so far are the slowest of at least ``min_share`` of the
        window's ``steps`` on their own."""
        counts = self._counts()
        ranks = _dominant(counts)
        return set(ranks) < set(self._named or ()) and \
            sum(counts[r] for r in ranks) >= self.config.min_share * steps

    def _counts(self) -> Counter[int]:
        """How often each rank was the slowest of a slow step in the window."""
        return self._slowest

    def _add(self, now: float, step: int, slow: bool, rank: int, forward: float,
             median: float, step_time: float | None) -> None:
        width = self.config.window_s / BUCKETS
        if not self._window or now >= self._window[-1].start + width:
            self._window.append(_Bucket(now))
        b = self._window[-1]
        b.n += 1
        if slow:
            b.slow += 1
            b.ranks[rank] += 1
            self._slowest[rank] += 1
            b.forward += forward
            b.median += median
            if step_time is not None:
                b.times += step_time
                b.timed += 1
            if b.first_slow is None:
                b.first_slow = step
        while self._window[0].start + width <= now - self.config.window_s:
            self._slowest -= self._window.popleft().ranks

    def _finding(self, step: int, share: float, count: int) -> Finding:
        window = self._window
        slow = sum(b.slow for b in window)
        counts = self._counts()
        forward = sum(b.forward for b in window) / slow
        median = sum(b.median for b in window) / slow
        timed = sum(b.timed for b in window)
        now_s = sum(b.times for b in window) / timed if timed else None
        ranks = _dominant(counts)
        began = self._began(ranks)
        base = self._pace_without(ranks, began - self.config.window_s / 4, began)
        if now_s is not None and base is not None and now_s > 0:
            slowdown, source = max(0.0, 1.0 - base / now_s), "step times before"
        elif now_s:
            slowdown, source = min(1.0, (forward - median) / now_s), "forward excess"
        else:
            slowdown, source = None, None
        top = counts.most_common(1)[0][0]
        onset = next(b.first_slow for b in window if b.first_slow is not None)
        span = window[-1].start - window[0].start
        return Finding(
            incident=Incident.STRAGGLER, detector=self.name, severity=Severity.WARNING,
            step=step, onset_step=onset, ranks=ranks,
            message=(f"slow {self.said[0]} at step {step}: rank {top}'s {self.said[1]} "
                     f"{forward:.3g}s vs "
                     f"median {median:.3g}s in {share:.0%} of the steps of the last "
                     f"{span:.0f}s"
                     + (f"; the job runs {slowdown:.0%} slower for it" if slowdown else "")
                     + (f"; {len(ranks)} of {count} ranks were the slowest by turns: no one "
                        "machine" if _spread(ranks, count) else "")),
            evidence={"signal": self.signal,
                      "slowest": {str(k): n for k, n in counts.items()},
                      "share": r4(share), "window_s": r4(span),
                      f"{self.signal}_s": r4(forward),
                      "median_s": r4(median), "ratio": r4(forward / median) if median else None,
                      "step_time_s": r4(now_s) if now_s is not None else None,
                      "baseline_step_time_s": r4(base) if base is not None else None,
                      "slowdown": r4(slowdown) if slowdown is not None else None,
                      "slowdown_from": source})

    def _pace(self, slowest: int | None, step_time: float | None) -> int | None:
        """File the step's time under the rank holding the job up lately (the slowest of more
        than CALM_SLOW of the last CALM steps), or None; return that rank. Not a quick forward
        between slow ones as a healthy step: a throttled machine is slow in bursts, and the
        steps between wait for it in the backward, so they are filed under it too."""
        counts = Counter(r for r in self._recent if r is not None)
        full = len(self._recent) == CALM
        self._recent.append(slowest)
        held = next((r for r, n in counts.most_common(1) if n > CALM_SLOW), None)
        if not full or step_time is None or step_time <= 0:
            return held
        if held is not None and slowest is not None and slowest != held:
            return held  # a step one other rank held up: no pace of anyone's
        pace = self._paces.pop(held, None) or deque(maxlen=self.config.baseline_steps)
        pace.append(step_time)
        self._paces[held] = pace  # latest last
        while len(self._paces) > PACES:
            del self._paces[next(iter(self._paces))]
        return held

    def _began(self, ranks: tuple[int, ...]) -> float:
        """When the named ranks began holding the job up: the mark before the stretch of marks
        up to now in which they held it up in the most steps more than in half of them (the
        oldest mark when that stretch is all of them; the latest when it is none)."""
        def lead(held: Held) -> int:
            return 2 * sum(held[r] for r in ranks) - sum(held.values())

        marks = list(self._marks)
        if not marks:
            return -math.inf
        total = best = lead(self._held)
        began = marks[-1][0]
        for i in range(len(marks) - 1, -1, -1):
            total += lead(marks[i][2])
            if total >= best:
                best, began = total, marks[i - 1][0] if i else -math.inf
        return began

    def _pace_without(self, ranks: tuple[int, ...], before: float,
                      began: float) -> float | None:
        """The latest pace the named ranks did not hold up, as marked last at ``before`` (or
        the oldest mark, when none is that old), or None. A mark made before the episode
        ``began`` with only the named ranks' pace (a noisy host made one of them the slowest of
        a few steps then) still gives that pace: it was the job's before they slowed it."""
        marks = [(t, paces) for t, paces, _ in self._marks if t <= before] or \
            [(t, paces) for t, paces, _ in list(self._marks)[:1]]
        if not marks:
            return None
        at, paces = marks[-1]
        for held, median in reversed(paces):
            if held not in ranks:
                return median
        return paces[-1][1] if paces and at < began else None

    def state_dict(self) -> dict[str, Any]:
        return {"window": [b.to_json() for b in self._window], "first": self._first,
                "paces": [[held, list(pace)] for held, pace in self._paces.items()],
                "marks": [[t, [[h, m] for h, m in paces], list(held.items())]
                          for t, paces, held in self._marks],
                "held": list(self._held.items()),
                "reported": self._named is not None,
                "named": list(self._named) if self._named is not None else None,
                "recent": list(self._recent)}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self._window = deque(_Bucket.from_json(b) for b in d["window"])
        self._slowest = sum((b.ranks for b in self._window), Counter())
        self._first = d["first"]
        self._paces = {held: deque(pace, maxlen=self.config.baseline_steps)
                       for held, pace in d.get("paces", ())}
        self._marks = deque(((float(m[0]), [(h, float(p)) for h, p in m[1]],
                              _held(m[2] if len(m) > 2 else ()))
                             for m in d.get("marks", ())), maxlen=MARKS)
        self._held = _held(d.get("held", ()))
        named = d.get("named")
        self._named = tuple(named) if named is not None else (() if d["reported"] else None)
        self._recent = deque(d.get("recent", ()), maxlen=CALM)


def _held(pairs: Any) -> Held:
    """A ``Held`` tally from its JSON form, ``[[rank or null, steps], ...]``."""
    return Counter({h: int(n) for h, n in pairs})


def _spread(ranks: tuple[int, ...], count: int) -> bool:
    """``ranks`` are more than half of the ``count`` ranks compared: no one machine."""
    return len(ranks) > max(1, count // 2)


def _dominant(counts: Counter[int]) -> tuple[int, ...]:
    """The ranks that were the slowest in at least a quarter as many slow steps as the rank
    most often slowest: the slow machine's ranks (all of a slow node's share the steps), not
    a healthy rank that a busy moment made the slowest of a few steps."""
    top = max(counts.values())
    return tuple(sorted(rank for rank, n in counts.items() if 4 * n >= top))
