"""A fault costs one step: just-in-time state from the ranks that still hold it, for real.

Real torchrun jobs of ``tests/workers/tiny_train.py`` (dropout, Adam, StepLR: a resume is exact
only if the weights, the optimizer, the scheduler, every rank's random streams and the data
cursor all come back), checkpoints every 50 steps, faults between them:

- DDP, 2 ranks: rank 1 dies of SIGSEGV before step 70 (rank 0's gloo all-reduce fails at once;
  it holds on at its uncaught exception while torchrun would SIGTERM it), then in the next
  attempt rank 1 is SIGSTOPped before step 120 (a hang; the stopped rank is never asked).
  Each relaunch resumes at the step the fault interrupted, not at 50 or 100, and the run ends
  bit-exact with a run without faults: rank 1's random streams came from its mark each time.
- FSDP2, 2 ranks (each holds half of every layer): a hang where both processes live resumes at
  the hung step; a SIGSTOPped rank's shard cannot be written, and a rank hung inside
  ``optimizer.step()`` holds a half-updated shard: both fall back to the newest checkpoint and
  say why. Every resume is bit-exact, so the run ends where an uninterrupted one does.

A loader deadlocked on one batch is ``test_cause.py``'s (skipped from the step it struck in:
nothing else replayed); a lost node's ``test_multinode.py``'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.conftest import FAST_POLICY, babysat, journal, read_jsonl, run_babysit

pytestmark = pytest.mark.e2e

STEPS = 160
ARGS = ("--steps", str(STEPS), "--eval-every", "80", "--step-sleep", "0.01")
SAVES = "{every_steps: 50, probation_steps: 5, async_save: true}"
NO_STANDBY = "  warm_standby: false\n"
"""For the reference runs, which never relaunch."""


def losses(run_dir: Path) -> dict[tuple[int, int], list[float]]:
    """(attempt, step) -> every rank's loss."""
    return {(m["attempt"], m["step"]): m["loss_per_rank"]
            for m in read_jsonl(run_dir / "metrics.jsonl")}


def evals(run_dir: Path) -> dict[int, float]:
    """Rank 0's held-out loss by step (the last attempt's, where several reported one)."""
    return {e["data"]["step"]: e["data"]["values"]["eval_loss"]
            for e in journal(run_dir, "worker_scalars") if e["rank"] == 0}


def reference(tmp: Path, *extra: str, nproc: int = 2) -> tuple[dict[int, float], dict[int, Any]]:
    result, run_dir = babysat(tmp, "clean", *ARGS, *extra, nproc=nproc, checkpoints=SAVES,
                              launch_extra=NO_STANDBY)
    assert result.returncode == 0, result.stdout + result.stderr
    return evals(run_dir), {s: loss for (_, s), loss in losses(run_dir).items()}


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[int, float], dict[int, Any]]:
    """A DDP run without faults: its evaluations and every step's losses."""
    return reference(tmp_path_factory.mktemp("clean"))


def assert_replayed_exactly(run_dir: Path, clean: tuple[dict[int, float], dict[int, Any]]
                            ) -> None:
    """Every step of every attempt, and the final evaluation, equal the clean run's, bit for
    bit."""
    clean_evals, clean_losses = clean
    for (attempt, step), loss in losses(run_dir).items():
        assert loss == clean_losses[step], (attempt, step)
    assert evals(run_dir)[STEPS] == clean_evals[STEPS]


def test_a_crash_and_a_stopped_rank_each_cost_one_step_and_the_run_ends_bit_exact(
        tmp_path: Path, clean: tuple[dict[int, float], dict[int, Any]]) -> None:
    result, run_dir = babysat(tmp_path, "faults", *ARGS, "--at", "0:1:70:SIGSEGV",
                              "--at", "1:1:120:SIGSTOP", checkpoints=SAVES)
    assert result.returncode == 0, result.stdout + result.stderr
    findings = [(e["finding"]["incident"], e["finding"]["ranks"], e["remedy"]["action"])
                for e in journal(run_dir, "finding")]
    assert findings == [("crash", [1], "relaunch"), ("hang", [1], "relaunch")], findings

    # Each fault: rank 0, alive, wrote the state of the last step it completed; rank 1 (dead,
    # then stopped) was never asked, and its random streams came from its mark.
    saved = journal(run_dir, "just_in_time")
    assert [(e["fault"], e["outcome"], e["step"], e["writers"], e["marks"], e["streams_lost"])
            for e in saved] == [("crash", "saved", 69, [0], [1], []),
                                ("hang", "saved", 119, [0], [1], [])]
    # The relaunches resumed there: one step lost each, not everything since step 50 or 100.
    resumes = [e for e in journal(run_dir, "resume") if e.get("from")]
    assert [(e["checkpoint_step"], e["verdict"]) for e in resumes] == [(69, "pending"),
                                                                       (119, "pending")]
    assert [e["just_in_time"]["lost_steps"] for e in resumes] == [1, 1]
    assert [e["just_in_time"]["periodic_step"] for e in resumes] == [50, 100]
    assert resumes[1]["summary"] == (
        "resumed from the just-in-time state of step 119, written by rank 0 after the hang "
        "(1 step lost; the newest checkpoint was of step 100)")
    starts = {a: min(s for (b, s) in losses(run_dir) if b == a) for a in (1, 2)}
    assert starts == {1: 70, 2: 120}
    assert "babysit: just-in-time state of step 69 written by rank 0 after the crash" \
        in result.stdout
    assert "babysit: resumed from the just-in-time state of step 119" in result.stdout
    # Trusted like any checkpoint, no more: each resume was checked and took, and the ranks
    # that held on at their end (rank 0 at its gloo error, then at torchrun's SIGTERM) said so.
    checks = journal(run_dir, "resume_check")
    assert checks and all(e["data"]["took"] for e in checks)
    assert journal(run_dir, "worker_holding")
    assert_replayed_exactly(run_dir, clean)
    status = run_babysit("status", str(run_dir), cwd=tmp_path, timeout=60)
    assert "resume step 119 (just-in-time state)" in status.stdout, status.stdout


@pytest.fixture(scope="module")
def clean_fsdp(tmp_path_factory: pytest.TempPathFactory
               ) -> tuple[dict[int, float], dict[int, Any]]:
    """An FSDP2 run without faults."""
    return reference(tmp_path_factory.mktemp("clean_fsdp"), "--fsdp")


def test_fsdp2_keeps_the_step_when_every_shard_lives_and_says_why_when_one_does_not(
        tmp_path: Path, clean_fsdp: tuple[dict[int, float], dict[int, Any]]) -> None:
    # Three hangs on rank 1: the default hang ladder stops at the third; relaunch all three.
    policy = (f"{{name: {FAST_POLICY}, overrides: "
              "{incidents: {hang: {ladder: [relaunch, relaunch, relaunch, stop]}}}}")
    result, run_dir = babysat(tmp_path, "fsdp", *ARGS, "--fsdp", "--at", "0:1:30:hang",
                              "--at", "1:1:60:SIGSTOP", "--at", "2:1:80:optimizer-hang",
                              checkpoints=SAVES, policy=policy)
    assert result.returncode == 0, result.stdout + result.stderr
    hangs = [e["finding"]["ranks"] for e in journal(run_dir, "finding")
             if e["finding"]["incident"] == "hang"]
    assert hangs == [[1], [1], [1]]
    first, stopped, half = journal(run_dir, "just_in_time")
    # Both shards live: each rank wrote its half, and the relaunch resumed at the hung step.
    assert (first["outcome"], first["step"], first["writers"]) == ("saved", 29, [0, 1])
    # Rank 1 SIGSTOPped holds its shard where nobody can read it.
    assert stopped["outcome"] == "none" and stopped["step"] == 59
    assert "shard 1 of the sharded state has no live holder" in stopped["why"]
    assert "rank 1 is stopped (SIGSTOP)" in stopped["why"]
    # Rank 1 hung half-way through optimizer.step(): its shard is neither step's.
    assert half["outcome"] == "none" and "inside optimizer.step()" in half["why"]
    resumes = [e["checkpoint_step"] for e in journal(run_dir, "resume") if e.get("from")]
    assert resumes == [29, 50, 50]
    assert "no just-in-time state after the hang: shard 1" in result.stdout
    assert_replayed_exactly(run_dir, clean_fsdp)
