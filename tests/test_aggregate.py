"""Merging rank reports into steps, as the intake delivers them: one rank's backlog at a time."""

from __future__ import annotations

from policies.types import RankStep
from supervisor.aggregate import StepAggregator, metrics_row


def report(rank: int, step: int, loss: float = 1.0) -> RankStep:
    return RankStep(rank=rank, step=step, time=float(step), cursor=step, loss=loss,
                    step_time=0.1, data_wait=0.01)


def test_one_ranks_backlog_before_the_others_splits_no_step() -> None:
    agg = StepAggregator(world_size=2)
    out = [rec for s in range(1, 21) for rec in agg.add(report(0, s))]
    assert out == []  # rank 0 is 20 steps "ahead" only because its queue was read first
    out = [rec for s in range(1, 21) for rec in agg.add(report(1, s))]
    assert [r.step for r in out] == list(range(1, 21))
    assert all(len(r.ranks) == 2 for r in out)


def test_dropped_reports_are_emitted_in_order_once_a_later_step_completes() -> None:
    agg = StepAggregator(world_size=2)
    agg.add(report(0, 1))
    agg.add(report(0, 2))  # rank 1's step 1 and 2 reports were dropped
    agg.add(report(0, 3))
    out = agg.add(report(1, 3))
    assert [(r.step, [x.rank for x in r.ranks]) for r in out] == [(1, [0]), (2, [0]), (3, [0, 1])]


def test_memory_stays_bounded_when_a_rank_goes_silent() -> None:
    agg = StepAggregator(world_size=2, max_pending=8)
    out = [rec for s in range(1, 30) for rec in agg.add(report(0, s))]
    assert [r.step for r in out] == list(range(1, 22))
    assert [r.step for r in agg.flush()] == list(range(22, 30))


def test_metrics_row_summarises_ranks() -> None:
    agg = StepAggregator(world_size=2)
    agg.add(report(0, 1, loss=2.0))
    (record,) = agg.add(report(1, 1, loss=4.0))
    row = metrics_row(record, attempt=3)
    assert (row["loss"], row["loss_min"], row["loss_median"], row["loss_max"]) == (3.0, 2, 3, 4)
    assert row["ranks"] == [0, 1] and row["attempt"] == 3 and row["step_time_per_rank"] == [0.1] * 2
