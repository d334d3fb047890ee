"""``metrics.jsonl``, read: rows with their floats revived, the file's tail read backwards, and the
rates the status and the report show.

The supervisor writes one row per merged step (``babysit.supervisor.node.aggregate.metrics_row``);
non-finite floats are the strings ``"nan"``/``"inf"`` (``journal.json_safe``), revived here.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

METRICS = "metrics.jsonl"
TAIL_ROWS = 50
# Metrics keys whose values may be written as "nan"/"inf" strings (see journal.json_safe).
_FLOAT_KEYS = ("loss", "loss_min", "loss_median", "loss_max", "grad_norm", "lr", "tokens",
               "step_time", "tokens_per_s", "mfu")
_LIST_KEYS = ("loss_per_rank", "step_time_per_rank", "data_wait_per_rank", "forward_time_per_rank")


def to_float(value: Any) -> float | None:
    """A metrics or journal number as a float: "nan"/"inf" strings revived, anything else None."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def finite_float(value: Any) -> float | None:
    """``to_float``, and None for NaN and infinities too."""
    v = to_float(value)
    return v if v is not None and math.isfinite(v) else None


def parse_metrics_line(line: str | bytes) -> dict[str, Any] | None:
    """One ``metrics.jsonl`` line with floats revived, or None for a torn or foreign line."""
    try:
        row = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(row, dict) or not isinstance(row.get("step"), int):
        return None
    for key in _FLOAT_KEYS:
        if key in row:
            row[key] = to_float(row[key])
    for key in _LIST_KEYS:
        if isinstance(row.get(key), list):
            row[key] = [to_float(v) for v in row[key]]
    return row


def read_metrics_tail(path: Path, rows: int = TAIL_ROWS,
                      block: int = 1 << 16) -> list[dict[str, Any]]:
    """The last ``rows`` parseable rows of a metrics file, oldest first; [] if it is missing.

    Reads backwards from the end in ``block``-byte chunks: cost is independent of the file's size.
    """
    try:
        f = open(path, "rb")  # noqa: SIM115 (closed below; the seek loop reads better unnested)
    except FileNotFoundError:
        return []
    with f:
        pos = f.seek(0, os.SEEK_END)
        buf = b""
        # rows + 2 newlines: the first chunk line may be partial and the last may be torn.
        while pos > 0 and buf.count(b"\n") < rows + 2:
            size = min(block, pos)
            pos -= size
            f.seek(pos)
            buf = f.read(size) + buf
    lines = buf.split(b"\n")
    if pos > 0:
        lines = lines[1:]  # starts mid-line
    parsed = [r for r in (parse_metrics_line(x) for x in lines if x.strip()) if r is not None]
    return parsed[-rows:]


def read_metrics(path: Path) -> Iterable[dict[str, Any]]:
    """Every parseable metrics row in file order (the report's full read)."""
    try:
        with open(path, "rb") as f:
            for line in f:
                row = parse_metrics_line(line)
                if row is not None:
                    yield row
    except FileNotFoundError:
        return


def rates(rows: list[dict[str, Any]]) -> tuple[float | None, float | None]:
    """Steps/s and tokens/s over ``rows`` of the newest attempt among them (None: too few)."""
    if not rows:
        return None, None
    same = [r for r in rows if r.get("attempt") == rows[-1].get("attempt")]
    t0, t1 = finite_float(same[0].get("time")), finite_float(same[-1].get("time"))
    if len(same) < 2 or t0 is None or t1 is None or t1 <= t0:
        return None, None
    steps = (same[-1]["step"] - same[0]["step"]) / (t1 - t0)
    tokens = [r.get("tokens") for r in same[1:]]
    per_s = None
    if all(isinstance(t, float) and math.isfinite(t) for t in tokens):
        per_s = sum(t for t in tokens if t is not None) / (t1 - t0)
    return steps, per_s


def median_mfu(rows: list[dict[str, Any]]) -> float | None:
    """Median MFU over ``rows`` of the newest attempt among them (None when none reported)."""
    if not rows:
        return None
    values = sorted(v for r in rows if r.get("attempt") == rows[-1].get("attempt")
                    and (v := finite_float(r.get("mfu"))) is not None)
    return values[len(values) // 2] if values else None


def row_loss_spread(row: dict[str, Any] | None) -> dict[str, Any] | None:
    """The per-rank loss summary of one metrics row (as ``rank_departure.loss_spread`` made
    it): the rank whose loss departs shows as the min or max rank, far from the median."""
    if not row or finite_float(row.get("loss_median")) is None:
        return None
    return {"min": finite_float(row.get("loss_min")), "min_rank": row.get("loss_min_rank"),
            "median": finite_float(row.get("loss_median")),
            "max": finite_float(row.get("loss_max")), "max_rank": row.get("loss_max_rank")}
