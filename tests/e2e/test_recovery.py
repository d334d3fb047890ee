"""Recovery end to end: a fault injected at a rank and step of a real 2-rank gloo job, and babysit
detecting it, acting as the policy says, and the run finishing.

The job is ``tests/workers/tiny_train.py`` (dropout, Adam, StepLR, a seekable loader), so a
resume is exact only if weights, optimizer, scheduler, RNG streams and the data cursor all
come back.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

import psutil
import pytest

from tests.conftest import FAST_POLICY, WORKERS, babysat, journal, read_jsonl, run_babysit

pytestmark = pytest.mark.e2e

def losses(run_dir: Path, attempt: int) -> dict[int, list[float]]:
    return {m["step"]: m["loss_per_rank"] for m in read_jsonl(run_dir / "metrics.jsonl")
            if m["attempt"] == attempt}


def test_relaunch_after_a_crash_resumes_bit_exact(tmp_path: Path) -> None:
    clean, clean_dir = babysat(tmp_path, "clean", "--steps", "24")
    assert clean.returncode == 0, clean.stdout + clean.stderr
    # The crashed run saves asynchronously, the clean one synchronously: same checkpoints.
    # Rank 0 is SIGKILLed, as the OOM killer would, under the default crash policy. Without
    # just-in-time state (tests/e2e/test_just_in_time.py has it) the relaunch resumes from the
    # newest committed checkpoint.
    crashed, run_dir = babysat(tmp_path, "crashed", "--steps", "24", "--at", "0:0:13:SIGKILL",
                               checkpoints="{every_steps: 5, probation_steps: 5, async_save: true, "
                                           "just_in_time: false}")
    assert crashed.returncode == 0, crashed.stdout + crashed.stderr
    (crash,) = [e["finding"] for e in journal(run_dir, "finding")
                if e["finding"]["incident"] == "crash"]
    # Whatever DCP's checkpoint process printed when its parent died, a SIGKILL is no bug in
    # the script: relaunched, not stopped as user code.
    assert crash["evidence"]["class"] == "signal" and crash["ranks"] == [0], crash
    assert_resumed_bit_exact(run_dir, clean_dir, last_step=24)


def assert_resumed_bit_exact(run_dir: Path, clean_dir: Path, last_step: int,
                             starts: tuple[int, ...] = (5, 10)) -> None:
    """Attempt 1 of ``run_dir`` resumed from a checkpoint at one of ``starts`` and replayed
    every step after it with the same losses on every rank, bit for bit, as the clean run."""
    (resume,) = [e for e in journal(run_dir, "resume") if e.get("from")]
    # By default the newest *committed* checkpoint: the async save of step 10 may still be
    # writing when rank 0 crashes three steps later, and then step 5 is the one to trust.
    start = resume["checkpoint_step"]
    assert start in starts and resume["cursor"] == start
    after = losses(run_dir, attempt=1)
    assert sorted(after) == list(range(start + 1, last_step + 1))
    reference = losses(clean_dir, attempt=0)
    assert {s: reference[s] for s in after} == after


def user_folder(at: Path) -> Path:
    """A training folder with its own ``checkpoints.py`` and ``policies/`` package (common names:
    babysit once installed top-level packages called that), each a trap if babysit uses it.
    Returns its ``train.py``: the test worker, after checking it imports the user's own."""
    at.mkdir()
    (at / "checkpoints.py").write_text(
        "OWNER = 'user'\n\n\ndef save(*args, **kwargs):\n"
        "    raise RuntimeError(\"babysit called the user's checkpoints.save\")\n\n\n"
        "def load(*args, **kwargs):\n"
        "    raise RuntimeError(\"babysit called the user's checkpoints.load\")\n")
    (at / "policies").mkdir()
    (at / "policies" / "__init__.py").write_text(
        "OWNER = 'user'\n\n\ndef __getattr__(name):\n"
        "    raise AttributeError(f\"the user's policies package has no {name}\")\n")
    train = at / "train.py"
    train.write_text("import checkpoints\nimport policies\n\n"
                     "assert checkpoints.OWNER == policies.OWNER == 'user'\n"
                     + (WORKERS / "tiny_train.py").read_text())
    return train


def test_loss_spike_rolls_back_skips_the_bad_batches_and_lowers_the_lr(tmp_path: Path) -> None:
    # From a folder whose own checkpoints.py and policies/ must not meet babysit's.
    script = user_folder(tmp_path / "project")
    # Checkpoints every 20 steps, as a real job's are sparser than the 10 batches skipped before
    # a spike's onset: the rerun's own save at the skip range's start pays.
    result, run_dir = babysat(tmp_path, "spike", "--steps", "70", "--spike", "35:50",
                              script=script,
                              checkpoints="{every_steps: 20, probation_steps: 5, "
                                          "async_save: false}")
    assert result.returncode == 0, result.stdout + result.stderr
    asked, data = (e for e in journal(run_dir, "finding") if e["remedy"]["action"] == "rollback")
    assert asked["finding"]["incident"] in ("loss_spike", "grad_spike")
    # First the same steps again, nothing skipped and the LR kept: whose fault is it?
    assert asked["finding"]["evidence"]["rerun"] == "asked"
    rerun_launch, launch = journal(run_dir, "launch")[1:]
    assert rerun_launch["directive"]["skip"] == [] and rerun_launch["directive"]["lr_scale"] == 1
    # Back at the same batches: the data's.
    (verdict,) = journal(run_dir, "rerun")
    assert verdict["verdict"] == "reproduced" and verdict["batches"][0] <= 35
    assert data["finding"]["evidence"]["rerun"] == "reproduced"
    assert data["remedy"]["reason"].startswith(verdict["summary"])
    # The rerun from the newest good checkpoint strictly before the onset (36: batch 35 is the
    # first poisoned), told to save where the data's rollback would skip from; the data's
    # rollback resumes from that save: the rerun's steps up to it are not trained a third time.
    first, resume = journal(run_dir, "resume")
    assert first["verdict"] == "good" and first["checkpoint_step"] == 20
    directive = launch["directive"]
    assert directive["lr_scale"] == 0.5
    (skip,) = directive["skip"]
    assert skip["start"] <= 35 and skip["end"] >= 50  # the whole poisoned stretch
    assert rerun_launch["directive"]["save_at"] == skip["start"] > first["cursor"]
    assert resume["cursor"] == skip["start"]
    assert resume["checkpoint_step"] > first["checkpoint_step"]
    assert resume["replayed"].startswith(
        f"replayed by the rerun of steps {first['checkpoint_step'] + 1}-")
    assert [e["attempt"] for e in journal(run_dir, "checkpoint_saved")
            if e["checkpoint_step"] == resume["checkpoint_step"]][-1] == 1  # the rerun's save
    # The relaunched attempt never trained on a poisoned batch and finished healthy.
    rows = read_jsonl(run_dir / "metrics.jsonl")
    attempt1 = [m for m in rows if m["attempt"] == 2]
    assert attempt1[0]["step"] == resume["checkpoint_step"] + 1
    assert all(not (35 < m["cursor"] <= 50) for m in attempt1)
    healthy = max(m["loss"] for m in rows if m["attempt"] == 0 and 25 <= m["step"] <= 35)
    assert max(m["loss"] for m in attempt1[-10:]) < 3 * healthy
    assert read_jsonl(run_dir / "events.jsonl")[-1]["state"] == "succeeded"


def test_hang_names_the_stuck_rank_from_its_stack_and_relaunches(tmp_path: Path) -> None:
    # One run, three faults (the goodput ledger's real run): attempt 0 hangs at step 15,
    # attempt 1 meets poisoned batches 22-25 and rolls back, attempt 2 is killed at step 33
    # and relaunched after a backoff (the first crash waits here, so the ledger has one).
    # (The spike's rollback skips at once: no rerun first, tests/e2e/test_cause.py has those.)
    result, run_dir = babysat(tmp_path, "hang", "--steps", "40", "--hang", "1:15",
                              "--spike", "22:26", "--at", "2:0:33:SIGKILL",
                              policy=f"{{name: {FAST_POLICY}, overrides: "
                                     "{crash: {first_relaunch_at_once: false}, "
                                     "rollback: {rerun_max_steps: 0}}}")
    assert result.returncode == 0, result.stdout + result.stderr
    # Telemetry alone cannot tell them apart (both last reported step 14); the stacks can.
    (diagnosis,) = journal(run_dir, "hang_diagnosis")
    assert diagnosis["suspects"] == [1] and "outside" in diagnosis["reason"]
    finding = next(e for e in journal(run_dir, "finding") if e["finding"]["incident"] == "hang")
    assert finding["finding"]["ranks"] == [1]
    assert finding["remedy"]["action"] == "relaunch"
    record = next(e for e in journal(run_dir, "incident") if e["incident"] == "hang")
    folder = Path(record["dir"])
    assert "rank 1" in (folder / "summary.txt").read_text()
    assert "tiny_train.py" in (folder / "stacks" / "rank1.txt").read_text()
    # The hang's relaunch resumed from the state the ranks held of the last step they
    # completed (14: rank 1 stopped before step 15), not from the checkpoint of step 10.
    resumes = [e for e in journal(run_dir, "resume") if e.get("from")]
    assert resumes[0]["checkpoint_step"] == 14 and resumes[0]["just_in_time"]["writers"] == [0]
    assert read_jsonl(run_dir / "events.jsonl")[-1]["state"] == "succeeded"
    # Replacing an attempt (the hang, the rollback) kills torchrun once its ranks are gone
    # rather than waiting out its own shutdown.
    assert [e["exit_code"] for e in journal(run_dir, "workers_stopped")] == [-9, -9]
    assert_goodput_ledger(run_dir, result.stdout)


def assert_goodput_ledger(run_dir: Path, stdout: str) -> None:
    """The ledger of a real run with a hang, a rollback and a crash: every fault's cost is in
    its category, and the categories sum to the wall time."""
    remedies = [(e["attempt"], e["finding"]["incident"], e["remedy"]["action"])
                for e in journal(run_dir, "finding")
                if e["remedy"]["action"] not in ("ignore", "alert")]  # a loaded machine's alerts
    assert [r[2] for r in remedies] == ["relaunch", "rollback", "relaunch"], remedies
    assert remedies[2][1] == "crash"
    status = run_babysit("status", "--json", str(run_dir), cwd=run_dir, timeout=60)
    ledger = json.loads(status.stdout)["goodput"]
    seconds, wall = ledger["seconds"], ledger["wall_s"]
    assert abs(sum(seconds.values()) - wall) < 0.01, ledger
    assert sum(a["wall_s"] for a in ledger["attempts"]) == pytest.approx(wall, abs=0.01)
    (started,) = journal(run_dir, "run_started")
    (finished,) = journal(run_dir, "run_finished")
    assert wall == pytest.approx(finished["time"] - started["time"], abs=0.01)
    by_attempt = {a["attempt"]: a["seconds"] for a in ledger["attempts"]}
    assert by_attempt[0]["detection"] >= 2.5  # the hang: at least most of its 3 s floor
    # The hang and the crash lost nothing the ranks had completed (just-in-time state: only
    # the step they interrupted); the spike's rollback went back before its onset, and below
    # the hang's step when the checkpoints after it were too near the onset to trust: then
    # the first attempt's steps above it are trained again, lost to the rollback.
    hang_step, rollback_step = [e["checkpoint_step"] for e in journal(run_dir, "resume")
                                if e.get("from")][:2]
    assert (by_attempt[0]["lost"] == 0) == (rollback_step >= hang_step), (by_attempt, rollback_step)
    assert by_attempt[1]["lost"] > 0 and by_attempt[2]["lost"] == 0
    for category in ("productive", "startup", "checkpoint", "relaunch", "backoff"):
        assert seconds[category] > 0, (category, ledger)
    assert all(by_attempt[a]["restore"] > 0 for a in (1, 2, 3))  # each resumed: a load
    assert seconds["other"] < 0.01 * wall
    # The supervisor's own (live) ledger, in its last words, tells the same story.
    live = re.search(r"Goodput ([0-9.]+)% of", stdout)
    assert live, stdout[-2000:]
    assert float(live.group(1)) == pytest.approx(100 * ledger["goodput"], abs=2.0)


def test_a_crash_relaunches_through_the_warm_standby(tmp_path: Path) -> None:
    # Long enough (steps of 0.05 s) for the warm standby to start (5 s after the first step)
    # before the crash, and, in attempt 1, another for an attempt 2 that never comes.
    result, run_dir = babysat(tmp_path, "warm", "--steps", "280", "--step-sleep", "0.05",
                              "--at", "0:1:130:SIGKILL", launch_extra="  max_restarts: 1\n")
    assert result.returncode == 0, result.stdout + result.stderr
    (crash,) = [e for e in journal(run_dir, "finding") if e["finding"]["incident"] == "crash"]
    assert crash["remedy"]["action"] == "relaunch"
    started = {e["for_attempt"]: e for e in journal(run_dir, "standby_started")}
    last = max(m["time"] for m in read_jsonl(run_dir / "metrics.jsonl") if m["attempt"] == 0)
    assert started[1]["time"] < last  # attempt 1's ranks were started before the fault
    launch = {e["attempt"]: e for e in journal(run_dir, "launch")}
    assert launch[0]["standby"] is False
    assert launch[1]["standby"] is True and launch[1]["pid"] == started[1]["pid"]
    assert len([e for e in journal(run_dir, "worker_hello") if e["attempt"] == 1]) == 2
    assert read_jsonl(run_dir / "events.jsonl")[-1]["state"] == "succeeded"
    # Promoted, it resumed exactly as a cold start does: the steps it replays after the
    # checkpoint are attempt 0's, bit for bit, on every rank.
    (resume,) = [e for e in journal(run_dir, "resume") if e.get("from")]
    start = resume["checkpoint_step"]
    before, after = losses(run_dir, attempt=0), losses(run_dir, attempt=1)
    assert start >= 120 and sorted(after) == list(range(start + 1, 281))
    assert {s: after[s] for s in range(start + 1, 130)} == \
        {s: before[s] for s in range(start + 1, 130)}
    # The standby for attempt 2 went as soon as every rank had closed its run, while they were
    # still exiting, not after.
    (stopped,) = journal(run_dir, "standby_stopped")
    assert stopped["for_attempt"] == 2 and stopped["reason"] == "every rank closed its run"
    final = max(m["time"] for m in read_jsonl(run_dir / "metrics.jsonl"))
    (ended,) = [e for e in journal(run_dir, "state") if e["new"] == "succeeded"]
    assert final <= stopped["time"] <= ended["time"]
    # Nothing of the run outlives it (tests/e2e/test_standby.py: an unpromoted one).
    assert leftovers(run_dir) == []


def leftovers(run_dir: Path) -> list[list[str]]:
    """The command lines of live processes started for ``run_dir``'s attempts."""
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.environ().get("BABYSIT_RUN_DIR") == str(run_dir):
                found.append(proc.cmdline())
    return found


def test_straggler_is_named_and_alerted(tmp_path: Path) -> None:
    result, run_dir = babysat(tmp_path, "slow", "--steps", "40", "--slow-data", "1:0.08",
                              launch_extra="  warm_standby: false\n")
    assert result.returncode == 0, result.stdout + result.stderr
    launch = journal(run_dir, "launch")[0]  # the journal says why relaunches would be cold
    assert launch["standby"] is False and launch["standby_off"] == "launch.warm_standby is false"
    assert "relaunches will start cold" not in result.stdout  # the user's own choice
    finding = next(e for e in journal(run_dir, "finding")
                   if e["finding"]["incident"] == "straggler")
    assert finding["finding"]["ranks"] == [1] and finding["remedy"]["action"] == "alert"
    # An alert, not a relaunch. (gloo in torch 2.13 sometimes aborts a rank in its teardown
    # before its peer closed: that crash, at the last step, may relaunch; never the straggler.)
    acted = [e["finding"]["incident"] for e in journal(run_dir, "finding")
             if e["remedy"]["action"] != "alert"]
    assert set(acted) <= {"crash"}, acted
    assert len(journal(run_dir, "launch")) == 1 + len(acted)
    assert "rank 1" in result.stdout
    # No standby: the next attempt's torchrun was started ahead, and stopped with the run.
    assert leftovers(run_dir) == []


def test_bring_your_own_checkpoint_is_registered_and_resumed(tmp_path: Path) -> None:
    result, run_dir = babysat(tmp_path, "byo", "--steps", "20", "--crash", "1:13",
                              checkpoints="{every_steps: 0, probation_steps: 5}",
                              launch_extra="  max_restarts: 1\n",
                              script=WORKERS / "byo_train.py")
    assert result.returncode == 0, result.stdout + result.stderr
    saved = [e for e in journal(run_dir, "checkpoint_saved")]
    assert [e["checkpoint_step"] for e in saved] == [5, 10, 15, 20] and \
        saved[0]["data"]["external"]
    (resume,) = [e for e in journal(run_dir, "resume") if e.get("from")]
    assert resume["checkpoint_step"] == 10 and resume["cursor"] == 10
    # The script loaded its own file (babysit only told it which), and went on from step 11.
    assert "[r0] loaded my checkpoint of step 10" in result.stdout
    assert min(losses(run_dir, attempt=1)) == 11


def test_a_spike_with_no_checkpoint_to_go_back_to_is_alerted_not_restarted(
        tmp_path: Path) -> None:
    # torchrun-style, checkpoints turned off: rolling back would restart from scratch.
    run_dir = tmp_path / "nockpt"
    result = run_babysit("run", "--nproc-per-node", "2", "--checkpoint-every", "0",
                         "--run-dir", str(run_dir), "--policy", str(FAST_POLICY),
                         str(WORKERS / "tiny_train.py"), "--steps", "40", "--spike", "20:40",
                         cwd=tmp_path, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    spikes = [e for e in journal(run_dir, "finding")
              if e["finding"]["incident"] in ("loss_spike", "grad_spike")
              and "no good checkpoint" in e["remedy"]["reason"]]
    assert spikes and all(e["remedy"]["action"] == "alert" for e in spikes)
    assert len(journal(run_dir, "launch")) == 1  # never relaunched
