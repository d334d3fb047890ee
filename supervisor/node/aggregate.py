"""Merging rank reports into steps, and the per-step metrics row written to ``metrics.jsonl``.

Pure logic: the control loop feeds ``RankStep``s in arrival order and gets ``StepRecord``s back
in step order, once every rank has reported a step (or a later one: ``completion.Completion``).

Two shapes of a step share that emission rule:

- ``StepAggregator`` keeps every rank's report of a step in flight and emits a ``StepRecord``:
  the detectors that name a rank (straggler, rank departure, non-finite) need each rank's value.
  A step is in flight for about one tick, so this costs ``world_size`` reports per step in
  flight (about 1.2 MiB a step at 8,192 ranks), never a history.
- ``sketch.SummaryAggregator`` keeps a constant-size ``StepSummary`` instead: what a node sends
  a leader, mergeable across nodes.

The metrics row is what grows with the run, so above ``PER_RANK_LIMIT`` ranks it carries
quantiles and the ranks of the extremes (``StepSummary.to_row``) instead of per-rank lists: 0.8
KiB a step instead of 508 KiB at 8,192 ranks (``docs/scale.md``).
"""

from __future__ import annotations

from typing import Any

from babysit.policies.detectors.rank_departure import loss_spread
from babysit.policies.types import JobStep, RankStep, StepRecord
from babysit.supervisor.node.completion import Completion
from babysit.supervisor.node.sketch import StepSummary

PER_RANK_LIMIT = 64
"""Largest world whose metrics rows list every rank's values; larger worlds get quantiles."""


class StepAggregator(Completion[dict[int, RankStep], StepRecord]):
    """Emits a ``StepRecord`` holding every reporting rank's ``RankStep``, ordered by rank.

    ``flops_per_token`` and ``peak_flops`` (per device), when the ranks said them at hello, are
    carried on every record so MFU is computed where tokens and step time meet.
    """

    def __init__(self, world_size: int, max_pending: int = 1024) -> None:
        super().__init__(world_size, max_pending)
        self.flops_per_token: float | None = None
        self.peak_flops: float | None = None

    def _open(self, step: int) -> dict[int, RankStep]:
        return {}

    def _add(self, bucket: dict[int, RankStep], sample: RankStep) -> None:
        bucket[sample.rank] = sample

    def _count(self, bucket: dict[int, RankStep]) -> int:
        return len(bucket)

    def _close(self, step: int, bucket: dict[int, RankStep]) -> StepRecord:
        ordered = tuple(bucket[r] for r in sorted(bucket))
        return StepRecord(step=step, time=max(r.time for r in ordered), ranks=ordered,
                          world_size=self.world_size, flops_per_token=self.flops_per_token,
                          peak_flops=self.peak_flops)


def metrics_row(record: StepRecord, attempt: int,
                per_rank_limit: int = PER_RANK_LIMIT) -> dict[str, Any]:
    """One ``metrics.jsonl`` line: the step's summary, plus per-rank values ordered by rank for
    worlds up to ``per_rank_limit`` ranks, quantiles and extreme ranks above it."""
    if record.world_size > per_rank_limit:
        row = StepSummary.of(record.step, record.world_size, record.ranks).to_row(attempt)
    else:
        row = _per_rank_row(record, attempt)
    return with_rates(row, record)


def with_rates(row: dict[str, Any], step: JobStep) -> dict[str, Any]:
    """``row`` with the job's ``tokens_per_s`` and ``mfu`` where ``step`` has them, and on a
    multi-node leader the slowest follower link's round trip (``link_rtt_max``, its node's
    lowest rank ``link_rtt_max_rank``) and the followers' median (``link_rtt_median``)."""
    for key in ("tokens_per_s", "mfu"):
        value = getattr(step, key)
        if value is not None:
            row[key] = value
    link = step.slowest_link
    if link is not None:
        row.update(link_rtt_max=link.value, link_rtt_max_rank=link.rank,
                   link_rtt_median=link.median)
    return row


def _per_rank_row(record: StepRecord, attempt: int) -> dict[str, Any]:
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
        spread = loss_spread(record)
        if spread is not None:
            row.update({f"loss_{key}": value for key, value in spread.items()})
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
    if any(r.forward_time is not None for r in record.ranks):
        row["forward_time_per_rank"] = [r.forward_time for r in record.ranks]
    if any(r.skipped for r in record.ranks):
        row["skipped"] = True
    return row
