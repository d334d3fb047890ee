"""The rank-departure detector: one rank's loss leaves its own level while its peers' stay."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from babysit.policies.detectors import RankDepartureConfig, RankDepartureDetector, loss_spread
from babysit.policies.loader import load_policy
from babysit.policies.pipeline import Pipeline
from babysit.policies.types import Finding, Incident, RankStep, Severity, StepRecord

settings.register_profile("babysit", max_examples=60, deadline=None, derandomize=True)
settings.load_profile("babysit")

PATIENCE = RankDepartureConfig().patience


def rec(step: int, losses: list[float | None]) -> StepRecord:
    ranks = tuple(RankStep(rank=r, step=step, time=float(step), cursor=10 * step, loss=v)
                  for r, v in enumerate(losses))
    return StepRecord(step=step, time=float(step), ranks=ranks, world_size=len(losses))


Shape = Callable[[int, int], float]
"""(step, rank) -> factor applied to that rank's clean loss."""


def stream(world: int, steps: int, shape: Shape | None = None, *, seed: int = 0,
           sigma: float = 0.01, falling: bool = True) -> list[StepRecord]:
    """Per-rank losses at different levels (each rank its own shard), a falling curve shared by
    all, independent per-rank noise, times ``shape``."""
    rng = random.Random(seed)
    out = []
    for s in range(1, steps + 1):
        trend = 2.5 + 2.0 * math.exp(-s / 400) if falling else 3.0
        out.append(rec(s, [trend * (1 + 0.07 * r) * math.exp(rng.gauss(0.0, sigma))
                           * (shape(s, r) if shape else 1.0) for r in range(world)]))
    return out


def findings(records: list[StepRecord],
             det: RankDepartureDetector | None = None) -> list[Finding]:
    det = det or RankDepartureDetector()
    return [f for r in records if (f := det.observe(r)) is not None]


# -- clean runs stay quiet ---------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("sigma", [0.005, 0.03])
def test_clean_noise_at_different_levels_never_fires(world: int, sigma: float) -> None:
    assert findings(stream(world, 5000, seed=world, sigma=sigma)) == []


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("factor", [1.5, 3.0])
def test_a_global_spike_is_not_a_departure(world: int, factor: float) -> None:
    # Every rank jumps together for 30 steps: the loss-spike detector's business, not ours.
    def spike(s: int, r: int) -> float:
        return factor if 1000 <= s < 1030 else 1.0

    assert findings(stream(world, 2000, spike)) == []


def test_a_global_spike_that_hits_shards_unevenly_is_not_a_departure() -> None:
    # 3x for every rank, and within that +-20 % per rank and step: every rank moves, so no one
    # rank moving more than the others is evidence of a broken rank.
    for seed in range(5):
        rng = random.Random(100 + seed)

        def spike(s: int, r: int, rng: random.Random = rng) -> float:
            return 3.0 * math.exp(rng.gauss(0.0, 0.2)) if 400 <= s < 440 else 1.0

        assert findings(stream(2, 1000, spike, seed=seed, sigma=0.02)) == []


# -- a departing rank is named -----------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(("factor", "direction"), [(1.3, "up"), (0.7, "down")])
def test_one_rank_shifting_is_named_within_patience(world: int, factor: float,
                                                     direction: str) -> None:
    bad = world - 1

    def shift(s: int, r: int) -> float:
        return factor if r == bad and s >= 1500 else 1.0

    got = findings(stream(world, 3000, shift, seed=7))
    assert len(got) == 1
    f = got[0]
    assert f.incident is Incident.RANK_DEPARTURE and f.severity is Severity.WARNING
    assert f.ranks == (bad,) and f.onset_step == 1500 and f.onset_cursor == 15000
    assert 1500 + PATIENCE - 1 <= f.step <= 1500 + PATIENCE + 3
    ev = f.evidence
    assert ev["rank"] == bad and ev["direction"] == direction
    assert ev["ratio"] == pytest.approx(factor, rel=0.05)
    assert (ev["loss"] > ev["peer_median_loss"]) == (direction == "up")
    assert abs(ev["z"]) >= RankDepartureConfig().z_threshold and ev["streak"] >= PATIENCE
    assert f"rank {bad}" in f.message and direction in f.message
    json.dumps(f.to_json())


def test_rank_zero_departing_is_named_too() -> None:
    # With two ranks the departure is symmetric; the detector must not just name the higher rank.
    got = findings(stream(2, 2000, lambda s, r: 1.3 if r == 0 and s >= 1000 else 1.0))
    assert [f.ranks for f in got] == [(0,)]


def test_departure_on_a_steep_early_descent() -> None:
    # Step 60 of a curve still falling 1-2 % per step: the baselines' lag is nobody's movement.
    def steep(s: int) -> float:
        return 1.5 + 8.0 * math.exp(-s / 40)

    for world in (2, 4):
        rng = random.Random(world)
        records = [rec(s, [steep(s) * math.exp(rng.gauss(0, 0.02))
                           * (1.3 if r == 1 and s >= 60 else 1.0) for r in range(world)])
                   for s in range(1, 300)]
        got = findings(records)
        assert [(f.ranks, f.onset_step) for f in got] == [((1,), 60)]


def test_one_report_per_episode_and_rearmed_after_the_rank_returns() -> None:
    def twice(s: int, r: int) -> float:
        return 1.3 if r == 1 and (600 <= s < 800 or 1500 <= s < 1600) else 1.0

    got = findings(stream(2, 2500, twice))
    assert [(f.ranks, f.onset_step, f.evidence["direction"]) for f in got] == [
        ((1,), 600, "up"), ((1,), 1500, "up")]


def test_a_rank_that_never_comes_back_is_reported_once() -> None:
    # Hours later the curve has fallen a long way; the departed rank is still where it was
    # relative to its peers, and is neither re-reported nor mistaken for its peer.
    got = findings(stream(2, 10_000, lambda s, r: 1.3 if r == 1 and s >= 600 else 1.0))
    assert [(f.step, f.ranks) for f in got] == [(600 + PATIENCE - 1, (1,))]


def test_a_short_excursion_is_not_reported() -> None:
    got = findings(stream(4, 2000, lambda s, r: 1.5 if r == 2 and 1000 <= s < 1005 else 1.0))
    assert got == []


def test_nonfinite_and_missing_losses_are_ignored() -> None:
    records = stream(2, 1200, lambda s, r: 1.3 if r == 1 and s >= 1000 else 1.0)
    holes = []
    for r in records:
        losses: list[float | None] = [x.loss for x in r.ranks]
        if r.step % 7 == 0:
            losses[0] = math.nan
        if r.step % 11 == 0:
            losses[1] = None
        if r.step % 13 == 0:
            losses[0] = 0.0  # log-loss needs a positive loss
        holes.append(rec(r.step, losses))
    got = findings(holes)
    assert [f.ranks for f in got] == [(1,)]
    # A step with fewer than two finite ranks changes nothing.
    det = RankDepartureDetector()
    for r in holes[:500]:
        det.observe(r)
    before = json.dumps(det.state_dict())
    assert det.observe(rec(501, [math.inf, None])) is None
    one = RankStep(rank=1, step=502, time=502.0, loss=3.0)
    assert det.observe(StepRecord(step=502, time=502.0, ranks=(one,), world_size=2)) is None
    assert json.dumps(det.state_dict()) == before


def test_state_round_trip_mid_stream_changes_nothing() -> None:
    records = stream(4, 2000, lambda s, r: 1.3 if r == 3 and 900 <= s < 1300 else 1.0)
    whole = [(f.step, f.ranks) for f in findings(records)]
    assert whole
    for cut in (5, 400, 905, 1100, 1305):
        first = RankDepartureDetector()
        got = [(f.step, f.ranks) for f in findings(records[:cut], first)]
        second = RankDepartureDetector()
        second.load_state_dict(json.loads(json.dumps(first.state_dict())))
        got += [(f.step, f.ranks) for f in findings(records[cut:], second)]
        assert got == whole


def test_a_new_world_size_starts_over() -> None:
    det = RankDepartureDetector()
    findings(stream(4, 500), det)
    assert findings(stream(2, 3000, lambda s, r: 1.3 if r == 1 and s >= 1500 else 1.0),
                    det)[0].ranks == (1,)


def test_the_pipeline_runs_it_and_the_default_policy_alerts() -> None:
    # A rank dropping by 30 % lowers the mean loss: invisible to the loss-spike detector.
    pipe = Pipeline(load_policy("default", {}))
    records = stream(4, 2000, lambda s, r: 0.7 if r == 1 and s >= 1000 else 1.0)
    decisions = [d for r in records for d in pipe.observe(r)]
    assert [(d.detector, d.action, d.step) for d in decisions] == [
        ("rank_departure", "alert", 1000 + PATIENCE - 1)]


# -- loss_spread -------------------------------------------------------------------------------


def test_loss_spread_of_the_finite_losses() -> None:
    assert loss_spread(rec(1, [2.0, math.nan, 5.0, None, 1.0, 5.0])) == {
        "min": 1.0, "median": 3.5, "max": 5.0, "min_rank": 4, "max_rank": 2}
    assert loss_spread(rec(1, [3.0])) == {"min": 3.0, "median": 3.0, "max": 3.0,
                                          "min_rank": 0, "max_rank": 0}
    assert loss_spread(rec(1, [None, math.nan])) is None


# -- properties --------------------------------------------------------------------------------


@settings(max_examples=30)
@given(world=st.integers(2, 8), sigma=st.floats(0.0, 0.05), level=st.floats(1e-3, 1e3),
       seed=st.integers(0, 2**32 - 1))
def test_stationary_noise_never_fires(world: int, sigma: float, level: float,
                                      seed: int) -> None:
    rng = random.Random(seed)
    levels = [level * math.exp(rng.uniform(-0.5, 0.5)) for _ in range(world)]
    records = [rec(s, [v * math.exp(rng.gauss(0.0, sigma)) for v in levels])
               for s in range(1, 600)]
    assert findings(records) == []


@given(world=st.integers(2, 8), bad=st.integers(0, 7), factor=st.sampled_from([0.5, 0.7, 1.3, 2]),
       seed=st.integers(0, 2**32 - 1))
def test_a_large_departure_is_always_named(world: int, bad: int, factor: float,
                                           seed: int) -> None:
    bad %= world
    records = stream(world, 400, lambda s, r: factor if r == bad and s >= 200 else 1.0,
                     seed=seed, sigma=0.01)
    got = findings(records)
    assert [(f.ranks, f.onset_step) for f in got] == [((bad,), 200)]
    assert got[0].step < 200 + PATIENCE + 3


@settings(max_examples=20)
@given(scale=st.floats(1e-3, 1e3), seed=st.integers(0, 2**32 - 1))
def test_scaling_the_losses_changes_no_verdict(scale: float, seed: int) -> None:
    records = stream(3, 500, lambda s, r: 1.4 if r == 2 and 250 <= s < 400 else 1.0, seed=seed)
    scaled = [rec(r.step, [None if x.loss is None else x.loss * scale for x in r.ranks])
              for r in records]

    def verdicts(rs: list[StepRecord]) -> list[tuple[int, int, tuple[int, ...]]]:
        return [(f.step, f.onset_step, f.ranks) for f in findings(rs)]

    expected = verdicts(records)
    assert expected and verdicts(scaled) == expected
