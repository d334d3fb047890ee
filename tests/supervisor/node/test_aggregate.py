"""Merging rank reports into steps, as the intake delivers them: one rank's backlog at a time."""

from __future__ import annotations

from babysit.policies.types import RankStep
from babysit.supervisor.node.aggregate import StepAggregator, metrics_row


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


def test_metrics_row_names_the_ranks_of_the_loss_extremes() -> None:
    agg = StepAggregator(world_size=3)
    out = [rec for r, loss in enumerate((2.0, 9.0, 1.0)) for rec in agg.add(report(r, 1, loss))]
    row = metrics_row(out[0], attempt=0)
    assert (row["loss_min_rank"], row["loss_max_rank"], row["loss_median"]) == (2, 1, 2.0)


def test_large_worlds_write_quantiles_not_per_rank_lists() -> None:
    world = 200
    agg = StepAggregator(world_size=world)
    out = [rec for r in range(world)
           for rec in agg.add(RankStep(rank=r, step=1, time=1.0, cursor=1, loss=1.0 + r / 1000,
                                       step_time=0.5 + (0.3 if r == 77 else 0.0),
                                       data_wait=0.01))]
    row = metrics_row(out[0], attempt=0)
    assert "loss_per_rank" not in row and "step_time_per_rank" not in row
    assert row["step_time_max_rank"] == 77 and row["loss_max_rank"] == world - 1
    assert row["n_ranks"] == world
    small = metrics_row(out[0], attempt=0, per_rank_limit=world)  # at the limit: lists
    assert len(small["loss_per_rank"]) == world


def test_mfu_needs_every_input_and_is_never_invented() -> None:
    def step(tokens: float | None) -> RankStep:
        return RankStep(rank=0, step=2, time=2.0, cursor=2, loss=1.0, tokens=tokens,
                        step_time=0.5, data_wait=0.0)

    agg = StepAggregator(world_size=1)
    [plain] = agg.add(step(None))
    assert "tokens_per_s" not in metrics_row(plain, 0) and "mfu" not in metrics_row(plain, 0)
    [tokens_only] = agg.add(step(1000.0))
    row = metrics_row(tokens_only, 0)
    assert row["tokens_per_s"] == 2000.0 and "mfu" not in row
    agg.flops_per_token, agg.peak_flops = 6e6, 1e11
    [full] = agg.add(step(1000.0))
    assert metrics_row(full, 0)["mfu"] == 2000.0 * 6e6 / 1e11
