"""Unit tests of each detector's behaviour, as the supervisor (or the worker) would see it."""

from __future__ import annotations

import math
import time

import pytest

from babysit.policies.detectors import (
    GradNormConfig,
    GradNormDetector,
    HangConfig,
    HangDetector,
    LossSpikeConfig,
    LossSpikeDetector,
    NonFiniteDetector,
    StragglerConfig,
    StragglerDetector,
    ThroughputConfig,
    ThroughputDetector,
)
from babysit.policies.loader import load_policy
from babysit.policies.types import Incident, RankStep, Severity, StepRecord


def rec(step: int, loss: float | None = None, *, grad: float | None = None,
        step_time: float | None = None, tokens: float | None = None, cursor: int | None = None,
        world: int = 1) -> StepRecord:
    ranks = tuple(RankStep(rank=r, step=step, time=float(step), cursor=step if cursor is None
                           else cursor, loss=loss, grad_norm=grad, step_time=step_time,
                           tokens=tokens) for r in range(world))
    return StepRecord(step=step, time=float(step), ranks=ranks, world_size=world)


def noisy(step: int, level: float = 3.0) -> float:
    # Deterministic, mean-free +-0.5 % wiggle: enough to give the baseline a noise scale.
    return level * (1.0 + 0.005 * math.sin(step * 2.1) * math.cos(step * 0.7))


# -- loss spike -------------------------------------------------------------------------------


def feed(det: LossSpikeDetector, losses: dict[int, float]) -> list[tuple[int, Severity, int]]:
    out = []
    for step, loss in sorted(losses.items()):
        f = det.observe(rec(step, loss, cursor=10 * step))
        if f is not None:
            out.append((f.step, f.severity, f.onset_step))
    return out


def test_one_step_outlier_is_a_warning_only() -> None:
    losses = {s: noisy(s) for s in range(1, 300)}
    losses[200] *= 1.3
    assert feed(LossSpikeDetector(), losses) == [(200, Severity.WARNING, 200)]


def test_default_verdicts_heal_warns_stay_rolls_back_diverge_and_catastrophe_at_once() -> None:
    # The defaults, on the four shapes docs/detection.md weighs against each other.
    def verdicts(shape: dict[int, float]) -> list[tuple[int, Severity, int]]:
        losses = {s: noisy(s) * shape.get(s, 1.0) for s in range(1, 400)}
        return feed(LossSpikeDetector(), losses)

    healing = {s: 1.6 for s in range(200, 250)}  # 50 steps at 1.6x, then back: a healthy spike
    assert verdicts(healing) == [(200, Severity.WARNING, 200)]
    staying = {s: 1.5 for s in range(200, 400)}  # a 1.5x jump that never heals
    assert verdicts(staying) == [(200, Severity.WARNING, 200), (280, Severity.CRITICAL, 200)]
    diverging = {s: math.exp(0.01 * (s - 195)) for s in range(196, 400)}  # +1 %/step, no end
    warn, crit = verdicts(diverging)[:2]  # (the stream goes on: it re-learns, spikes again)
    assert warn[1] is Severity.WARNING and crit[1] is Severity.CRITICAL
    assert crit[0] - crit[2] <= 45  # well before the patience runs out
    catastrophic = {s: 5.0 for s in range(200, 203)}
    assert verdicts(catastrophic) == [(200, Severity.CRITICAL, 200)]


def test_a_tenfold_reading_inside_a_very_noisy_runs_own_noise_is_not_catastrophic() -> None:
    """A tiny batch gives a loss that swings by 10x from step to step (tests/workers/tiny_train:
    0.08 to 1.55 around 0.6); a reading 10x its baseline there is an ordinary outlier (robust z
    about 3), not a catastrophe to roll back at once. A 5x jump on a quiet curve still is."""
    import random

    rng = random.Random(7)
    losses = {s: 0.6 * math.exp(rng.gauss(0.0, 0.9)) for s in range(1, 200)}
    losses[150] = 6.4
    assert not [v for v in feed(LossSpikeDetector(), losses) if v[1] is Severity.CRITICAL]
    quiet = {s: noisy(s) for s in range(1, 200)}
    quiet[150] = noisy(150) * 5
    assert feed(LossSpikeDetector(), quiet) == [(150, Severity.CRITICAL, 150)]


def test_a_small_level_shift_that_stays_becomes_the_new_baseline() -> None:
    # +8 % for good (a data mix change): a warning, never a rollback; afterwards a real spike
    # is measured against the new level.
    losses = {s: noisy(s) * (1.08 if s >= 150 else 1.0) for s in range(1, 500)}
    for s in range(400, 500):
        losses[s] *= 1.5
    det = LossSpikeDetector()
    got = feed(det, losses)
    assert got[0] == (150, Severity.WARNING, 150)
    assert [g for g in got if g[1] is Severity.CRITICAL] == [(480, Severity.CRITICAL, 400)]


def test_spike_that_persists_past_patience_is_critical_with_its_onset() -> None:
    losses = {s: noisy(s) * (1.3 if s >= 200 else 1.0) for s in range(1, 260)}
    det = LossSpikeDetector(LossSpikeConfig(patience=5))
    got = feed(det, losses)
    assert got[:2] == [(200, Severity.WARNING, 200), (205, Severity.CRITICAL, 200)]


def test_spike_recovering_within_patience_stays_a_warning() -> None:
    losses = {s: noisy(s) * (1.3 if 200 <= s < 204 else 1.0) for s in range(1, 300)}
    assert feed(LossSpikeDetector(LossSpikeConfig(patience=5)), losses) == [
        (200, Severity.WARNING, 200)]


def test_critical_finding_carries_evidence_and_onset_cursor() -> None:
    det = LossSpikeDetector(LossSpikeConfig(patience=2))
    findings = [det.observe(rec(s, noisy(s) * (2.0 if s >= 100 else 1.0), cursor=10 * s))
                for s in range(1, 110)]
    crit = next(f for f in findings if f is not None and f.severity is Severity.CRITICAL)
    assert crit.onset_step == 100 and crit.onset_cursor == 1000 and crit.step == 102
    assert crit.incident is Incident.LOSS_SPIKE
    assert crit.evidence["baseline"] == pytest.approx(3.0, rel=0.01)
    assert crit.evidence["ratio"] == pytest.approx(2.0, rel=0.02)
    assert crit.evidence["z"] > 6


def test_slow_creep_then_breakout_is_critical_at_breakout_with_the_creeps_onset() -> None:
    # 3 % above the baseline for 8 steps (elevated, below min_ratio), then 10 %.
    losses = {s: noisy(s) for s in range(1, 200)}
    for s in range(150, 158):
        losses[s] *= 1.03
    losses[158] *= 1.10
    got = feed(LossSpikeDetector(LossSpikeConfig(patience=5, hold_ratio=1.05)), losses)
    assert got[0] == (158, Severity.CRITICAL, 150)


def test_no_verdict_before_min_history() -> None:
    det = LossSpikeDetector(LossSpikeConfig(min_history=8))
    assert [det.observe(rec(s, 3.0 if s < 8 else 30.0)) for s in range(1, 9)] == [None] * 8


def test_steep_descent_never_fires() -> None:
    # The shape of pretraining's first 1000 steps: 11 -> 4, with 1 % noise.
    det = LossSpikeDetector()
    for s in range(1, 1001):
        loss = (4.0 + 7.0 * math.exp(-s / 150)) * (1 + 0.01 * math.sin(s * 1.3))
        assert det.observe(rec(s, loss)) is None


def test_missing_nonfinite_and_nonpositive_losses_are_skipped() -> None:
    det = LossSpikeDetector()
    for s in range(1, 50):
        assert det.observe(rec(s, noisy(s))) is None
    before = det.state_dict()
    for bad in (None, math.nan, math.inf, 0.0, -1.0):
        assert det.observe(rec(50, bad)) is None
    assert det.state_dict() == before


# -- non-finite -------------------------------------------------------------------------------


def test_nonfinite_names_the_ranks() -> None:
    ranks = (
        RankStep(rank=0, step=5, time=0.0, loss=2.0, grad_norm=1.0),
        RankStep(rank=1, step=5, time=0.0, loss=math.nan, grad_norm=1.0),
        RankStep(rank=2, step=5, time=0.0, loss=2.0, grad_norm=math.inf),
    )
    f = NonFiniteDetector().observe(StepRecord(step=5, time=0.0, ranks=ranks, world_size=3))
    assert f is not None and f.severity is Severity.CRITICAL and f.ranks == (1, 2)
    assert f.evidence == {"loss": {"1": "nan"}, "grad_norm": {"2": "inf"}}
    assert f.message == "non-finite grad_norm and loss at step 5 on ranks 1 and 2"


def test_nonfinite_quiet_on_finite_values() -> None:
    assert NonFiniteDetector().observe(rec(1, 2.0, grad=1.0, world=4)) is None


# -- grad norm --------------------------------------------------------------------------------


def test_grad_spike_flagged_and_kept_out_of_the_baseline() -> None:
    det = GradNormDetector(GradNormConfig(min_history=20))
    for s in range(1, 101):
        assert det.observe_value(s, 1.0 + 0.1 * math.sin(s)) is None
    # A burst of spikes: every one flagged, because none of them enters the baseline.
    for s in range(101, 141):
        f = det.observe_value(s, 50.0)
        assert f is not None and f.incident is Incident.GRAD_SPIKE
    assert f.evidence["median"] == pytest.approx(1.0, rel=0.1)
    assert det.observe_value(141, 1.05) is None


def test_grad_norm_moderate_rise_is_not_a_spike() -> None:
    det = GradNormDetector()
    for s in range(1, 101):
        det.observe_value(s, 1.0 + 0.1 * math.sin(s))
    assert det.observe_value(101, 2.5) is None  # below factor 3


def test_grad_norm_worker_entry_point_is_cheap() -> None:
    det = GradNormDetector()
    n = 20_000
    t0 = time.perf_counter()
    for s in range(n):
        det.observe_value(s, 1.0 + 0.1 * math.sin(s))
    per_call = (time.perf_counter() - t0) / n
    assert per_call < 50e-6, f"{per_call * 1e6:.1f} us per call"


# -- hang -------------------------------------------------------------------------------------


def report(det: HangDetector, rank: int, step: int, now: float) -> None:
    det.observe(RankStep(rank=rank, step=step, time=now), now=now)


def test_hang_names_the_rank_that_stopped_first() -> None:
    det = HangDetector(HangConfig(floor_s=5.0, k=5.0, startup_s=60.0))
    det.start(0.0, range(4))
    for step in range(1, 21):
        for rank in range(4):
            report(det, rank, step, step * 0.5)
    # Rank 2 is stuck at step 20; the others got one step further and block in the collective.
    for rank in (0, 1, 3):
        report(det, rank, 21, 10.5)
    assert det.check(14.0) is None  # 4 s < floor 5 s
    f = det.check(16.0)
    assert f is not None and f.incident is Incident.HANG and f.ranks == (2,)
    assert f.onset_step == 20 and "others reached step 21" in f.message
    assert det.check(30.0) is None, "one finding per hang"
    report(det, 2, 21, 31.0)
    assert det.check(31.5) is None


def test_hang_allowance_adapts_to_slow_steps() -> None:
    det = HangDetector(HangConfig(floor_s=5.0, k=5.0))
    det.start(0.0, [0])
    for step in range(1, 11):
        report(det, 0, step, step * 20.0)  # 20 s per step
    assert det.step_allowance() == pytest.approx(100.0)
    assert det.check(200.0 + 99.0) is None
    assert det.check(200.0 + 101.0) is not None


def test_hang_startup_and_phase_allowances() -> None:
    det = HangDetector(HangConfig(floor_s=5.0, k=5.0, startup_s=60.0, phase_s=100.0,
                                  phase_allowance_s={"eval": 300.0}))
    det.start(0.0, [0, 1])
    assert det.check(59.0) is None
    f = det.check(61.0)
    assert f is not None and f.ranks == (0, 1) and f.evidence["stalled"]["0"]["waiting_in"] == \
        "startup"
    det.start(100.0, [0, 1])
    for step in range(1, 5):
        report(det, 0, step, 100.0 + step)
        report(det, 1, step, 100.0 + step)
    det.phase(0, "checkpoint", True, now=104.0)
    det.phase(1, "eval", True, now=104.0)
    assert det.check(190.0) is None  # both inside phases, far beyond the 5 s step allowance
    f = det.check(205.0)
    assert f is not None and f.ranks == (0,)  # checkpoint allows 100 s, eval 300 s
    det.phase(0, "checkpoint", False, now=206.0)
    report(det, 0, 5, 206.5)
    assert det.check(208.0) is None


def test_a_resumed_rank_gets_what_this_runs_first_steps_took_not_startup_s() -> None:
    det = HangDetector(HangConfig(floor_s=2.0, startup_s=900.0, first_step_k=5.0,
                                  first_step_floor_s=30.0))
    det.start(0.0, [0, 1])
    for rank in (0, 1):
        det.hello(rank, 0, 20.0)  # imports, rendezvous: no history yet, startup_s holds
    assert det.first_step_allowance() == 900.0
    assert det.check(600.0) is None
    for step in (1, 2, 3):
        for rank in (0, 1):
            report(det, rank, step, 20.0 + 8.0 * step)  # the first step took 8 s (warm-up)
    assert det.first_step_allowance() == 40.0  # 5 x 8 s, above the 30 s floor

    # The relaunch resumes at step 3 and never steps: its loader blocks on the next batch.
    det.start(1000.0, [0, 1])
    for rank in (0, 1):
        det.hello(rank, 3, 1010.0)
    assert det.check(1049.0) is None
    f = det.check(1051.0)
    assert f is not None and f.ranks == (0, 1)
    assert f.evidence["stalled"]["0"]["waiting_in"] == "first step"
    assert f.evidence["confirm"] is True  # a rank still compiling is busy: the processes say
    assert f.step == 3  # at its checkpoint's step, so the fault can be placed
    heir = HangDetector(det.config)
    heir.load_state_dict(det.state_dict())
    assert heir.first_step_allowance() == 40.0


def test_hang_ignores_dead_ranks_when_told() -> None:
    det = HangDetector(HangConfig(floor_s=5.0))
    det.start(0.0, [0, 1])
    report(det, 0, 1, 1.0)
    report(det, 1, 1, 1.0)
    report(det, 0, 2, 2.0)
    assert det.check(100.0, ranks_alive=[0]) is not None


def test_the_default_policy_suspects_a_stall_in_seconds_and_defers_when_told() -> None:
    config = load_policy("default").detectors.hang
    assert config.floor_s == 2.0 and config.k == 5.0
    det = HangDetector(config)
    det.start(0.0)
    for step in range(1, 21):
        for rank in (0, 1):
            det.observe(RankStep(rank=rank, step=step, time=0.05 * step), 0.05 * step)
    assert det.check(2.9) is None  # 1.9 s after the last step
    finding = det.check(3.1)
    assert finding is not None and finding.evidence["confirm"] is True
    det.defer(3.5, 2.5)  # the ranks were working: quiet for as long again
    assert det.check(5.9) is None
    assert det.check(6.1) is not None
    det.defer(6.5, 5.5)
    # Long enough without a step: a hang whatever the processes show (an endless loop).
    late = det.check(config.busy_s + 1.0)
    assert late is not None and late.evidence["confirm"] is False


def test_a_stall_looms_half_way_to_its_suspicion_and_never_inside_a_phase() -> None:
    det = HangDetector(HangConfig(floor_s=2.0))
    det.start(0.0)
    for step in range(1, 21):
        det.observe(RankStep(rank=0, step=step, time=0.05 * step), 0.05 * step)
    assert not det.looming(1.9) and det.looming(2.1)  # 0.9 s, then 1.1 s after the last step
    assert det.check(3.1) is not None and not det.looming(3.1)  # fired: nothing to read ahead
    det.phase(0, "eval", True, 3.2)
    det.defer(3.2, 2.2)
    assert not det.looming(10.0)  # an eval has its own (long) allowance


def test_progress_ends_a_deferral() -> None:
    det = HangDetector(HangConfig(floor_s=2.0))
    det.start(0.0)
    for step in range(1, 301):
        det.observe(RankStep(rank=0, step=step, time=0.05 * step), 0.05 * step)
    assert det.check(17.1) is not None
    det.defer(17.1, 2.1)  # quiet until 21.2 ...
    det.observe(RankStep(rank=0, step=301, time=18.0), 18.0)
    assert det.check(20.1) is not None  # ... but a new stall is judged afresh


# -- straggler --------------------------------------------------------------------------------


def step_with(step: int, times: dict[int, float], waits: dict[int, float] | None = None,
              world: int = 8) -> StepRecord:
    waits = waits or {}
    ranks = tuple(RankStep(rank=r, step=step, time=float(step), step_time=times.get(r, 0.5),
                           data_wait=waits.get(r, 0.01)) for r in range(world))
    return StepRecord(step=step, time=float(step), ranks=ranks, world_size=world)


def test_mild_straggler_needs_patience() -> None:
    det = StragglerDetector(StragglerConfig(patience=5))
    fired = [s for s in range(1, 20) if det.observe(step_with(s, {3: 0.8})) is not None]
    assert fired == [5]


def test_slow_loader_is_seen_in_data_wait() -> None:
    # Under synchronous collectives every rank's step_time is equal; only data_wait differs.
    det = StragglerDetector()
    f = None
    for s in range(1, 10):
        f = det.observe(step_with(s, {}, waits={6: 0.3})) or f
    assert f is not None and f.ranks == (6,) and f.evidence["6"]["signal"] == "data_wait"


def test_straggler_jitter_below_the_absolute_floor_is_ignored() -> None:
    det = StragglerDetector()
    assert all(det.observe(step_with(s, {r: 0.005 * (1 + r) for r in range(8)})) is None
               for s in range(1, 30))


# -- throughput -------------------------------------------------------------------------------


def test_throughput_drop_warns_once_after_patience() -> None:
    det = ThroughputDetector()
    fired = []
    for s in range(1, 200):
        st = 0.5 if s < 100 else 1.0
        f = det.observe(rec(s, step_time=st, tokens=4096.0))
        if f is not None:
            fired.append(f)
    assert [f.step for f in fired] == [109]
    assert fired[0].onset_step == 100 and fired[0].evidence["unit"] == "tokens/s"
    assert fired[0].evidence["slowdown"] == pytest.approx(2.0)


def test_throughput_hiccups_do_not_warn() -> None:
    det = ThroughputDetector()
    assert all(det.observe(rec(s, step_time=3.0 if s % 7 == 0 else 0.5)) is None
               for s in range(1, 300))


def mfu_rec(step: int, step_time: float | None, tokens: float | None = 4096.0, *,
            flops: float | None = 6 * 125e6, peak: float | None = 1.536e13,
            world: int = 2) -> StepRecord:
    r = rec(step, step_time=step_time, tokens=tokens, world=world)
    return StepRecord(step=r.step, time=r.time, ranks=r.ranks, world_size=world,
                      flops_per_token=flops, peak_flops=peak)


def test_step_record_tokens_per_s_and_mfu_only_from_reported_inputs() -> None:
    r = mfu_rec(1, 0.5)
    # 2 ranks x 4096 tokens in 0.5 s; 750 MFLOP per token; 2 devices of 15.36 TFLOP/s.
    assert r.tokens_per_s == pytest.approx(16384.0)
    assert r.mfu == pytest.approx(0.4)
    assert mfu_rec(1, 0.5, flops=None).mfu is None
    assert mfu_rec(1, 0.5, peak=None).mfu is None
    assert mfu_rec(1, 0.5, tokens=None).tokens_per_s is None
    assert mfu_rec(1, 0.5, tokens=None).mfu is None
    assert mfu_rec(1, None).tokens_per_s is None
    assert mfu_rec(1, 0.0).tokens_per_s is None
    # Records built the old way still work, and know nothing about MFU.
    assert rec(1, step_time=0.5, tokens=10.0).mfu is None


def test_throughput_can_watch_mfu() -> None:
    det = ThroughputDetector(ThroughputConfig(metric="mfu"))
    fired = []
    for s in range(1, 200):
        f = det.observe(mfu_rec(s, 0.5 if s < 100 else 1.0))
        if f is not None:
            fired.append(f)
    assert [(f.step, f.onset_step) for f in fired] == [(109, 100)]
    ev = fired[0].evidence
    assert ev["metric"] == "mfu" and ev["unit"] == "MFU"
    assert ev["rate"] == pytest.approx(0.2) and ev["baseline"] == pytest.approx(0.4)
    assert "MFU 20.0%" in fired[0].message and "MFU 40.0%" in fired[0].message


def test_throughput_mfu_skips_records_that_cannot_say_their_mfu() -> None:
    det = ThroughputDetector(ThroughputConfig(metric="mfu"))
    # Slow steps without the model's FLOPs declared are no evidence: not even of a slowdown.
    assert all(det.observe(mfu_rec(s, 0.5 if s < 100 else 5.0, flops=None if s >= 100 else
                                   750e6)) is None for s in range(1, 200))
    assert len(det.state_dict()["window"]["values"]) == 64


def test_throughput_tokens_per_s_skips_steps_without_tokens() -> None:
    det = ThroughputDetector(ThroughputConfig(metric="tokens_per_s"))
    fired = [f for s in range(1, 200)
             if (f := det.observe(rec(s, step_time=0.5 if s < 100 else 1.0,
                                      tokens=None if s % 3 == 0 else 100.0))) is not None]
    assert len(fired) == 1 and fired[0].evidence["metric"] == "tokens_per_s"
    assert fired[0].evidence["unit"] == "tokens/s" and "tokens/s" in fired[0].message
    # auto falls back to steps/s for those steps; tokens_per_s never does.
    quiet = ThroughputDetector(ThroughputConfig(metric="tokens_per_s"))
    assert all(quiet.observe(rec(s, step_time=0.5 if s < 100 else 1.0)) is None
               for s in range(1, 200))


def test_throughput_steps_per_s_ignores_the_tokens() -> None:
    # Half the tokens per step at the same pace: tokens/s halves, steps/s does not move.
    def stream(metric: str) -> list[str]:
        det = ThroughputDetector(ThroughputConfig.model_validate({"metric": metric}))
        return [f.evidence["metric"] for s in range(1, 200)
                if (f := det.observe(rec(s, step_time=0.5,
                                         tokens=100.0 if s < 100 else 50.0))) is not None]

    assert stream("auto") == ["tokens_per_s"]
    assert stream("steps_per_s") == []


def test_straggler_slow_loader_is_not_mirrored_onto_the_ranks_waiting_for_it() -> None:
    # Rank 1 waits 80 ms for data; under a synchronous all-reduce rank 0 waits the same 80 ms in
    # the collective, which its compute signal (step_time - data_wait) cannot tell apart.
    from babysit.policies.detectors import StragglerDetector
    from babysit.policies.types import RankStep, StepRecord

    det = StragglerDetector()
    finding = None
    for step in range(1, 4):
        ranks = (RankStep(rank=0, step=step, time=0.0, step_time=0.11, data_wait=0.0001),
                 RankStep(rank=1, step=step, time=0.0, step_time=0.11, data_wait=0.08))
        finding = finding or det.observe(StepRecord(step=step, time=0.0, ranks=ranks,
                                                    world_size=2))
    assert finding is not None and finding.ranks == (1,)
    assert finding.evidence["1"]["signal"] == "data_wait"


def test_a_relaunch_is_not_a_throughput_regression() -> None:
    # Fast steps, then a relaunch whose first steps run at a third of the pace (warm-up).
    from babysit.policies.loader import load_policy
    from babysit.policies.pipeline import Pipeline
    from babysit.policies.types import RankStep, StepRecord

    def record(step: int, step_time: float) -> StepRecord:
        ranks = tuple(RankStep(rank=r, step=step, time=float(step), step_time=step_time,
                               tokens=100.0) for r in range(2))
        return StepRecord(step=step, time=float(step), ranks=ranks, world_size=2)

    def slow_findings(relaunch: bool) -> list[str]:
        pipe = Pipeline(load_policy("default"))
        for s in range(1, 60):
            pipe.findings(record(s, 0.1))
        if relaunch:
            pipe.new_attempt()
        return [f.incident.value for s in range(1, 15) for f in pipe.findings(record(s, 0.3))]

    assert slow_findings(relaunch=False) == ["throughput"]  # the same slowdown mid-attempt
    assert slow_findings(relaunch=True) == []


def test_a_single_data_wait_blip_is_no_straggler_but_a_sustained_one_is() -> None:
    # Under CPU load one rank waits 30 ms for one batch against its peers' 0.2 ms (50 ms
    # steps): a ratio of 150, yet one step. Two such steps in a row are a straggler.
    det = StragglerDetector()
    waits = {s: {3: 0.03} if s in (10, 20, 21) else {} for s in range(1, 30)}
    fired = [s for s in range(1, 30) if det.observe(
        step_with(s, {r: 0.05 for r in range(8)},
                  waits={r: 0.0002 for r in range(8)} | waits[s])) is not None]
    assert fired == [21]


def test_an_excess_small_against_the_step_is_no_straggler() -> None:
    # 25 ms of extra data wait on 2 s steps: above the absolute floor, but 1 % of the step.
    det = StragglerDetector()
    assert all(det.observe(step_with(s, {r: 2.0 for r in range(8)},
                                     waits={r: 0.001 for r in range(8)} | {3: 0.026}))
               is None for s in range(1, 30))
