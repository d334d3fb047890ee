"""Merging rank reports into steps, and the per-step metrics row written to ``metrics.jsonl``.

Pure logic: the control loop feeds ``RankStep``s in arrival order and gets ``StepRecord``s back
in step order, once every rank has reported a step (or a later one: see ``StepAggregator``).
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from policies.types import RankStep, StepRecord


class StepAggregator:
    """Collects each step's reports until all ``world_size`` ranks are in.

    Each rank's reports arrive in order on its own connection, so once every rank has reported
    step *s*, a pending step before *s* will never get more reports (they were dropped): it is
    emitted then, with the ranks it has, in step order. The intake drains one rank's connection
    after another, so a lag rule ("emit when a report N steps newer arrives") would split steps
    whenever one rank's backlog is read before the others'. ``max_pending`` only bounds memory
    when a rank stops reporting while the others go on.
    """

    def __init__(self, world_size: int, max_pending: int = 1024) -> None:
        self.world_size = world_size
        self.max_pending = max_pending
        self._pending: dict[int, dict[int, RankStep]] = {}

    def add(self, sample: RankStep) -> list[StepRecord]:
        ranks = self._pending.setdefault(sample.step, {})
        ranks[sample.rank] = sample
        if len(ranks) >= self.world_size:
            return [self._emit(s) for s in sorted(self._pending) if s <= sample.step]
        if len(self._pending) > self.max_pending:
            return [self._emit(min(self._pending))]
        return []

    def flush(self) -> list[StepRecord]:
        """Emit everything pending (the attempt ended)."""
        return [self._emit(s) for s in sorted(self._pending)]

    def reset(self) -> None:
        """Forget pending steps (a new attempt starts; a rollback may reuse step numbers)."""
        self._pending.clear()

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
