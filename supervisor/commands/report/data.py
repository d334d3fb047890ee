"""The report's inputs: a run's journal digest plus every metrics row, as numpy columns per attempt.

Missing values are NaN in the value columns; a value the workers *reported* as non-finite is also
flagged in a ``*_bad`` mask, so the plots can tell "not reported" (draw nothing) from "NaN loss"
(draw a marker).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from babysit.supervisor.commands.history import History
from babysit.supervisor.commands.metrics_file import METRICS, parse_metrics_line, to_float

SAMPLE_ROWS = 60_000
"""Files with more rows are thinned while reading: every k-th row, plus every row with a
non-finite value and the rows on both sides of an attempt change. 60,000 points are still
several per pixel column of a figure, and a million-row file is then read in seconds, not a
minute (json.loads is the cost)."""
_ATTEMPT = re.compile(rb'"attempt":\s*(-?\d+)')
_NONFINITE = (b'"nan"', b'"inf"', b'"-inf"')

Floats = npt.NDArray[np.float64]
Bools = npt.NDArray[np.bool_]


@dataclass
class Curve:
    """One attempt's metrics rows as columns (all the same length, in file order)."""

    attempt: int
    step: Floats
    time: Floats
    cursor: Floats
    loss: Floats
    loss_bad: Bools
    grad_norm: Floats
    grad_bad: Bools
    lr: Floats
    tokens: Floats
    tokens_per_s: Floats
    """Job-wide tokens per second of the step; NaN where not reported."""
    mfu: Floats
    """Model FLOPs utilisation, a fraction 0..1; NaN where not reported."""
    loss_min: Floats
    """The per-rank loss summary (finite losses only); NaN where not reported."""
    loss_median: Floats
    loss_max: Floats
    step_time_p50: Floats
    """Step-time quantiles over ranks (s): the rows of large worlds carry these instead of
    per-rank lists. NaN where not reported."""
    step_time_p99: Floats
    step_time_max: Floats
    step_time_max_rank: Floats
    """The slowest rank of the step (a float column so that NaN can say "not reported")."""

    def has(self, key: str) -> bool:
        """Whether column ``key`` holds any finite value."""
        return bool(np.isfinite(getattr(self, key)).any())


@dataclass
class RankTimes:
    """One rank's step times over the whole run: ``time`` (Unix s) and ``step_time`` (s)."""

    time: list[float] = field(default_factory=list)
    step_time: list[float] = field(default_factory=list)
    attempt: list[int] = field(default_factory=list)


@dataclass
class RunData:
    """Everything the plots and the HTML need. Build with ``RunData.load``."""

    history: History
    curves: list[Curve]
    ranks: dict[int, RankTimes]
    rows: int
    t0: float
    """Time origin of the time axes: the run's start (or its first record)."""

    @classmethod
    def load(cls, run_dir: Path) -> RunData:
        """Read the journal and the whole metrics file. Raises ``status.NotARunDir``."""
        history = History.read(run_dir)
        by_attempt: dict[int, list[dict[str, Any]]] = {}
        ranks: dict[int, RankTimes] = {}
        rows, lines = _sample(run_dir / METRICS)
        for line in lines:
            row = parse_metrics_line(line)
            if row is None:
                continue
            attempt = row.get("attempt")
            by_attempt.setdefault(attempt if isinstance(attempt, int) else -1, []).append(row)
            _add_rank_times(ranks, row, attempt if isinstance(attempt, int) else -1)
        curves = [_curve(a, rs) for a, rs in sorted(by_attempt.items())]
        starts = [t for t in [history.started, *(c.time[0] for c in curves if len(c.time))]
                  if t is not None and math.isfinite(t)]
        return cls(history, curves, dict(sorted(ranks.items())), rows, min(starts, default=0.0))

    def step_of_cursor(self, start: int, end: int,
                       before_attempt: int) -> tuple[float, float] | None:
        """The step span that trained on cursors ``[start, end)`` in attempts before
        ``before_attempt`` (the data a skip range later threw away), or None if none did."""
        spans = []
        for c in self.curves:
            if c.attempt >= before_attempt:
                continue
            batch = c.cursor - 1  # a row's cursor counts the batch it trained on
            inside = (batch >= start) & (batch < end)
            if inside.any():
                spans.append((float(c.step[inside].min()), float(c.step[inside].max())))
        if not spans:
            return None
        return min(s for s, _ in spans), max(e for _, e in spans)

    def skip_jump(self, start: int, end: int, attempt: int) -> float | None:
        """The step at which ``attempt`` jumped over cursors ``[start, end)``, if it did."""
        for c in self.curves:
            if c.attempt != attempt or len(c.cursor) < 2:
                continue
            before, after = c.cursor[:-1] - 1, c.cursor[1:] - 1  # batch indices, as above
            jumped = np.nonzero((before < start) & (after >= end))[0]
            if len(jumped):
                return float(c.step[jumped[0] + 1])
        return None


def _sample(path: Path) -> tuple[int, list[bytes]]:
    """(rows in the file, the lines to parse): all of them, or a sample (see SAMPLE_ROWS)."""
    try:
        with open(path, "rb") as f:
            total = sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
            f.seek(0)
            if total <= SAMPLE_ROWS:
                return total, f.read().split(b"\n")
            every = math.ceil(total / SAMPLE_ROWS)
            kept: list[bytes] = []
            previous, previous_attempt, nonfinite = b"", b"", 0
            for i, line in enumerate(f):
                match = _ATTEMPT.search(line)
                attempt = match.group(1) if match else b""
                keep = i % every == 0 or attempt != previous_attempt
                if attempt != previous_attempt and previous and kept[-1:] != [previous]:
                    kept.append(previous)  # the last row of the attempt that just ended
                if not keep and nonfinite < SAMPLE_ROWS and any(x in line for x in _NONFINITE):
                    keep, nonfinite = True, nonfinite + 1
                if keep:
                    kept.append(line)
                previous, previous_attempt = line, attempt
            if previous and kept[-1:] != [previous]:
                kept.append(previous)
            return total, kept
    except FileNotFoundError:
        return 0, []


def _column(rows: list[dict[str, Any]], key: str) -> tuple[Floats, Bools]:
    values = np.full(len(rows), np.nan)
    bad = np.zeros(len(rows), dtype=bool)
    for i, row in enumerate(rows):
        # "nan"/"inf" strings of keys that status.parse_metrics_line leaves alone (quantiles).
        v = to_float(row.get(key))
        if v is not None:
            values[i] = v
            bad[i] = not math.isfinite(v)
    values[bad] = np.nan
    return values, bad


def _merge(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows sorted by step, with rows of one step merged the way ``StepRecord`` merges ranks.

    The aggregator can write one step as several partial rows (ranks that reported late), and
    out of order; a curve drawn from them as written would zigzag and loop back.
    """
    by_step: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        by_step.setdefault(row["step"], []).append(row)
    merged = []
    for step in sorted(by_step):
        group = by_step[step]
        if len(group) == 1:
            merged.append(group[0])
            continue
        # Quantiles and rates cannot be combined from parts: take them from the row that covers
        # the most ranks; extremes combine exactly.
        widest = max(group, key=_rank_count)
        row = {**{k: widest.get(k) for k in _FROM_WIDEST},
               "step": step, "time": max(_finite(group, "time"), default=None),
               "cursor": max(_finite(group, "cursor"), default=None),
               "lr": next(iter(_nums(group, "lr")), None),
               "grad_norm": _worst(_nums(group, "grad_norm"), max),
               "tokens": sum(_nums(group, "tokens")) if _nums(group, "tokens") else None,
               "loss_min": min(_finite(group, "loss_min"), default=None),
               "loss_max": max(_finite(group, "loss_max"), default=None)}
        slowest = [r for r in group if _finite([r], "step_time_max")]
        if slowest:
            top = max(slowest, key=lambda r: _finite([r], "step_time_max")[0])
            row["step_time_max"] = top["step_time_max"]
            row["step_time_max_rank"] = top.get("step_time_max_rank")
        weighted = [(r["loss"], _rank_count(r)) for r in group
                    if isinstance(r.get("loss"), float)]
        if weighted:
            row["loss"] = sum(v * n for v, n in weighted) / sum(n for _, n in weighted)
        merged.append(row)
    return merged


_FROM_WIDEST = ("tokens_per_s", "mfu", "loss_median", "step_time_p50", "step_time_p99")


def _rank_count(row: dict[str, Any]) -> int:
    """How many ranks a row covers: its ``ranks`` list, or ``n_ranks`` (large worlds)."""
    if isinstance(row.get("ranks"), list):
        return max(1, len(row["ranks"]))
    n = row.get("n_ranks")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1


def _nums(rows: list[dict[str, Any]], key: str) -> list[float]:
    return [v for r in rows if (v := to_float(r.get(key))) is not None]


def _finite(rows: list[dict[str, Any]], key: str) -> list[float]:
    return [v for v in _nums(rows, key) if math.isfinite(v)]


def _worst(values: list[float], pick: Any) -> float | None:
    if not values:
        return None
    return math.nan if any(not math.isfinite(v) for v in values) else float(pick(values))


def _curve(attempt: int, rows: list[dict[str, Any]]) -> Curve:
    rows = _merge(rows)
    loss, loss_bad = _column(rows, "loss")
    grad, grad_bad = _column(rows, "grad_norm")

    def col(key: str) -> Floats:
        return _column(rows, key)[0]

    return Curve(attempt, col("step"), col("time"), col("cursor"), loss, loss_bad, grad, grad_bad,
                 col("lr"), col("tokens"), col("tokens_per_s"), col("mfu"), col("loss_min"),
                 col("loss_median"), col("loss_max"), col("step_time_p50"), col("step_time_p99"),
                 col("step_time_max"), col("step_time_max_rank"))


def _add_rank_times(ranks: dict[int, RankTimes], row: dict[str, Any], attempt: int) -> None:
    t, ids, times = row.get("time"), row.get("ranks"), row.get("step_time_per_rank")
    if not isinstance(t, (int, float)) or not isinstance(ids, list) or not isinstance(times, list):
        return
    for rank, st in zip(ids, times, strict=False):
        if isinstance(rank, int) and isinstance(st, float) and math.isfinite(st):
            rt = ranks.setdefault(rank, RankTimes())
            rt.time.append(float(t))
            rt.step_time.append(st)
            rt.attempt.append(attempt)
