"""The goodput ledger on hand-built journals: each category from the entries that make it, and
the categories summing to the wall time exactly, however the entries come.

The real run (a rollback, a hang and a crash under ``babysit run``) is asserted in
``tests/e2e/test_recovery.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from babysit.supervisor.services.goodput import CATEGORIES, Ledger, ledger, straggler_excess


def ev(t: float, event: str, attempt: int = 0, **fields: Any) -> dict[str, Any]:
    return {"time": t, "event": event, "attempt": attempt, **fields}


def launch(t: float, attempt: int, resume: int | None = None) -> dict[str, Any]:
    return ev(t, "launch", attempt, directive={
        "attempt": attempt, "resume": {"step": resume, "cursor": resume} if resume else None})


def rows(attempt: int, steps: range, t0: float, dt: float = 1.0,
         **extra: Any) -> list[dict[str, Any]]:
    return [{"step": s, "time": t0 + i * dt, "attempt": attempt, **extra}
            for i, s in enumerate(steps)]


def finding(t: float, incident: str, action: str, attempt: int = 0) -> dict[str, Any]:
    return ev(t, "finding", attempt, finding={"incident": incident},
              remedy={"action": action, "reason": "test"})


def assert_sums(g: Any) -> None:
    assert sum(g.seconds.values()) == pytest.approx(g.wall_s, abs=1e-9)
    assert list(g.seconds) == list(CATEGORIES)
    assert all(v >= -1e-9 for v in g.seconds.values()), g.seconds
    for category in CATEGORIES:
        assert sum(a[category] for a in g.attempts.values()) == \
            pytest.approx(g.seconds[category], abs=1e-9)


def test_a_clean_run_is_startup_steps_checkpoints_and_shutdown() -> None:
    entries = [ev(0.0, "run_started", pid=1), launch(1.0, 0),
               ev(4.0, "worker_hello", rank=0, data={"restore_s": 0.0}),
               ev(7.5, "checkpoint_saved", checkpoint_step=3, rank=0, data={"blocking_s": 0.3}),
               ev(11.0, "state", new="succeeded"), ev(11.5, "run_finished", state="succeeded")]
    g = ledger(entries, rows(0, range(1, 7), t0=5.0))  # steps 1..6 at 5..10 s
    assert_sums(g)
    s = g.seconds
    assert g.wall_s == pytest.approx(11.5)
    assert s["startup"] == pytest.approx(5.0)  # run start -> first step
    assert s["checkpoint"] == pytest.approx(0.3)
    assert s["productive"] == pytest.approx(5.0 - 0.3)
    assert s["shutdown"] == pytest.approx(1.5)
    assert g.goodput == pytest.approx(4.7 / 11.5)


def test_a_rollback_loses_the_re_trained_steps_and_pays_detection_restore_and_relaunch() -> None:
    entries = [ev(0.0, "run_started"), launch(0.0, 0),
               finding(19.5, "loss_spike", "rollback"),
               ev(19.6, "stop_workers", reason="rollback"), ev(20.5, "workers_stopped"),
               launch(21.0, 1, resume=5),
               ev(22.0, "worker_hello", 1, rank=0, data={"restore_s": 0.4}),
               ev(22.0, "worker_hello", 1, rank=1, data={"restore_s": 0.3}),
               ev(27.0, "state", 1, new="succeeded"), ev(27.0, "run_finished", 1)]
    metrics = rows(0, range(1, 11), t0=10.0) + rows(1, range(6, 11), t0=23.0)
    g = ledger(entries, metrics)
    assert_sums(g)
    s = g.seconds
    assert s["startup"] == pytest.approx(10.0)
    assert s["detection"] == pytest.approx(0.5)  # last step (19.0) -> the finding
    assert s["restore"] == pytest.approx(0.4)  # the slowest rank's load
    assert s["relaunch"] == pytest.approx(1.5 + 2.0 - 0.4)  # stop + launch -> first step
    # Attempt 0's steps 6..10 ran for 5 s and were trained again from step 5.
    assert s["lost"] == pytest.approx(5.0)
    assert s["productive"] == pytest.approx(4.0 + 4.0)  # steps 2..5, then 7..10
    assert g.attempts[0]["lost"] == pytest.approx(5.0)
    assert g.attempts[1]["lost"] == 0.0


def test_a_restore_reported_after_the_first_step_still_counts() -> None:
    # The hello (journaled when the supervisor takes it) can trail the first step's row.
    entries = [ev(0.0, "run_started"), launch(0.0, 0), finding(5.5, "hang", "relaunch"),
               launch(6.0, 1, resume=2),
               ev(9.2, "worker_hello", 1, rank=0, data={"restore_s": 0.7}),
               ev(12.0, "run_finished", 1, state="succeeded")]
    g = ledger(entries, rows(0, range(1, 6), t0=1.0) + rows(1, range(3, 6), t0=9.0))
    assert_sums(g)
    assert g.seconds["restore"] == pytest.approx(0.7)
    assert g.attempts[1]["relaunch"] == pytest.approx(3.0 - 0.7)


def test_a_second_rollback_to_an_older_checkpoint_loses_each_step_once() -> None:
    entries = [ev(0.0, "run_started"), launch(0.0, 0), finding(10.5, "hang", "relaunch"),
               launch(11.0, 1, resume=6), finding(16.5, "crash", "relaunch", 1),
               launch(17.0, 2, resume=4), ev(30.0, "run_finished", 2, state="succeeded")]
    metrics = (rows(0, range(1, 11), t0=1.0) + rows(1, range(7, 12), t0=12.0)
               + rows(2, range(5, 13), t0=18.0))
    g = ledger(entries, metrics)
    assert_sums(g)
    # Attempt 0: steps 7..10 lost at the first relaunch, 5..6 at the second; attempt 1:
    # steps 8..11 (its first step, 7, was relaunch time).
    assert g.attempts[0]["lost"] == pytest.approx(6.0)
    assert g.attempts[1]["lost"] == pytest.approx(4.0)
    assert g.seconds["detection"] == pytest.approx(0.5 + 0.5)


def test_a_crash_waits_its_backoff_then_relaunches() -> None:
    entries = [ev(0.0, "run_started"), launch(0.0, 0), finding(6.0, "crash", "relaunch"),
               ev(6.1, "state", new="relaunching"), ev(6.1, "backoff", seconds=2.0),
               launch(8.6, 1, resume=None), ev(12.0, "run_finished", 1, state="succeeded")]
    g = ledger(entries, rows(0, range(1, 6), t0=1.0) + rows(1, range(1, 4), t0=9.0))
    assert_sums(g)
    s = g.seconds
    assert s["detection"] == pytest.approx(1.0)
    assert s["backoff"] == pytest.approx(2.0)
    assert s["relaunch"] == pytest.approx(0.1 + 0.5 + 0.4)  # stopping, tail of the gap, start
    assert s["lost"] == pytest.approx(4.0)  # from scratch: every step of attempt 0
    assert s["shutdown"] == pytest.approx(1.0)


def test_a_killed_supervisor_leaves_babysit_down_until_the_next_one_takes_over() -> None:
    entries = [ev(0.0, "run_started"), launch(0.0, 0),
               ev(30.0, "run_started", 1), launch(31.0, 1, resume=5),
               ev(40.0, "run_finished", 1, state="succeeded")]
    g = ledger(entries, rows(0, range(1, 10), t0=1.0) + rows(1, range(6, 10), t0=33.0))
    assert_sums(g)
    assert g.seconds["down"] == pytest.approx(30.0 - 9.0)  # last row -> the next supervisor
    assert g.seconds["relaunch"] == pytest.approx(3.0)
    assert g.seconds["lost"] == pytest.approx(4.0)
    assert g.wall_s == pytest.approx(40.0)


def test_a_gap_after_a_finished_run_is_not_the_runs_time() -> None:
    entries = [ev(0.0, "run_started"), launch(0.0, 0), ev(5.0, "run_finished", state="failed"),
               ev(100.0, "run_started", 1), launch(100.0, 1),
               ev(105.0, "run_finished", 1, state="succeeded")]
    g = ledger(entries, rows(0, range(1, 4), t0=1.0) + rows(1, range(1, 4), t0=101.0))
    assert_sums(g)
    assert g.wall_s == pytest.approx(10.0) and g.seconds["down"] == 0.0


def test_a_slow_loader_is_stragglers_excess_and_jitter_is_not() -> None:
    slow = {"data_wait_per_rank": [0.001, 0.3, 0.002], "step_time_per_rank": [0.5, 0.5, 0.5]}
    assert straggler_excess(slow) == pytest.approx(0.3 - 0.0015)
    jitter = {"data_wait_per_rank": [0.001, 0.015], "step_time_per_rank": [0.2, 0.21]}
    assert straggler_excess(jitter) == 0.0
    assert straggler_excess({"loss": 1.0}) == 0.0
    # A slow machine under DDP: every rank's step alike, its forward not (a lower bound).
    slow_gpu = {"step_time_per_rank": [0.5, 0.5, 0.5], "data_wait_per_rank": [0.0, 0.0, 0.0],
                "forward_time_per_rank": [0.1, 0.25, 0.1]}
    assert straggler_excess(slow_gpu) == pytest.approx(0.15)
    # A multi-node leader's merged row: the slowest rank's against the median of all.
    merged = {"forward_max": 0.25, "forward_p50": 0.1, "data_wait_max": 0.002,
              "data_wait_p50": 0.001, "compute_max": 0.5, "compute_p50": 0.49}
    assert straggler_excess(merged) == pytest.approx(0.15)
    entries = [ev(0.0, "run_started"), launch(0.0, 0), ev(6.0, "run_finished")]
    g = ledger(entries, rows(0, range(1, 6), t0=1.0, **slow))
    assert_sums(g)
    assert g.seconds["straggler"] == pytest.approx(4 * 0.2985)


def test_live_totals_count_up_to_now_and_a_running_step_is_other() -> None:
    led = Ledger()
    for e in [ev(0.0, "run_started"), launch(0.0, 0)]:
        led.entry(e)
    for r in rows(0, range(1, 4), t0=2.0):
        led.row(r)
    g = led.totals(now=4.5)
    assert_sums(g)
    assert g.wall_s == pytest.approx(4.5)
    assert g.seconds["other"] == pytest.approx(0.5)
    assert g.seconds["productive"] == pytest.approx(2.0)
    led.entry(finding(9.0, "hang", "relaunch"))
    assert led.totals(now=9.0).seconds["detection"] == pytest.approx(5.0)


def test_late_rows_and_unknown_entries_change_nothing() -> None:
    entries = [ev(0.0, "run_started"), launch(0.0, 0), finding(5.5, "hang", "relaunch"),
               ev(5.6, "alert_delivery"), {"event": "launch"}, ev(6.0, "run_finished")]
    metrics = [*rows(0, range(1, 6), t0=1.0), {"step": 6, "time": 5.8, "attempt": 0},
               {"step": "x", "time": 5.9}]
    g = ledger(entries, metrics)
    assert_sums(g)
    assert g.seconds["detection"] == pytest.approx(0.5)


@st.composite
def journals(draw: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]], float]:
    """A random run: attempts of random length that end in random ways, maybe a takeover."""
    t = 0.0
    entries = [ev(t, "run_started")]
    metrics: list[dict[str, Any]] = []
    step = 0
    for attempt in range(draw(st.integers(1, 4))):
        resume = draw(st.integers(0, step)) if attempt else None
        t += draw(st.floats(0.0, 3.0))
        entries.append(launch(t, attempt, resume))
        step = resume or 0
        if draw(st.booleans()):
            entries.append(ev(t + 0.1, "worker_hello", attempt,
                              data={"restore_s": draw(st.floats(0.0, 5.0))}))
        for _ in range(draw(st.integers(0, 6))):
            t += draw(st.floats(0.0, 2.0))
            step += 1
            metrics.append({"step": step, "time": t, "attempt": attempt,
                            "data_wait_per_rank": [0.0, draw(st.floats(0.0, 0.5))],
                            "step_time_per_rank": [0.5, 0.5]})
            if draw(st.booleans()):
                entries.append(ev(t + 0.01, "checkpoint_saved", attempt, checkpoint_step=step,
                                  data={"blocking_s": draw(st.floats(0.0, 3.0))}))
        t += draw(st.floats(0.0, 2.0))
        ending = draw(st.sampled_from(["rollback", "crash", "takeover", "none"]))
        if ending == "rollback":
            entries.append(finding(t, "loss_spike", "rollback", attempt))
        elif ending == "crash":
            entries.append(finding(t, "crash", "relaunch", attempt))
            entries.append(ev(t + 0.1, "backoff", attempt, seconds=draw(st.floats(0, 4))))
        elif ending == "takeover":
            t += draw(st.floats(0.0, 10.0))
            entries.append(ev(t, "run_started", attempt))
    t += draw(st.floats(0.0, 2.0))
    entries += [ev(t, "state", new="succeeded"), ev(t, "run_finished", state="succeeded")]
    entries.sort(key=lambda e: e["time"])
    return entries, metrics, t


@settings(max_examples=200, deadline=None)
@given(journals())
def test_the_categories_always_sum_to_the_wall_time(run: Any) -> None:
    entries, metrics, end = run
    g = ledger(entries, metrics)
    assert_sums(g)
    assert g.wall_s == pytest.approx(end, abs=1e-9)


def test_a_stdout_mode_resume_from_the_scripts_checkpoint_loses_only_the_steps_past_it() -> None:
    """Stdout mode: no babysit checkpoint in the directive; the launch says where the script's
    own checkpoint, put back, resumes it (``script_resume``)."""
    relaunch = launch(11.0, 1)
    relaunch["script_resume"] = {"checkpoint_step": 6}
    entries = [ev(0.0, "run_started"), launch(0.0, 0), finding(10.5, "crash", "relaunch"),
               relaunch, ev(20.0, "run_finished", 1, state="succeeded")]
    g = ledger(entries, rows(0, range(1, 11), t0=1.0) + rows(1, range(7, 14), t0=12.0))
    assert_sums(g)
    assert g.attempts[0]["lost"] == pytest.approx(4.0)  # steps 7..10, not all ten
