"""The status line, digest snapshot and summary: only what the script reported."""

from __future__ import annotations

from babysit.policies import decide as sm
from babysit.policies.types import RankStep, StepRecord
from babysit.supervisor.run.progress import RunProgress, si


def record(step: int, tokens: float | None, flops: float | None = None) -> StepRecord:
    rank = RankStep(rank=0, step=step, time=float(step), loss=2.5, tokens=tokens, step_time=0.25)
    return StepRecord(step=step, time=float(step), ranks=(rank,), world_size=1,
                      flops_per_token=flops, peak_flops=1e9 if flops else None)


def test_without_tokens_the_line_has_no_throughput_fields() -> None:
    p = RunProgress()
    for s in range(1, 5):
        p.observe(record(s, None))
    line = p.status_line(sm.Machine(state=sm.State.RUNNING, attempt=0, step=4))
    assert "tok/s" not in line and "MFU" not in line and "1.0 steps/s" in line
    snap = p.snapshot(sm.Machine(state=sm.State.RUNNING))
    assert snap.tokens_per_second is None and snap.mfu is None


def test_tokens_and_mfu_are_medians_of_the_last_steps() -> None:
    p = RunProgress()
    for s in range(1, 6):
        p.observe(record(s, 1000.0 if s != 3 else 100_000.0, flops=1e5))  # one outlier step
    assert p.tokens_per_s() == 4000.0 and p.mfu() == 4000.0 * 1e5 / 1e9
    line = p.status_line(sm.Machine(state=sm.State.RUNNING, attempt=1, step=5))
    assert "4.0k tok/s" in line and "MFU 40.0%" in line
    assert "MFU 40.0%" in p.summary(sm.Machine(state=sm.State.SUCCEEDED), 10.0, 1)


def test_si() -> None:
    assert [si(v) for v in (12.0, 41_234.5, 3.2e6, 7.5e9)] == ["12", "41.2k", "3.2M", "7.5G"]


def test_the_rate_after_a_rollback_is_the_new_attempts_never_negative() -> None:
    p = RunProgress()
    for s in range(1, 41):
        p.observe(record(s, None))
    for s in range(21, 24):  # resumed from step 20, a little later
        rank = RankStep(rank=0, step=s, time=40.0 + s - 20, loss=2.5, step_time=0.25)
        p.observe(StepRecord(step=s, time=40.0 + s - 20, ranks=(rank,), world_size=1))
    assert p.steps_per_s() == 1.0
    assert "1.0 steps/s" in p.status_line(sm.Machine(state=sm.State.RUNNING, attempt=1, step=23))
