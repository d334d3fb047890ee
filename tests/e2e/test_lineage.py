"""Faults in sequence in one real run, and state kept without being asked.

A run meets faults one after another, and a kept state is named by its timeline and its step
(``checkpoints/lineage.py``): after a rollback the run's memory copies are its new timeline's,
and the crash after it resumes from one of them, never from a state the rollback abandoned.
And a config that says nothing of checkpoints keeps state anyway (``checkpoints.every_steps:
auto``), so a crashed rank costs its step, not the run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import (
    FAST_POLICY,
    WORKERS,
    babysat,
    journal,
    read_jsonl,
    run_babysit,
    take_over,
)

pytestmark = pytest.mark.e2e

STEPS = 90
ARGS = ("--fsdp", "--steps", str(STEPS), "--step-sleep", "0.02", "--spike", "60:63",
        "--eval-every", "45")
SAVES = "{every_steps: 40, probation_steps: 5, async_save: false, memory_every_steps: 5}"
POLICY = f"{{name: {FAST_POLICY}, overrides: {{rollback: {{rerun_max_steps: 0}}}}}}"
"""The spike's rollback skips its batches at once (no rerun first: tests/e2e/test_cause.py)."""


def _losses(run_dir: Path) -> dict[int, list[float]]:
    """Each step's losses as the run's last attempt to train it left them."""
    return {m["step"]: m["loss_per_rank"] for m in read_jsonl(run_dir / "metrics.jsonl")}


def test_spike_rollback_then_a_dead_fsdp2_rank_resumes_from_the_new_timelines_copy(
        tmp_path: Path) -> None:
    reference, ref_dir = babysat(tmp_path, "rollback-only", *ARGS, checkpoints=SAVES,
                                 policy=POLICY, launch_extra="  warm_standby: false\n")
    assert reference.returncode == 0, reference.stdout + reference.stderr
    # The same run, and after the rollback rank 1 dies of SIGSEGV before step 78.
    result, run_dir = babysat(tmp_path, "then-crash", *ARGS, "--at", "1:1:78:SIGSEGV",
                              checkpoints=SAVES, policy=POLICY)
    assert result.returncode == 0, result.stdout + result.stderr

    timelines = {e["attempt"]: e for e in journal(run_dir, "timeline")}
    resumes = {e["attempt"]: e for e in journal(run_dir, "resume") if e.get("from")}
    [spike] = [e for e in journal(run_dir, "finding") if e["remedy"]["action"] == "rollback"]
    assert spike["attempt"] == 0
    # The rollback went back before the spike, and began a timeline forked there.
    target = resumes[1]["checkpoint_step"]
    assert target < 61 and timelines[1]["fork_step"] == target
    assert timelines[1]["parent"] == timelines[0]["timeline"]
    # The crash's relaunch resumed from a memory copy the new timeline made, at the crash
    # minus K (5) or later: the abandoned timeline's copies of 60-75 were never a candidate.
    crashed = resumes[2]
    assert crashed["origin"] == "memory", crashed
    assert crashed["timeline"] == timelines[1]["timeline"]
    assert 77 - 5 <= crashed["checkpoint_step"] <= 77
    assert timelines[2]["parent"] == timelines[1]["timeline"]
    refused = journal(run_dir, "checkpoint_refused")
    assert not refused, refused
    # What the abandoned timeline kept was fenced and swept, first of all.
    assert any(s > target for s in timelines[1]["fenced_steps"])
    # Bit for bit the rollback-only run: every step, and the held-out loss.
    losses, expected = _losses(run_dir), _losses(ref_dir)
    assert all(losses[s] == expected[s] for s in expected)
    evals = [[e["data"]["values"]["eval_loss"] for e in journal(d, "worker_scalars")
              if e["data"]["step"] == STEPS][-1] for d in (run_dir, ref_dir)]
    assert evals[0] == evals[1]


def test_a_config_without_checkpoints_keeps_state_and_a_crash_costs_its_step(
        tmp_path: Path) -> None:
    """As a user writes a config (no checkpoints section), a rank segfaults at step 40; then,
    as the relaunch's ranks load that step's state, a rank dies inside the load. The next
    attempt loads the same state again (a load that never finished made no state of its own),
    and the run ends bit for bit as the clean one."""
    def run(name: str, *faults: str) -> tuple[str, Path]:
        run_dir = tmp_path / name
        config = tmp_path / f"{name}.yaml"
        args = ["--ddp", "--steps", "60", "--step-sleep", "0.02", *faults]
        launch = "  warm_standby: false\n"  # the directive a rank reads is its attempt's
        # As a user writes it: no checkpoints section at all.
        config.write_text(f"launch:\n  script: {WORKERS / 'tiny_train.py'}\n"
                          f"  nproc-per-node: 2\n  args: {json.dumps(args)}\n{launch}"
                          f"run_dir: {run_dir}\npolicy: {{name: {FAST_POLICY}}}\n")
        done = run_babysit("run", str(config), cwd=tmp_path, timeout=240)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout, run_dir

    clean_out, clean_dir = run("clean")
    out, run_dir = run("crash", "--at", "0:1:40:SIGSEGV", "--die-in-load", "1:1")
    # Said at the start, in one plain line.
    for console in (clean_out, out):
        assert console.count("babysit: keeping a checkpoint every 100 steps, then as this "
                             "run's costs advise, the last completed step after a fault") == 1
    # The rank died before step 40: the survivors wrote step 39, and the run went on from it,
    # twice: the first relaunch died as it loaded, and the second took the same state.
    resumes = [e for e in journal(run_dir, "resume") if e.get("from")]
    assert [(e["attempt"], e["origin"], e["checkpoint_step"]) for e in resumes] == [
        (1, "just_in_time", 39), (2, "just_in_time", 39)]
    timelines = {e["attempt"]: e for e in journal(run_dir, "timeline")}
    assert timelines[2]["parent"] == timelines[0]["timeline"] == resumes[1]["timeline"]
    assert "dies while its resume loads" in out
    crashes = [e for e in journal(run_dir, "finding") if e["finding"]["incident"] == "crash"]
    assert [e["attempt"] for e in crashes] == [0, 1]
    # A rank that died loading trained no batch: nothing is skipped.
    assert all(e["directive"]["skip"] == [] for e in journal(run_dir, "launch"))
    assert "starting from scratch" not in out
    losses, expected = _losses(run_dir), _losses(clean_dir)
    assert all(losses[s] == expected[s] for s in expected)


def test_a_takeover_after_a_rollback_resumes_the_new_timeline_and_its_high_water_mark(
        tmp_path: Path) -> None:
    """Attempt 0 trains past the spike at batches 50-52 and rolls back; babysit is SIGKILLed as
    soon as attempt 1 reports a step (below attempt 0's high-water mark), and its ranks go on
    unwatched to step 70, where they hold until a second ``babysit run`` has taken the run
    over. The
    takeover must stop them, resume from the newest state of attempt 1's timeline, and say it
    watched up to attempt 1's steps, not attempt 0's. (Whether the orphans saved 50 before
    the takeover stopped them, first thing, depends on how soon the second babysit started.)"""
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import babysit_env

    run_dir, config, taken_over = tmp_path / "run", tmp_path / "run.yaml", tmp_path / "taken"
    args = ["--steps", "80", "--step-sleep", "0.1", "--spike", "50:53", "--hold-at", "70",
            "--hold-until", str(taken_over)]
    config.write_text(
        f"launch:\n  script: {WORKERS / 'tiny_train.py'}\n  nproc-per-node: 2\n"
        f"  args: {json.dumps(args)}\n  warm_standby: false\nrun_dir: {run_dir}\n"
        "checkpoints: {every_steps: 10, probation_steps: 5, async_save: false}\n"
        f"policy: {POLICY}\n")
    events = run_dir / "events.jsonl"

    def entries() -> list[dict]:
        return read_jsonl(events) if events.exists() else []

    first = subprocess.Popen([sys.executable, "-m", "babysit", "run", str(config)],
                             cwd=tmp_path, env=babysit_env(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (metrics.exists() and any(
                m["attempt"] == 1 for m in read_jsonl(metrics))):  # attempt 1 trains
            time.sleep(0.05)
        first.send_signal(signal.SIGKILL)
        first.wait(10)
    finally:
        if first.poll() is None:
            first.kill()
    before = entries()
    launches = [i for i, e in enumerate(before) if e["event"] == "launch"]
    assert len(launches) == 2, "attempt 1 never launched"
    high_water_0 = max(e["step"] for e in before[:launches[1]] if isinstance(e.get("step"), int))
    rows = [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl") if m["attempt"] == 1]
    watched = max(rows, default=None)
    timeline_1 = next(e["timeline"] for e in before if e["event"] == "timeline"
                      and e["attempt"] == 1)

    code, out = take_over(config, run_dir, taken_over)  # the ranks go on past step 69
    assert code == 0, out[-6000:]
    journal = entries()
    [takeover] = [e for e in journal if e["event"] == "supervisor_takeover"]
    # The high-water mark of the timeline that ran, not of the one the rollback abandoned.
    resumed_at = before[launches[1]]["directive"]["resume"]["step"]
    assert takeover["watched_until_step"] == (watched if watched is not None else resumed_at)
    assert takeover["watched_until_step"] < high_water_0
    after = journal[journal.index(takeover):]
    resume = next(e for e in after if e["event"] == "resume" and e.get("from"))
    # On attempt 1's chain: a state its ranks saved unwatched, or the one it forked from;
    # never attempt 0's past the fork (its 50, fenced at attempt 1's start and swept).
    fork = next(e for e in before if e["event"] == "timeline" and e["attempt"] == 1)
    assert resume["timeline"] == timeline_1 or (
        resume["timeline"] == fork["parent"]
        and resume["checkpoint_step"] <= fork["fork_step"]), (resume, fork)
    assert journal[-1]["event"] == "run_finished" and journal[-1]["state"] == "succeeded"
    assert max(m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")) == 80


def test_a_config_without_checkpoints_keeps_an_fsdp2_shard_a_dead_rank_held(
        tmp_path: Path) -> None:
    """FSDP2: the dead rank held the only copy of its shard, so the live ranks cannot write the
    step; what babysit kept unasked (``auto``'s memory copies, the first at step 10) resumes the
    run, not step 1."""
    run_dir, config = tmp_path / "run", tmp_path / "run.yaml"
    args = ["--fsdp", "--steps", "40", "--step-sleep", "0.02", "--at", "0:1:30:SIGSEGV"]
    config.write_text(f"launch:\n  script: {WORKERS / 'tiny_train.py'}\n"
                      f"  nproc-per-node: 2\n  args: {json.dumps(args)}\n"
                      f"run_dir: {run_dir}\npolicy: {{name: {FAST_POLICY}}}\n")
    done = run_babysit("run", str(config), cwd=tmp_path, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    [kept] = journal(run_dir, "just_in_time")
    assert kept["outcome"] == "none"  # rank 1 took its shard with it
    [resumed] = [e for e in journal(run_dir, "resume") if e.get("from")]
    assert resumed["origin"] == "memory" and 10 <= resumed["checkpoint_step"] < 30, resumed
    assert "starting from scratch" not in done.stdout
