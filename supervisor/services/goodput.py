"""The goodput ledger: a run's wall time split into productive step time and badput by cause.

Pure: it reads journal entries (``events.jsonl`` dicts) and metrics rows (``metrics.jsonl``
dicts), fed in time order, and does no I/O. ``babysit status`` and ``babysit report`` feed it
the run directory's files (``commands.history.goodput``); the supervisor feeds it live, as it
journals and records (``run.background.Services``), for the end-of-run summary, the digest and
Prometheus. Both cover the same instants; they can differ by a tick where a metrics row and a
journal entry race (a row stamped before a finding but taken after it counts as a step in the
file's order and as detection wait live). The live ledger covers this supervisor's session
only; the file-based one the whole run directory, takeovers included.

How time is assigned. Each instant of the run belongs to exactly one category, so the
categories sum to the wall time exactly (``Ledger.seconds`` and ``wall_s``); per attempt too.
An attempt's life, in the order it happens::

    launch ─ startup/relaunch ─ first step ─ step ─ step ─ ... ─ last step ─ detection ─ finding
                (restore inside)             (checkpoint, straggler inside)          ─ relaunch ─
                                                                          (backoff inside) launch

Categories (seconds; ``CATEGORIES`` keeps this order):

``productive``
    Each metrics row closes a step interval: from the attempt's previous row to this one (the
    rank's clock at ``step()``). Productive is those intervals, less the blocking checkpoint
    saves and stragglers' excess inside them, for steps the final model still builds on. It
    includes work the script does between steps outside ``run.phase("checkpoint")`` (an eval).
``startup``
    The run's start: the supervisor starting (``run_started``) to the first attempt's first
    step reported (interpreter, ``import torch``, rendezvous, building the model, the first
    step). A run's very first attempt only; a later one's is ``relaunch``.
``checkpoint``
    Training stalled on babysit's saves: the ``blocking_s`` each ``checkpoint_saved`` entry
    reports (the whole save when synchronous, the staging copy when asynchronous), taken out of
    the step interval (or the tail) it happened in, and never more than that interval.
``restore``
    Loading the checkpoint a resumed attempt starts from: the slowest rank's ``restore_s``
    in its ``worker_hello`` (measured around the load in ``attach()``), taken out of the
    attempt's start-up. A checkpoint the script loads itself is not measured (it stays in
    ``relaunch``).
``detection``
    From the attempt's last step reported to the finding that ended it (a rollback, relaunch or
    stop remedy, or a crash): how long the fault went unnoticed. A hang's whole floor is here.
``lost``
    Progress a rollback or crash threw away: the productive time of steps that a later attempt
    re-trained because it resumed from an older checkpoint (their first execution's time).
``relaunch``
    Stopping the workers after a finding, and every later attempt from its launch to its first
    step (less ``restore``), and a new supervisor's start-up when it takes over a run.
``backoff``
    The wait the policy imposed before a relaunch (``backoff`` entries), within that gap.
``down``
    No babysitter was running: from the last thing a supervisor recorded to the next one's
    ``run_started``, when the first ended without finishing the run (killed, or stopped by a
    signal). A gap after a run that finished (succeeded or failed) is not the run's time at all.
``straggler``
    Per step, when one rank's data wait, compute (``step_time - data_wait``) or forward time
    exceeds the other ranks' median by at least 20 ms and 1.3x (the straggler detector's
    defaults), the excess, taken out of the step interval; on a multi-node leader's merged rows,
    the slowest rank's against the median of all. Under synchronous collectives a compute
    straggler makes every rank's step slow alike, so its step time says nothing: its forward
    does (``attach(model=...)``), a lower bound of what it costs (its backward's excess is not
    seen). A slow loader is measured; a slow link is not (every rank waits alike).
``shutdown``
    After the last step of an attempt that ended without a fault: the ranks closing, exiting,
    a final checkpoint; or stopped on request (SIGINT/SIGTERM).
``other``
    Whatever no rule above names: the tail of a supervisor that vanished, and, live, the step
    in progress (it becomes productive, or detection, when it ends). Kept small; shown.
"""

from __future__ import annotations

import bisect
import statistics
from array import array
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

CATEGORIES = ("productive", "startup", "checkpoint", "restore", "detection", "lost", "relaunch",
              "backoff", "down", "straggler", "shutdown", "other")
BADPUT = CATEGORIES[1:]
ENDING_ACTIONS = frozenset({"rollback", "relaunch", "stop"})
STRAGGLER_FACTOR = 1.3
STRAGGLER_MIN_EXCESS_S = 0.02

_STEP = "step"  # the pseudo-label of time inside an attempt's step interval, not yet closed


@dataclass(frozen=True)
class Goodput:
    """The ledger at one moment. ``seconds``: category -> seconds, every category present, in
    ``CATEGORIES`` order; ``attempts``: attempt number -> the same split of that attempt's
    share (an attempt's runs from its launch to the next launch: its start-up, its steps, the
    detection, stopping and backoff after it; the run's start counts for the first); both sum to
    ``wall_s``."""

    wall_s: float
    seconds: dict[str, float]
    attempts: dict[int, dict[str, float]] = field(default_factory=dict)

    @property
    def goodput(self) -> float | None:
        """Productive share of the wall time, 0..1 (None before any time passed)."""
        return self.seconds["productive"] / self.wall_s if self.wall_s > 0 else None

    def to_json(self) -> dict[str, Any]:
        """``{wall_s, goodput, seconds: {category: s}, attempts: [{attempt, wall_s, seconds}]}``
        rounded to milliseconds (``babysit status --json``'s ``goodput``)."""
        return {"wall_s": round(self.wall_s, 3),
                "goodput": round(self.goodput, 5) if self.goodput is not None else None,
                "seconds": {k: round(v, 3) for k, v in self.seconds.items()},
                "attempts": [{"attempt": a, "wall_s": round(sum(s.values()), 3),
                              "seconds": {k: round(v, 3) for k, v in s.items()}}
                             for a, s in sorted(self.attempts.items())]}

    def summary(self, top: int = 4) -> str:
        """One line: "goodput 91.2% of 3.1 min; badput: detection 8.1 s, lost 4.0 s, ..."
        (the ``top`` largest badput categories that are not zero)."""
        if self.goodput is None:
            return "goodput: no time recorded yet"
        bad = sorted(((self.seconds[k], k) for k in BADPUT if self.seconds[k] >= 0.05),
                     reverse=True)[:top]
        text = f"goodput {100 * self.goodput:.1f}% of {_short(self.wall_s)}"
        if bad:
            text += "; badput: " + ", ".join(f"{k} {_short(v)}" for v, k in bad)
        return text


def _short(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    return f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


class _Attempt:
    """One attempt's steps: their numbers and cumulative productive seconds (for ``lost``)."""

    def __init__(self, number: int, launched: float, resume_step: int) -> None:
        self.number = number
        self.launched = launched
        self.resume_step = resume_step
        self.steps = array("q")
        self.cumulative = array("d")
        self.kept_to: int | None = None  # steps above this were moved to ``lost`` already
        self.restore_s = 0.0
        self.restore_moved = 0.0
        self.pre_s = 0.0  # launch -> first step, accumulated under startup/relaunch
        self.pre_label = "relaunch"
        self.first_row = True
        self.ended = False

    def productive_above(self, step: int) -> float:
        """Productive seconds of this attempt's steps numbered above ``step`` not yet lost."""
        if not self.steps:
            return 0.0
        top = len(self.steps) if self.kept_to is None else \
            bisect.bisect_right(self.steps, self.kept_to)
        low = bisect.bisect_right(self.steps, step)
        if low >= top:
            return 0.0
        return self.cumulative[top - 1] - (self.cumulative[low - 1] if low > 0 else 0.0)


class Ledger:
    """Feed entries and rows in time order (``entry``, ``row``); read ``totals(now)`` at any
    time (O(attempts)). Memory: 16 bytes per step recorded. Not thread-safe: one feeder."""

    def __init__(self) -> None:
        self._seconds = dict.fromkeys(CATEGORIES, 0.0)
        self._by_attempt: dict[int, dict[str, float]] = {}
        self._t: float | None = None  # the instant up to which time is assigned
        self._label: str | None = None  # where time goes from ``_t`` on (None: not the run's)
        self._attempt_no = 0
        self._attempt: _Attempt | None = None
        self._attempts: dict[int, _Attempt] = {}
        self._open_step = 0.0  # seconds since the attempt's last row, not yet assigned
        self._pending_ckpt = 0.0
        self._saved: set[tuple[int, int | None]] = set()
        self._backoff_until: float | None = None
        self._session_open = False
        self._session_unfinished = False
        self._seen_start = False

    # -- feeding ------------------------------------------------------------------------------

    def entry(self, e: Mapping[str, Any]) -> None:
        """One journal entry (any; the ones that move time are used, the rest ignored)."""
        kind = e.get("event")
        t = _num(e.get("time"))
        if t is None or kind not in _HANDLED:
            return
        if kind == "run_started":
            self._run_started(t, e)
            return
        if self._label is None:
            return  # outside a session (after run_finished): nothing is the run's time
        self._advance(t)
        if kind == "launch":
            self._launch(t, e)
        elif kind == "worker_hello":
            data = e.get("data") if isinstance(e.get("data"), Mapping) else {}
            restore = _num(data.get("restore_s")) if data else None
            if self._attempt is not None and restore is not None and restore > 0:
                self._attempt.restore_s = max(self._attempt.restore_s, restore)
                if not self._attempt.first_row:
                    self._take_restore(self._attempt)  # the hello came after the first step
        elif kind == "checkpoint_saved":
            data = e.get("data") if isinstance(e.get("data"), Mapping) else {}
            step = e.get("checkpoint_step")
            key = (_int(e.get("attempt")), step if isinstance(step, int) else None)
            blocking = _num(data.get("blocking_s")) if data else None
            if key not in self._saved and blocking is not None and blocking > 0:
                self._saved.add(key)
                self._pending_ckpt += blocking
        elif kind == "finding":
            remedy = e.get("remedy") if isinstance(e.get("remedy"), Mapping) else {}
            finding = e.get("finding") if isinstance(e.get("finding"), Mapping) else {}
            if (remedy or {}).get("action") in ENDING_ACTIONS or \
                    (finding or {}).get("incident") == "crash":
                self._end_attempt("detection", then="relaunch")
        elif kind == "backoff":
            seconds = _num(e.get("seconds"))
            if seconds is not None and seconds > 0:
                self._end_attempt("detection", then="relaunch")
                self._label, self._backoff_until = "backoff", t + seconds
        elif kind == "stop_workers" or (kind == "state" and e.get("new") in _FINAL_STATES):
            self._end_attempt("shutdown", then="shutdown")
        elif kind == "run_finished":
            self._end_attempt("shutdown", then="shutdown")
            self._close_session(finished=e.get("state") != "stopped")

    def row(self, r: Mapping[str, Any]) -> None:
        """One metrics row (``step``, ``time``, ``attempt``; per-rank step times and data waits
        when the row has them)."""
        t, step = _num(r.get("time")), r.get("step")
        a = self._attempt
        if t is None or not isinstance(step, int) or self._label is None or a is None or \
                a.ended or _int(r.get("attempt"), a.number) != a.number:
            return  # a late row of an attempt already judged, or outside a session
        self._advance(t)
        if a.first_row:
            # Launch -> first step is start-up; the checkpoint load inside it is ``restore``.
            a.first_row = False
            self._take_restore(a)
            self._open_step = 0.0
        else:
            interval = self._open_step
            ckpt = min(self._pending_ckpt, interval)
            slow = min(straggler_excess(r), interval - ckpt)
            self._add("checkpoint", ckpt, a.number)
            self._add("straggler", slow, a.number)
            productive = interval - ckpt - slow
            self._add("productive", productive, a.number)
            self._pending_ckpt = 0.0
            a.steps.append(step)
            a.cumulative.append((a.cumulative[-1] if a.cumulative else 0.0) + productive)
            self._open_step = 0.0
        self._label = _STEP

    # -- reading --------------------------------------------------------------------------------

    def totals(self, now: float | None = None) -> Goodput:
        """The ledger so far; with ``now`` (live), the time since the last thing fed counts
        too: under its category, or ``other`` inside a step still running."""
        seconds = dict(self._seconds)
        attempts = {a: dict(s) for a, s in self._by_attempt.items()}
        pending = self._open_step
        live = 0.0
        if now is not None and self._t is not None and self._label is not None:
            live = max(0.0, now - self._t)
        extra: dict[str, float] = {}
        if pending or (live and self._label == _STEP):
            extra["other"] = pending + (live if self._label == _STEP else 0.0)
        if live and self._label not in (None, _STEP):
            label = self._label
            if label == "backoff" and self._backoff_until is not None and self._t is not None:
                inside = max(0.0, min(live, self._backoff_until - self._t))
                extra["backoff"] = inside
                extra["relaunch"] = extra.get("relaunch", 0.0) + live - inside
            else:
                assert label is not None
                extra[label] = extra.get(label, 0.0) + live
        for k, v in extra.items():
            seconds[k] += v
            share = attempts.setdefault(self._attempt_no, dict.fromkeys(CATEGORIES, 0.0))
            share[k] += v
        return Goodput(sum(seconds.values()), seconds, attempts)

    # -- the rules ------------------------------------------------------------------------------

    def _run_started(self, t: float, e: Mapping[str, Any]) -> None:
        if self._session_open and self._t is not None:
            # The previous supervisor vanished: its tail is unknown, then nobody watched.
            self._advance(self._t)
            self._end_attempt("other", then="other")
            self._label = "down"
        elif self._seen_start and self._session_unfinished and self._t is not None:
            self._label = "down"  # it ended by a signal: stopped, not finished
        else:
            self._t = t  # a new run, or the first: a gap after a finished run is not the run's
        self._advance(t)
        self._attempt_no = _int(e.get("attempt"), self._attempt_no)
        self._label = "relaunch" if self._seen_start else "startup"
        self._seen_start = self._session_open = True

    def _launch(self, t: float, e: Mapping[str, Any]) -> None:
        directive = e.get("directive") if isinstance(e.get("directive"), Mapping) else {}
        resume = (directive or {}).get("resume")
        if isinstance(resume, Mapping):
            resume_step = resume.get("step")  # the directive's own schema
        else:  # stdout mode: the script's own checkpoint, put back
            script = e.get("script_resume")
            resume_step = script.get("checkpoint_step") if isinstance(script, Mapping) else None
        resume_step = resume_step if isinstance(resume_step, int) else 0
        number = _int((directive or {}).get("attempt"), _int(e.get("attempt"), 0))
        if self._attempt is not None and not self._attempt.ended:
            self._end_attempt("other", then="relaunch")
        # Steps of earlier attempts above the resume point are re-trained: that progress is lost.
        for old in self._attempts.values():
            moved = old.productive_above(resume_step)
            if moved:
                self._move("productive", "lost", moved, old.number)
            if old.kept_to is None or old.kept_to > resume_step:
                old.kept_to = resume_step
        first = not self._attempts
        a = _Attempt(number, t, resume_step)
        a.pre_label = "startup" if first and self._label == "startup" else "relaunch"
        self._attempts[number] = self._attempt = a
        self._attempt_no = number
        self._label = a.pre_label
        self._backoff_until = None
        self._pending_ckpt = 0.0

    def _take_restore(self, a: _Attempt) -> None:
        """Move the attempt's checkpoint load out of its start-up, as far as known yet (a
        rank's hello can be taken after the first step it sent)."""
        moved = min(a.restore_s, a.pre_s) - a.restore_moved
        if moved > 0:
            self._move(a.pre_label, "restore", moved, a.number)
            a.restore_moved += moved

    def _end_attempt(self, tail: str, then: str) -> None:
        """The running attempt ended now: the time since its last step goes to ``tail``
        (detection for a fault), and from now on time goes to ``then``."""
        a = self._attempt
        if a is None or a.ended:
            if self._label == _STEP:
                self._label = then
            return
        a.ended = True
        if self._label == _STEP:
            ckpt = min(self._pending_ckpt, self._open_step)
            self._add("checkpoint", ckpt, a.number)
            self._add(tail, self._open_step - ckpt, a.number)
        self._open_step, self._pending_ckpt = 0.0, 0.0
        self._label = then

    def _close_session(self, finished: bool) -> None:
        self._session_open = False
        self._session_unfinished = not finished
        self._label = None

    def _advance(self, t: float) -> None:
        """Assign [``_t``, ``t``) to the current label. Time never runs backwards here: an
        input stamped before ``_t`` (clocks of different machines, a late row) adds nothing."""
        if self._t is None:
            self._t = t
            return
        dt = t - self._t
        if dt <= 0:
            return
        label = self._label
        if label == _STEP:
            self._open_step += dt
        elif label == "backoff" and self._backoff_until is not None:
            inside = max(0.0, min(dt, self._backoff_until - self._t))
            self._add("backoff", inside, self._attempt_no)
            self._add("relaunch", dt - inside, self._attempt_no)
        elif label is not None:
            self._add(label, dt, self._attempt_no)
            if label in ("startup", "relaunch") and self._attempt is not None and \
                    self._attempt.first_row and not self._attempt.ended:
                self._attempt.pre_s += dt
        self._t = t

    def _add(self, category: str, seconds: float, attempt: int) -> None:
        if seconds <= 0:
            return
        self._seconds[category] += seconds
        share = self._by_attempt.setdefault(attempt, dict.fromkeys(CATEGORIES, 0.0))
        share[category] += seconds

    def _move(self, source: str, target: str, seconds: float, attempt: int) -> None:
        if seconds <= 0:
            return
        self._seconds[source] -= seconds
        self._by_attempt.setdefault(attempt, dict.fromkeys(CATEGORIES, 0.0))[source] -= seconds
        self._add(target, seconds, attempt)


_HANDLED = frozenset({"run_started", "launch", "worker_hello", "checkpoint_saved", "finding",
                      "backoff", "stop_workers", "state", "run_finished"})
_FINAL_STATES = frozenset({"succeeded", "failed", "stopped"})


def straggler_excess(r: Mapping[str, Any]) -> float:
    """Seconds one rank held the step up, from a metrics row: the largest excess of a rank's
    data wait, compute or forward time over the other ranks' median (per-rank lists), or of the
    slowest rank's over the median of all (the summaries of merged and very large worlds' rows),
    when it is at least ``STRAGGLER_MIN_EXCESS_S`` and ``STRAGGLER_FACTOR`` x that median."""
    waits = _floats(r.get("data_wait_per_rank"))
    times = _floats(r.get("step_time_per_rank"))
    lists = [waits, _floats(r.get("forward_time_per_rank"))]
    if times is not None and waits is not None and len(times) == len(waits):
        lists.append([max(0.0, s - w) for s, w in zip(times, waits, strict=True)])
    pairs = [(v, statistics.median(values[:i] + values[i + 1:]))
             for values in lists if values is not None and len(values) >= 2
             for i, v in enumerate(values)]
    for name in ("data_wait", "compute", "forward"):
        top, median = r.get(f"{name}_max"), r.get(f"{name}_p50")
        if isinstance(top, int | float) and isinstance(median, int | float):
            pairs.append((float(top), float(median)))
    return max((v - peers for v, peers in pairs
                if v - peers >= STRAGGLER_MIN_EXCESS_S and v >= STRAGGLER_FACTOR * peers),
               default=0.0)


def ledger(entries: Iterable[Mapping[str, Any]], rows: Iterable[Mapping[str, Any]],
           now: float | None = None) -> Goodput:
    """The ledger of a run from its journal entries and metrics rows (each in file order),
    merged by time. ``now``: count a live run's time up to now."""
    led = Ledger()
    for kind, item in merge(entries, rows):
        if kind == "entry":
            led.entry(item)
        else:
            led.row(item)
    return led.totals(now)


def merge(entries: Iterable[Mapping[str, Any]], rows: Iterable[Mapping[str, Any]]
          ) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """Entries and rows in one time order (a row first on a tie: an entry stamped with the same
    instant is about that step or after it). Each input is assumed time-ordered, as the
    supervisor writes them."""
    import heapq

    def keyed(kind: str, rank: int, items: Iterable[Mapping[str, Any]]
              ) -> Iterator[tuple[float, int, int, str, Mapping[str, Any]]]:
        for i, item in enumerate(items):
            t = _num(item.get("time"))
            if t is not None:
                yield t, rank, i, kind, item

    for _, _, _, kind, item in heapq.merge(keyed("entry", 1, entries), keyed("row", 0, rows)):
        yield kind, item


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    v = float(value)
    return v if v == v and v not in (float("inf"), float("-inf")) else None


def _int(value: Any, default: int = 0) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _floats(value: Any) -> list[float] | None:
    if not isinstance(value, list):
        return None
    out = [_num(v) for v in value]
    return None if any(v is None for v in out) else [v for v in out if v is not None]
