"""Merging rank reports into steps, and the per-step metrics row written to ``metrics.jsonl``.

Pure logic: the control loop feeds ``RankStep``s in arrival order and gets ``StepRecord``s back
once every rank has reported a step, or once a step is so far behind the newest one that its
missing reports were surely dropped.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from policies.types import RankStep, StepRecord


class StepAggregator:
    """Collects each step's reports until all ``world_size`` ranks are in.

    ``max_lag``: a step still incomplete when a report ``max_lag`` steps newer arrives is emitted
    with the ranks it has (datagrams may be dropped by design).
    """

    def __init__(self, world_size: int, max_lag: int = 8) -> None:
        self.world_size = world_size
        self.max_lag = max_lag
        self._pending: dict[int, dict[int, RankStep]] = {}
        self._newest = -1

    def add(self, sample: RankStep) -> list[StepRecord]:
        ranks = self._pending.setdefault(sample.step, {})
        ranks[sample.rank] = sample
        self._newest = max(self._newest, sample.step)
        done = [s for s, r in self._pending.items()
                if len(r) >= self.world_size or s <= self._newest - self.max_lag]
        return [self._emit(s) for s in sorted(done)]

    def flush(self) -> list[StepRecord]:
        """Emit everything pending (the attempt ended)."""
        return [self._emit(s) for s in sorted(self._pending)]

    def reset(self) -> None:
        """Forget pending steps (a new attempt starts; a rollback may reuse step numbers)."""
        self._pending.clear()
        self._newest = -1

    def _emit(self, step: int) -> StepRecord:
        ranks = self._pending.pop(step)
        ordered = tuple(ranks[r] for r in sorted(ranks))
        return StepRecord(step=step, time=max(r.time for r in ordered), ranks=ordered,
                          world_size=self.world_size)


def metrics_row(record: StepRecord, attempt: int) -> dict[str, Any]:
    """One ``metrics.jsonl`` line: the step's summary plus per-rank values, ordered by rank."""
    row: dict[str, Any] = {
        "step": record.step,
        "time": round(record.time, 6),
        "attempt": attempt,
        "cursor": record.cursor,
        "ranks": [r.rank for r in record.ranks],
    }
    losses = [r.loss for r in record.ranks if r.loss is not None]
    if losses:
        row["loss"] = record.loss
        finite = [v for v in losses if math.isfinite(v)]
        if finite:
            row["loss_min"] = min(finite)
            row["loss_median"] = statistics.median(finite)
            row["loss_max"] = max(finite)
        row["loss_per_rank"] = losses
    if record.grad_norm is not None:
        row["grad_norm"] = record.grad_norm
    lrs = [r.lr for r in record.ranks if r.lr is not None]
    if lrs:
        row["lr"] = lrs[0]
    if record.tokens is not None:
        row["tokens"] = record.tokens
    times = [r.step_time for r in record.ranks]
    if any(t is not None for t in times):
        row["step_time"] = record.step_time
        row["step_time_per_rank"] = times
        row["data_wait_per_rank"] = [r.data_wait for r in record.ranks]
    if any(r.skipped for r in record.ranks):
        row["skipped"] = True
    return row
