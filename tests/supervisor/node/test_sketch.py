"""The quantile sketch and the mergeable step statistics: accuracy, merging, bounded memory."""

from __future__ import annotations

import json
import math
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from babysit.policies.types import RankStep
from babysit.supervisor.node.aggregate import StepAggregator, metrics_row
from babysit.supervisor.node.quantiles import QuantileSketch
from babysit.supervisor.node.sketch import (
    RawRing,
    StepStats,
    StepSummary,
    SummaryAggregator,
)

ALPHA = 0.005
QS = (0.0, 0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 0.999, 1.0)


def exact(values: list[float], q: float) -> float:
    """The guarantee's definition of the q-quantile: rank floor(q * (n - 1)) in sorted order."""
    return sorted(values)[math.floor(q * (len(values) - 1))]


def assert_within(sketch: QuantileSketch, values: list[float]) -> None:
    for q in QS:
        got, want = sketch.quantile(q), exact(values, q)
        assert got is not None
        tolerance = ALPHA * abs(want) + 1e-12 * abs(want) + sketch.min_value
        assert abs(got - want) <= tolerance, (q, got, want)


def sketch_of(values: list[float], **kw: float) -> QuantileSketch:
    s = QuantileSketch(ALPHA, **kw)  # type: ignore[arg-type]
    for v in values:
        s.add(v)
    return s


lognormal = st.lists(
    st.tuples(st.floats(-3, 3), st.floats(0.01, 3)), min_size=1, max_size=300
).map(lambda pairs: [math.exp(mu + sigma * (i % 7 - 3)) for i, (mu, sigma) in enumerate(pairs)])
uniform = st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=300)
with_duplicates = st.lists(st.sampled_from([0.0, 1e-3, 0.5, 0.5, 2.0, -7.5, 1e9]),
                           min_size=1, max_size=300)


@settings(max_examples=150, deadline=None)
@given(st.one_of(lognormal, uniform, with_duplicates))
def test_every_quantile_is_within_alpha_of_the_exact_one(values: list[float]) -> None:
    assert_within(sketch_of(values), values)


def test_lognormal_step_times_at_scale() -> None:
    rng = random.Random(7)
    values = [0.5 * rng.lognormvariate(0, 0.3) for _ in range(20_000)]
    s = sketch_of(values)
    assert_within(s, values)
    assert s.buckets < 400  # a realistic spread uses a few hundred buckets at most


@settings(max_examples=100, deadline=None)
@given(uniform, uniform)
def test_merge_equals_the_sketch_of_the_union(a: list[float], b: list[float]) -> None:
    merged = sketch_of(a)
    merged.merge(sketch_of(b))
    assert merged == sketch_of(a + b)
    assert merged.count == len(a) + len(b)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(-1e300, 1e300, allow_nan=False), min_size=1, max_size=200),
       st.lists(st.floats(-1e300, 1e300, allow_nan=False), min_size=1, max_size=200),
       st.integers(2, 40))
def test_memory_is_bounded_and_folding_keeps_merge_exact(
        a: list[float], b: list[float], cap: int) -> None:
    # Values spread over 600 decades, both signs: far more buckets than the cap.
    sa, sb = sketch_of(a, max_buckets=cap), sketch_of(b, max_buckets=cap)
    assert sa.buckets <= cap and sb.buckets <= cap
    sa.merge(sb)
    assert sa.buckets <= cap
    assert sa == sketch_of(a + b, max_buckets=cap)
    assert sketch_of(list(reversed(a)), max_buckets=cap) == sketch_of(a, max_buckets=cap)


def test_folding_keeps_the_high_quantiles_accurate() -> None:
    values = [10.0 ** (k / 10) for k in range(-90, 91)] * 3  # 181 buckets, cap 100
    rng = random.Random(1)
    rng.shuffle(values)
    s = sketch_of(values, max_buckets=100)
    assert s.collapsed and s.buckets <= 100
    for q in (0.5, 0.9, 0.99, 1.0):
        got, want = s.quantile(q), exact(values, q)
        assert got is not None and abs(got - want) <= ALPHA * want * (1 + 1e-12)
    low = s.quantile(0.0)
    assert low is not None and low > min(values)  # the folded low tail reads high, never low


@settings(max_examples=50, deadline=None)
@given(st.one_of(lognormal, uniform, with_duplicates), st.integers(2, 50))
def test_to_dict_round_trips_through_json(values: list[float], cap: int) -> None:
    s = sketch_of(values, max_buckets=cap)
    back = QuantileSketch.from_dict(json.loads(json.dumps(s.to_dict())))
    assert back == s
    assert [back.quantile(q) for q in QS] == [s.quantile(q) for q in QS]
    back.add(1.0)
    s.add(1.0)
    assert back == s


def test_empty_and_bad_input() -> None:
    s = QuantileSketch()
    assert s.quantile(0.5) is None
    with pytest.raises(ValueError, match="finite"):
        s.add(math.nan)
    with pytest.raises(ValueError, match="q must be"):
        s.quantile(1.5)
    with pytest.raises(ValueError, match="different alpha"):
        s.merge(QuantileSketch(alpha=0.01))


values_by_rank = st.lists(
    st.one_of(st.floats(-1e3, 1e3, allow_nan=False), st.sampled_from([math.nan, math.inf])),
    min_size=1, max_size=100)


@settings(max_examples=100, deadline=None)
@given(values_by_rank, st.integers(0, 100))
def test_step_stats_name_the_extreme_ranks_and_count_nonfinite(
        values: list[float], split: int) -> None:
    stats = StepStats()
    for rank, v in enumerate(values):
        stats.add(rank, v)
    finite = {rank: v for rank, v in enumerate(values) if math.isfinite(v)}
    bad = [rank for rank, v in enumerate(values) if not math.isfinite(v)]
    assert stats.nonfinite == len(bad) and stats.nonfinite_ranks == bad
    assert stats.count == len(finite) == stats.sketch.count  # non-finite never enter the sketch
    if finite:
        lo, hi = min(finite.values()), max(finite.values())
        assert (stats.min, stats.max) == (lo, hi)
        assert stats.min_rank == min(r for r, v in finite.items() if v == lo)
        assert stats.max_rank == min(r for r, v in finite.items() if v == hi)
        assert stats.sum == pytest.approx(sum(finite.values()))
    # Two nodes' halves merged, in either order, give the same statistics.
    left, right = StepStats(), StepStats()
    for rank, v in enumerate(values):
        (left if rank < split else right).add(rank, v)
    right.merge(left)
    assert _comparable(right) == _comparable(stats)


def _comparable(s: StepStats) -> dict[str, object]:
    d = s.to_dict()
    d["sum"] = round(d["sum"], 6)
    return d


def test_step_stats_to_dict_is_json_even_when_empty() -> None:
    stats = StepStats()
    stats.add(3, math.inf)
    d = json.loads(json.dumps(stats.to_dict(), allow_nan=False))
    assert d["min"] is None and d["nonfinite_ranks"] == [3]
    assert StepStats.from_dict(d).to_dict() == stats.to_dict()


def report(rank: int, step: int, **kw: float) -> RankStep:
    fields: dict[str, Any] = {"loss": 2.0 + rank / 100, "step_time": 0.5, "data_wait": 0.01,
                                "grad_norm": 1.0, "lr": 1e-3, "tokens": 4096.0}
    fields.update(kw)
    return RankStep(rank=rank, step=step, time=100.0 + step, cursor=step, **fields)


def test_summary_row_agrees_with_metrics_row() -> None:
    ranks = [report(r, 5, step_time=0.5 + (0.4 if r == 6 else 0.0)) for r in range(8)]
    agg, summaries = StepAggregator(8), SummaryAggregator(8)
    [record] = [rec for r in ranks for rec in agg.add(r)]
    [summary] = [s for r in ranks for s in summaries.add(r)]
    full, small = metrics_row(record, attempt=2), summary.to_row(attempt=2)
    for key in ("step", "time", "attempt", "cursor", "loss", "loss_min", "loss_max",
                "grad_norm", "lr", "tokens", "step_time"):
        assert small[key] == pytest.approx(full[key]), key
    # The sketch's median is the lower median (rank floor(q * (n - 1))), not the mean of two.
    lower_median = exact([r.loss for r in ranks if r.loss is not None], 0.5)
    assert small["loss_median"] == pytest.approx(lower_median, rel=ALPHA)
    assert small["step_time_max_rank"] == 6 and small["compute_max_rank"] == 6
    assert small["n_ranks"] == 8 and "missing_ranks" not in small
    assert summary.mean_loss == pytest.approx(record.loss)
    assert summary.slowest_step_time == record.step_time
    assert summary.max_grad_norm == record.grad_norm


def test_summary_aggregator_emits_like_step_aggregator() -> None:
    # Rank 0's backlog is read first; rank 1's step-2 report was dropped.
    agg = SummaryAggregator(world_size=2, keep_raw=2)
    out = [s for step in (1, 2, 3) for s in agg.add(report(0, step))]
    assert out == []
    out = [s for step in (1, 3) for s in agg.add(report(1, step))]
    assert [(s.step, s.n_ranks) for s in out] == [(1, 2), (2, 1), (3, 2)]
    assert out[1].to_row(0)["missing_ranks"] == [1]
    assert agg.flush() == []
    assert sorted({r.step for r in agg.ring.records()}) == [2, 3]  # only the last 2 steps


def test_summary_ignores_a_duplicate_report_and_names_nonfinite_ranks() -> None:
    s = StepSummary(step=1, world_size=4)
    s.add(report(0, 1))
    s.add(report(0, 1, loss=99.0))
    s.add(report(2, 1, loss=math.nan))
    assert (s.n_ranks, s.duplicates) == (2, 1)
    assert math.isnan(s.mean_loss or 0.0) and s.loss.nonfinite_ranks == [2]
    assert s.missing_ranks() == [1, 3]


def test_summaries_of_two_nodes_merge_into_the_summary_of_all_ranks() -> None:
    rng = random.Random(3)
    reports = [report(r, 9, loss=rng.uniform(1, 3), step_time=rng.lognormvariate(-0.7, 0.1))
               for r in range(64)]
    whole, node_a, node_b = (StepSummary(9, 64) for _ in range(3))
    for r in reports:
        whole.add(r)
        (node_a if r.rank < 40 else node_b).add(r)
    node_b.merge(node_a)
    assert node_b.to_row(0) == pytest.approx(whole.to_row(0))
    with pytest.raises(ValueError, match="rank 0 is in both"):
        node_b.merge(node_a)


def test_raw_ring_round_trips_reports() -> None:
    ring = RawRing(steps=3)
    sent = [report(r, s, loss=math.nan if r == 1 else 2.0) for s in range(1, 6) for r in range(3)]
    sent.append(RankStep(rank=7, step=5, time=1.0, skipped=True))  # optional fields absent
    for r in sent:
        ring.add(r)
    ring.add(report(0, 1))  # older than everything kept: dropped
    got = ring.records()
    want = [r for r in sent if r.step >= 3]
    assert [repr(r) for r in got] == [repr(r) for r in want]  # repr: NaN != NaN
    assert ring.nbytes == 94 * len(want)  # a packed STEP_BODY each
