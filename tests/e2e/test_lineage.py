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

from tests.conftest import FAST_POLICY, WORKERS, babysat, journal, read_jsonl, run_babysit

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
    def run(name: str, *faults: str) -> tuple[str, Path]:
        run_dir = tmp_path / name
        config = tmp_path / f"{name}.yaml"
        args = ["--ddp", "--steps", "60", "--step-sleep", "0.02", *faults]
        # As a user writes it: no checkpoints section at all.
        config.write_text(f"launch:\n  script: {WORKERS / 'tiny_train.py'}\n"
                          f"  nproc-per-node: 2\n  args: {json.dumps(args)}\n"
                          f"run_dir: {run_dir}\npolicy: {{name: {FAST_POLICY}}}\n")
        done = run_babysit("run", str(config), cwd=tmp_path, timeout=240)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout, run_dir

    clean_out, clean_dir = run("clean")
    out, run_dir = run("crash", "--at", "0:1:40:SIGSEGV")
    # Said at the start, in one plain line.
    for console in (clean_out, out):
        assert console.count("babysit: keeping a checkpoint every 100 steps, then as this "
                             "run's costs advise, the last completed step after a fault") == 1
    # The rank died before step 40: the survivors wrote step 39, and the run went on from it.
    [resumed] = [e for e in journal(run_dir, "resume") if e.get("from")]
    assert resumed["origin"] == "just_in_time" and resumed["checkpoint_step"] == 39
    assert "starting from scratch" not in out
    losses, expected = _losses(run_dir), _losses(clean_dir)
    assert all(losses[s] == expected[s] for s in expected)
