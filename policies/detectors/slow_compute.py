"""A slow machine: one rank's own compute lagging the others' for minutes, whatever its data.

The signal is each rank's training forward time (``RankStep.forward_time``, timed by
``attach(model=...)``): under DDP it holds no collective, so it is the rank's own work, where a
step time is not (every rank waits for the slowest inside the all-reduce, see
``straggler.py``). Each step gives the slowest rank's forward and the median of all
(``JobStep.slowest_forward``: every rank on one node, the nodes' merged summaries on a leader),
so a whole slow node is seen against the others.

A step is *slow* when the slowest forward exceeds ``factor`` x the median by at least
``min_excess_s``; its slowest rank *held the job up* for the step's time. The ranks are named
(one WARNING) once they have held the job up in at least ``min_share`` of the time for
``window_s / 2`` seconds, and still do (for minutes, and so across many batches; each step
draws new data, and a long sequence or a large image slows one step, not minutes of them):
since where their share rose above ``min_share`` (the start from which on their time holding
the job up exceeds ``min_share`` of the steps' time by the most), and in the last eighth of the
window too. How long they have been at it, not how many seconds they were seen holding the job
up: the forward clock sees a throttled machine in only some of its steps (a CPU quota lets a
forward through at full speed when it has not run out, and the throttle then lands in the
backward, where every rank waits for it in the all-reduce), so a count of the seconds seen
waits longer the less the clock sees, and a share of the whole window is diluted by the steps
from before. Shares are of time, each step weighed by its step time, not by steps: a machine
that slows the job makes fewer steps a minute, and counted by steps the quick ones from before
it would outvote it. Which ranks: those that held the job up at least a quarter as long as the
rank that held it up longest, in the window's last quarter (who holds it up now: a healthy rank
a busy moment made the slowest of a few steps is left out, and so is a busy host's steady noise
from before; how often each was the slowest, in the evidence), each of them, over the stretch,
on average at least four times as long as each other rank (one machine: a busy host's ranks are
late by turns, about alike): a multi-node leader evicts a node only when they are all on it
(``cluster.eviction``), and a slowness that follows the data names many ranks. A finding that
would name more than half the ranks (a busy host whose every rank is late by turns, long
sequences landing anywhere) is no one machine's: it is said only when the job was slow in
``spread_share`` of the window; if fewer ranks then stand out on their own, as above (a machine
throttled on a host that was noisy already), they are reported again, by themselves. One
machine still at it is told again (evidence ``again``, the same onset and pace before, its step
time now) each time it has been at it twice as long as when last told: what it costs depends on
how long the run goes on, and a multi-node leader that kept it early in the run weighs it anew.
The episode ends when the job was slow in less than half of ``min_share`` of the window; a new
one is reported again.

Its evidence also carries what the slow machine costs the job: ``slowdown``, the fraction of
the job's pace lost, from the job's step time now against its step time before the episode
(``baseline_step_time_s``: the median of the last steps the named ranks did not hold up:
neither the slowest of that step nor of more than 2 of the 10 before it; a busy host whose
leader node is often a little slow still has a pace to compare with), as it stood a quarter of
``window_s`` before the episode began (a signal can lag the slowdown: a slow link's round trip
climbs as its queue fills, and the job's steps are slow before it crosses the line; the paces
are marked every twelfth of ``window_s``; when none is that old, the last before the episode,
not the run's first, its warm-up's), or, with no such step seen yet, from the forward's excess
over the median alone (a lower bound: the backward's excess is not counted). The episode began
where the named ranks' share of the time rose above ``min_share`` (the start of the slices they
are named for), not at the window's first slow step; where those reach as far back as the
window does (ranks named long after the slowdown began, after a finding that named no one
machine), the marks say how much further: each also counts who held the job up since the one
before, and the episode began at the start of the stretch of marks in which the named ranks
held it up in the most steps more than in half of them (marks reach three windows back). A busy
start (a job warming up on busy cores) can make a rank the slowest of half the steps from the
first mark on, so the marks alone would leave no pace before.

Calling rules: one ``observe`` per merged step (any ``JobStep``); steps without forward times
(a script that passes no model to ``attach()``) are ignored. Units: seconds.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, deque
from collections.abc import Mapping
from typing import Any

from pydantic import Field

from babysit.policies.detectors._base import DetectorConfig
from babysit.policies.types import Finding, Incident, JobStep, Severity, Spread, r4

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
    """The steps judged, in seconds: ranks are named once they held the job up for half of it
    (minutes, so across many batches)."""
    min_share: float = Field(default=0.4, gt=0.0, le=1.0)
    """The share of the time in which the named ranks must have held the job up, for
    ``window_s / 2`` and still. A rank at a tenth of a core holds it up in 50-90% of the time on
    a 2-core VM (a CPU quota lets some of its forwards through at full speed, the throttle
    landing in its backward, where the forward clock does not see it: the lighter the forward,
    the more often); a healthy one on a busy host, by turns with the others, in under a quarter
    there. A third of the steps or less is a busy host's noise, even on one rank."""
    spread_share: float = Field(default=0.8, gt=0.0, le=1.0)
    """For a finding that names no one machine (more than half the ranks, slow by turns): the
    share of the window's time that must be slow. A busy host is late by turns in many steps;
    that is worth saying only when it is nearly all of them."""
    baseline_steps: int = Field(default=50, ge=1)
    """Steps whose median is the job's pace before the episode (its cost): the last ones the
    named ranks did not hold up."""


class _Bucket:
    """The steps of one slice of the window (``window_s / BUCKETS`` seconds): how many, how
    many slow, who was the slowest in those, the time each took (``Held``), and the sums their
    means come from."""

    __slots__ = ("first_slow", "forward", "held", "median", "n", "ranks", "slow", "start",
                 "timed", "times", "weight")

    def __init__(self, start: float) -> None:
        self.start, self.n, self.slow = start, 0, 0
        self.ranks: Counter[int] = Counter()
        self.held: dict[int, float] = {}
        """Seconds of the slow steps each rank was the slowest of (their step times)."""
        self.weight = 0.0
        """Seconds of all the bucket's steps (their step times)."""
        self.forward = self.median = self.times = 0.0
        self.timed = 0
        self.first_slow: int | None = None

    def held_by(self, timed: bool) -> Mapping[int, float]:
        """How long each rank held the job up in this slice: seconds where the window's steps
        said their time (``timed``), else how many slow steps it was the slowest of."""
        return self.held if timed else self.ranks

    def total(self, timed: bool) -> float:
        """This slice's steps' time, in the unit of ``held_by``."""
        return self.weight if timed else self.n

    def to_json(self) -> list[Any]:
        return [self.start, self.n, self.slow, {str(k): v for k, v in self.ranks.items()},
                self.forward, self.median, self.times, self.timed, self.first_slow,
                self.weight, {str(k): v for k, v in self.held.items()}]

    @classmethod
    def from_json(cls, d: list[Any]) -> _Bucket:
        b = cls(float(d[0]))
        b.n, b.slow = int(d[1]), int(d[2])
        b.ranks = Counter({int(k): int(v) for k, v in d[3].items()})
        b.forward, b.median, b.times, b.timed = float(d[4]), float(d[5]), float(d[6]), int(d[7])
        b.first_slow = d[8]
        if len(d) > 10:
            b.weight, b.held = float(d[9]), {int(k): float(v) for k, v in d[10].items()}
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
        self._episode: tuple[float, float, float | None, int] | None = None
        """The episode of the one machine named: when it began, when to tell it again, the pace
        before it (None: none known) and its onset step."""
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
        share = self._share()
        self._held[self._pace(spread.rank if slow else None, record.step_time)] += 1
        if self._paces and (not self._marks
                            or now >= self._marks[-1][0] + cfg.window_s / (MARKS / 3)):
            self._marks.append((now, [(held, statistics.median(pace))
                                      for held, pace in self._paces.items() if pace],
                                self._held))
            self._held = Counter()
        # Who holds the job up now (the window's last quarter), and since when: a busy host's
        # steady noise from before is not the new slow machine.
        ranks = _dominant(self._weights(since=now - cfg.window_s / 4))
        again = False
        if self._named is not None:
            if share < cfg.min_share / 2:
                self._named = self._episode = None
            if self._named is None:
                return None
            # Told already, unless fewer of the ranks it named now stand out on their own (a
            # machine standing out of what was everyone's), or the machine it named has been
            # at it twice as long as when it was last told (what it costs, weighed again).
            again = self._episode is not None and ranks == self._named \
                and now >= self._episode[1]
            if not again and (len(self._named) == 1 or not set(ranks) < set(self._named)):
                return None
        if _spread(ranks, spread.count):
            if self._named is not None or not self._long(None, cfg.spread_share):
                return None
            since = -math.inf
        else:
            began = self._machine(ranks, spread.count, now)
            if began is None:
                return None
            since = began
        finding = self._finding(record.step, now, spread.count, ranks, since, again)
        self._named = finding.ranks
        return finding

    def _machine(self, ranks: tuple[int, ...], count: int, now: float) -> float | None:
        """When ``ranks``, one machine's, began slowing the job (``_began_at``: the start of
        the window's slices they are named for), or None while they are not that yet. One
        machine's: no more than half the ``count`` ranks compared, each of them on average at
        least four times as long the slowest as each of the others (as a rank is named beside
        the slowest only when it held the job up a quarter as long: a slowness that follows the
        data holds it up on every rank alike, and any half of them hold it up half the time).
        Slowing the job: they held it up in ``min_share`` of the time for ``window_s / 2`` or
        more (minutes, and so across many batches), and still do, in the last eighth of the
        window (a burst that ended is not named for its quiet tail).

        How long they have been at it, not how long they held the job up in all: the forward
        clock sees a throttled machine in only part of its steps (in the others its throttle
        lands in its backward, where every rank waits for it in the all-reduce), and counting
        the seconds it was seen would wait longer for a machine the clock sees less of; nor
        the whole window's share, which the steps from before it dilute."""
        cfg = self.config
        if not ranks or _spread(ranks, count):
            return None
        began = self._began_at(ranks)
        if began is None or now - began < cfg.window_s / 2:
            return None
        recent, total = self._held_since(now - cfg.window_s / 8)
        if sum(recent.get(r, 0.0) for r in ranks) < cfg.min_share * total:
            return None
        held, _ = self._held_since(began)
        mine = sum(held.get(r, 0.0) for r in ranks)
        rest = max(1, count - len(ranks))
        return began if mine / len(ranks) >= 4 * (sum(held.values()) - mine) / rest else None

    def _began_at(self, ranks: tuple[int, ...]) -> float | None:
        """Where ``ranks`` began holding the job up in more than ``min_share`` of the time: the
        start of the window's slice from which on their time holding it up exceeds
        ``min_share`` of the steps' time by the most (where their share rose above it), or
        None when it exceeds it from none."""
        timed = any(b.weight > 0 for b in self._window)
        excess, best, began = 0.0, 0.0, None
        for b in reversed(self._window):
            held = b.held_by(timed)
            excess += sum(held.get(r, 0) for r in ranks) - self.config.min_share * b.total(timed)
            if excess > best:
                best, began = excess, b.start
        return began

    def _long(self, ranks: tuple[int, ...] | None, share: float) -> bool:
        """``ranks`` (None: anyone) held the job up in ``share`` of the window's time, and so
        for ``share`` x ``window_s`` seconds: a slowness that began minutes ago is named as soon
        as it has held the job up that long, not only once the window has seen nothing else.
        Where no step said its time: in ``share`` of a window's steps, once one was seen."""
        if self._share(ranks) < share:
            return False
        if any(b.weight > 0 for b in self._window):
            held = sum(w for b in self._window for r, w in b.held.items()
                       if ranks is None or r in ranks)
            return held >= share * self.config.window_s
        return self._first is not None and self._window[-1].start - self._first >= \
            self.config.window_s

    def _share(self, ranks: tuple[int, ...] | None = None) -> float:
        """The share of the window's time (its steps' step times) in which ``ranks`` held the
        job up (None: anyone did: the step was slow). Time, not steps: a machine that slows
        the job makes fewer steps a minute, and counted by steps the quick ones from before it
        would outvote it for longer than ``window_s``. By steps where none said its time."""
        window = self._window
        total = sum(b.weight for b in window)
        if total > 0:
            return sum(w for b in window for r, w in b.held.items()
                       if ranks is None or r in ranks) / total
        return sum(c for b in window for r, c in b.ranks.items()
                   if ranks is None or r in ranks) / max(1, sum(b.n for b in window))

    def _weights(self, since: float = -math.inf) -> dict[int, float]:
        """How long each rank held the job up in the window's slices from ``since`` on
        (seconds of the slow steps it was the slowest of; how many of them where no step said
        its time)."""
        return self._held_since(since)[0]

    def _held_since(self, since: float) -> tuple[dict[int, float], float]:
        """``_weights(since)``, and the time of all the steps of those slices (seconds, or
        steps where no step said its time)."""
        held: dict[int, float] = {}
        total = 0.0
        timed = any(b.weight > 0 for b in self._window)
        for b in self._slices(since):
            total += b.total(timed)
            for r, w in b.held_by(timed).items():
                held[r] = held.get(r, 0.0) + w
        return held, total

    def _slices(self, since: float) -> list[_Bucket]:
        """The window's slices from ``since`` on (each that ends after it)."""
        width = self.config.window_s / BUCKETS
        return [b for b in self._window if b.start + width > since]

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
        took = step_time if step_time is not None and step_time > 0 else 0.0
        b.weight += took
        if slow:
            b.slow += 1
            b.ranks[rank] += 1
            b.held[rank] = b.held.get(rank, 0.0) + took
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

    def _finding(self, step: int, now: float, count: int, ranks: tuple[int, ...],
                 since: float, again: bool) -> Finding:
        """The finding naming ``ranks`` at ``now``, with how long they held the job up in the
        window's slices from ``since`` on (those it names them for); ``again``: the episode's
        machine, told before, still at it (the pace before is the one it was told with)."""
        window = self._window
        slices = self._slices(since)
        held_since, total = self._held_since(since)
        share = sum(held_since.get(r, 0.0) for r in ranks) / total if total else 0.0
        slow = sum(b.slow for b in slices)
        counts = self._counts()
        forward = sum(b.forward for b in slices) / slow
        median = sum(b.median for b in slices) / slow
        # The job's step time now: of the steps the named ranks held up since they began to
        # (not of the slow steps the others held up, a busy host's noise from before them).
        held_s = sum(b.held.get(r, 0.0) for b in slices for r in ranks)
        held_n = sum(b.ranks.get(r, 0) for b in slices for r in ranks)
        timed = sum(b.timed for b in slices)
        now_s = held_s / held_n if held_s > 0 and held_n else \
            sum(b.times for b in slices) / timed if timed else None
        # Where the episode began: where their share rose (the slices named for), unless that
        # is as far back as the window goes, and the marks say how much further back.
        onset = next(b.first_slow for b in slices if b.first_slow is not None)
        if again and self._episode is not None:
            began, _, base, onset = self._episode
        else:
            began = slices[0].start if slices[0] is not window[0] else self._began(ranks)
            base = self._pace_without(ranks, began - self.config.window_s / 4, began)
            if not math.isfinite(began):
                began = window[0].start
        # One machine is told again each time it has been at it twice as long: a leader weighs
        # its cost anew, against a run that has gone on (an early "keep" is not the last word).
        self._episode = None if _spread(ranks, count) else (began, 2 * now - began, base, onset)
        if now_s is not None and base is not None and now_s > 0:
            slowdown, source = max(0.0, 1.0 - base / now_s), "step times before"
        elif now_s:
            slowdown, source = min(1.0, (forward - median) / now_s), "forward excess"
        else:
            slowdown, source = None, None
        weights = self._weights()
        top = max(ranks, key=lambda r: weights.get(r, 0.0), default=counts.most_common(1)[0][0])
        span = now - slices[0].start
        return Finding(
            incident=Incident.STRAGGLER, detector=self.name, severity=Severity.WARNING,
            step=step, onset_step=onset, ranks=ranks,
            message=(f"slow {self.said[0]} at step {step}: rank {top}'s {self.said[1]} "
                     f"{forward:.3g}s vs "
                     f"median {median:.3g}s, holding the job up {share:.0%} of the last "
                     f"{span:.0f}s"
                     + (f"; the job runs {slowdown:.0%} slower for it" if slowdown else "")
                     + (f"; still, {now - began:.0f}s after it began" if again else "")
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
                      "slowdown_from": source, "again": again})

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
        """The latest pace the named ranks did not hold up, as marked last at ``before``, or
        None. When no mark is that old, the last one before the episode ``began`` stands in
        (the run's first mark is of its first steps, the slowest of all while it warms up: a
        2-minute benchmark took 73-97 ms for the pace of its 65 ms steps), or else the oldest
        mark. A mark made before the episode ``began`` with only the named ranks' pace (a noisy
        host made one of them the slowest of a few steps then) still gives that pace: it was
        the job's before they slowed it."""
        marks = [(t, paces) for t, paces, _ in self._marks if t <= before] or \
            [(t, paces) for t, paces, _ in self._marks if t < began][-1:] or \
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
                "episode": list(self._episode) if self._episode is not None else None,
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
        episode = d.get("episode")
        self._episode = (float(episode[0]), float(episode[1]), episode[2], int(episode[3])) \
            if episode is not None else None
        self._recent = deque(d.get("recent", ()), maxlen=CALM)


def _held(pairs: Any) -> Held:
    """A ``Held`` tally from its JSON form, ``[[rank or null, steps], ...]``."""
    return Counter({h: int(n) for h, n in pairs})


def _spread(ranks: tuple[int, ...], count: int) -> bool:
    """``ranks`` are more than half of the ``count`` ranks compared: no one machine."""
    return len(ranks) > max(1, count // 2)


def _dominant(held: dict[int, float]) -> tuple[int, ...]:
    """The ranks that held the job up at least a quarter as long as the rank that held it up
    longest: the slow machine's ranks (all of a slow node's share the steps), not a healthy
    rank that a busy moment made the slowest of a few steps. None when no step was slow."""
    top = max(held.values(), default=0.0)
    return tuple(sorted(rank for rank, w in held.items() if w > 0 and 4 * w >= top))
