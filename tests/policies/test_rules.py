"""The rules engine: ladders, cooldowns, budget, escalation, crashes, persistence."""

from __future__ import annotations

import json

import pytest

from babysit.policies.detectors import classify
from babysit.policies.loader import load_policy
from babysit.policies.rules import Rules
from babysit.policies.schema import Policy
from babysit.policies.types import Action, Finding, Incident, Severity


def finding(incident: Incident = Incident.LOSS_SPIKE, step: int = 1000,
            severity: Severity = Severity.CRITICAL, onset: int | None = None,
            cursor: int | None = None) -> Finding:
    return Finding(incident=incident, detector=incident.value, severity=severity, step=step,
                   onset_step=step if onset is None else onset, message="test",
                   onset_cursor=cursor)


def policy(**overrides: object) -> Policy:
    """The default policy with ``overrides``, reruns off unless they say otherwise: these
    tests are about the ladders and the rollback's sizes (tests/policies/test_rerun.py holds
    the rerun a spike's rollback begins with by default)."""
    return load_policy("default", {"rollback.rerun_max_steps": 0, **overrides})


def test_loss_spike_ladder_climbs_then_stops() -> None:
    rules = Rules(policy(**{"budget.max_interventions": 100}))
    actions = [rules.on_finding(finding(step=s, cursor=s * 1000), now=float(s)).action
               for s in (1000, 1100, 1200, 1300, 1400)]
    assert actions == [Action.ROLLBACK] * 3 + [Action.STOP, Action.STOP]


def test_warnings_only_alert() -> None:
    rules = Rules(policy())
    r = rules.on_finding(finding(severity=Severity.WARNING), now=0.0)
    assert r.action is Action.ALERT and "below act_on" in r.reason
    # ...and do not use up a rung.
    assert rules.on_finding(finding(), now=1.0).action is Action.ROLLBACK
    assert rules.state_dict()["ladders"]["loss_spike"]["rung"] == 1


def test_ladder_resets_after_quiet_steps() -> None:
    rules = Rules(policy(**{"incidents.loss_spike.reset_after_steps": 500}))
    for s in (1000, 1100, 1200):
        rules.on_finding(finding(step=s, cursor=s * 100), now=float(s))
    r = rules.on_finding(finding(step=1800, cursor=180_000), now=1800.0)
    assert r.action is Action.ROLLBACK and "rung 1/" in r.reason


def test_cooldown_steps_swallow_repeats_but_not_replayed_steps() -> None:
    rules = Rules(policy())
    nan = Incident.NONFINITE
    assert rules.on_finding(finding(nan, step=500), now=0.0).action is Action.ROLLBACK
    # The same attempt keeps reporting NaN on the following steps: journal only.
    r = rules.on_finding(finding(nan, step=501), now=1.0)
    assert r.action is Action.IGNORE and "cooldown" in r.reason
    # After the rollback the run replays earlier steps; a NaN there is news, not a repeat.
    assert rules.on_finding(finding(nan, step=480), now=60.0).action is Action.ROLLBACK


def test_cooldown_seconds_for_alerts() -> None:
    rules = Rules(policy())
    s = Incident.STRAGGLER
    assert rules.on_finding(finding(s, severity=Severity.WARNING), 0.0).action is Action.ALERT
    assert rules.on_finding(finding(s, severity=Severity.WARNING), 300.0).action is Action.IGNORE
    assert rules.on_finding(finding(s, severity=Severity.WARNING), 700.0).action is Action.ALERT


def test_budget_exhausted_stops_and_says_why() -> None:
    rules = Rules(policy(**{"budget.max_interventions": 2, "budget.window_s": 3600}))
    hang = Incident.HANG
    assert rules.on_finding(finding(hang, step=10), 0.0).action is Action.RELAUNCH
    assert rules.on_finding(finding(step=20_000, cursor=1), 10.0).action is Action.ROLLBACK
    r = rules.on_finding(finding(step=50_000, cursor=10**6), 20.0)
    assert r.action is Action.STOP and "budget" in r.reason and "rollback" in r.reason
    # Outside the window the budget is free again.
    assert rules.on_finding(finding(step=90_000, cursor=10**7), 4000.0).action is Action.ROLLBACK


def test_rollback_parameters_and_escalation_of_a_repeated_region() -> None:
    pol = policy(**{"rollback.skip_before": 10, "rollback.skip_after": 50,
                    "rollback.lr_factor": 0.5, "rollback.escalation_window": 200})
    rules = Rules(pol)
    first = rules.on_finding(finding(step=1005, onset=1000, cursor=8000), 0.0)
    assert (first.action, first.skip_before, first.skip_after, first.lr_scale) == (
        Action.ROLLBACK, 10, 50, 0.5)
    # The resumed run spikes again just past the skipped range: same region, wider, lower LR.
    again = rules.on_finding(finding(step=1010, onset=1003, cursor=8100), 60.0)
    assert (again.skip_before, again.skip_after, again.lr_scale) == (20, 100, 0.5)
    assert "region" in again.reason
    # The first cut wears off (the policy's re-warm); the repeat's stays for good.
    assert (first.lr_rewarm, again.lr_rewarm) == (pol.rollback.lr_rewarm_steps, None)
    third = rules.on_finding(finding(step=1012, onset=1006, cursor=8150), 120.0)
    assert (third.skip_before, third.skip_after) == (40, 200)
    # A spike far away (and past the ladder's reset) is a new region: base skip again.
    r = rules.on_finding(finding(step=9000, cursor=90_000), 180.0)
    assert (r.action, r.skip_before, r.skip_after) == (Action.ROLLBACK, 10, 50)


def test_onset_step_stands_in_for_a_missing_cursor() -> None:
    rules = Rules(policy())
    r1 = rules.on_finding(finding(step=1005, onset=1000), 0.0)
    r2 = rules.on_finding(finding(step=1004, onset=1002), 1.0)
    assert r2.skip_after == 2 * r1.skip_after


def test_grad_spikes_skip_then_escalate_to_rollback() -> None:
    rules = Rules(policy())
    g = Incident.GRAD_SPIKE
    actions = [rules.on_finding(finding(g, step=s, severity=Severity.WARNING), float(s)).action
               for s in (100, 110, 120, 130)]
    assert actions == [Action.SKIP_STEP] * 3 + [Action.ROLLBACK]


def crash(log: str, step: int, previous: list | None = None) -> Finding:
    return classify(1, None, log, step, previous or []).to_finding()


@pytest.mark.parametrize(("at_once", "waits"), [(True, [0.0, 5.0, 10.0, 15.0]),
                                                (False, [5.0, 10.0, 15.0, 15.0])])
def test_crash_relaunch_with_exponential_backoff_then_stop_at_class_limit(
        at_once: bool, waits: list[float]) -> None:
    rules = Rules(policy(**{"crash.max_relaunches.network": 4, "crash.backoff_base_s": 5,
                            "crash.backoff_max_s": 15,
                            "crash.first_relaunch_at_once": at_once}))
    log = "RuntimeError: Connection reset by peer"
    rs = [rules.on_finding(crash(log, 100 * i), float(i)) for i in range(1, 6)]
    assert [r.action for r in rs] == [Action.RELAUNCH] * 4 + [Action.STOP]
    assert [r.backoff_s for r in rs[:4]] == waits
    assert rs[0].reason.endswith("relaunch at once" if at_once else "relaunch after 5s")
    assert "network" in rs[4].reason and "max_relaunches.network=4" in rs[4].reason


def test_the_backoff_starts_over_once_old_crashes_are_forgotten() -> None:
    rules = Rules(policy(**{"crash.forget_after_s": 3600.0}))
    log = "RuntimeError: Connection reset by peer"
    waits = [rules.on_finding(crash(log, 100 * i), t).backoff_s
             for i, t in enumerate((0.0, 60.0, 7200.0), 1)]
    assert waits == [0.0, 5.0, 0.0]


def test_deterministic_crash_stops() -> None:
    rules = Rules(policy(**{"crash.max_relaunches.user_code": 5}))
    log = "Traceback (most recent call last):\nZeroDivisionError: division by zero"
    first = classify(1, None, log, 1200)
    assert rules.on_finding(first.to_finding(), 0.0).action is Action.RELAUNCH
    second = classify(1, None, log, 1200, [first.key()])
    r = rules.on_finding(second.to_finding(), 30.0)
    assert r.action is Action.STOP and "deterministic" in r.reason


def test_user_code_crash_stops_at_once_by_default() -> None:
    r = Rules(policy()).on_finding(crash("Traceback (most recent call last):\nKeyError: 'x'",
                                         5), 0.0)
    assert r.action is Action.STOP


def test_numerical_crash_rolls_back() -> None:
    r = Rules(policy()).on_finding(crash("FloatingPointError: loss is nan", 300), 0.0)
    assert r.action is Action.ROLLBACK and r.lr_scale == 0.5 and r.backoff_s == 0.0


def test_state_round_trip_through_json_changes_nothing() -> None:
    pol = policy()
    a, b = Rules(pol), Rules(pol)
    stream = [finding(step=s, cursor=s, onset=s - 3) for s in (1000, 1010, 1100)] + [
        finding(Incident.NONFINITE, step=s) for s in (2000, 2001)] + [
        crash("Connection reset by peer", 3000)]
    for i, f in enumerate(stream):
        ra = a.on_finding(f, float(i))
        b.load_state_dict(json.loads(json.dumps(b.state_dict())))
        rb = b.on_finding(f, float(i))
        assert ra == rb


def test_sdc_rollback_skips_no_data_and_keeps_the_lr_then_stops() -> None:
    rules = Rules(policy())
    sdc = Incident.SDC
    first = rules.on_finding(finding(sdc, step=500, onset=401, cursor=401), 0.0)
    assert first.action is Action.ROLLBACK
    assert (first.skip_before, first.skip_after, first.lr_scale) == (0, 0, 1.0)
    assert "no batches skipped" in first.reason and "LR kept" in first.reason
    # It leaves no skip region behind: a loss spike there later is a first offence.
    spike = rules.on_finding(finding(step=520, onset=405, cursor=405), 10.0)
    assert (spike.skip_before, spike.skip_after, spike.lr_scale) == (10, 50, 0.5)
    assert rules.on_finding(finding(sdc, step=600, onset=501), 20.0).action is Action.STOP


def test_a_gpu_fault_rolls_back_to_before_the_last_clean_look_keeping_data_and_lr() -> None:
    rules = Rules(policy())
    first = rules.on_finding(finding(Incident.GPU_FAULT, step=500, onset=401, cursor=401), 0.0)
    assert first.action is Action.ROLLBACK
    assert (first.skip_before, first.skip_after, first.lr_scale) == (0, 0, 1.0)
    assert "a GPU fault is the machine's" in first.reason and "LR kept" in first.reason
    assert rules.on_finding(finding(Incident.GPU_FAULT, step=600, onset=501), 20.0).action \
        is Action.STOP


def test_rank_departure_alerts_with_a_cooldown() -> None:
    rules = Rules(policy())
    rd = Incident.RANK_DEPARTURE
    warn = Severity.WARNING
    assert rules.on_finding(finding(rd, severity=warn), 0.0).action is Action.ALERT
    assert rules.on_finding(finding(rd, severity=warn), 300.0).action is Action.IGNORE
    assert rules.on_finding(finding(rd, severity=warn), 700.0).action is Action.ALERT
