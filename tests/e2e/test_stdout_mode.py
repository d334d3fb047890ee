"""Stdout mode end to end: an unmodified nanoGPT-shaped script under real babysit, torchrun and
gloo, watched only through what it prints."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import (
    FAST_POLICY,
    WORKERS,
    babysat,
    babysit_env,
    journal,
    read_jsonl,
    run_babysit,
)

SCRIPT = WORKERS / "printing_train.py"
try:
    from tensorboard.backend.event_processing import event_accumulator as TENSORBOARD
except ImportError:  # the tensorboard extra is not installed: that check is left out
    TENSORBOARD = None
try:
    from tests import wandb_records as WANDB
except ImportError:  # the wandb extra is not installed: that check is left out
    WANDB = None

pytestmark = pytest.mark.e2e


def _status(run_dir: Path) -> dict | None:
    result = run_babysit("status", "--json", str(run_dir), cwd=run_dir.parent, timeout=30)
    return json.loads(result.stdout) if result.returncode == 0 else None


def _rank_pid(babysit: int, local_rank: int) -> int | None:
    for p in psutil.Process(babysit).children(recursive=True):
        try:
            env = p.environ()
        except psutil.Error:
            continue
        if env.get("LOCAL_RANK") == str(local_rank) and \
                "printing_train.py" in " ".join(p.cmdline()):
            return p.pid
    return None


def test_a_printing_script_shows_progress_and_a_frozen_rank_is_relaunched(
        tmp_path: Path) -> None:
    run_dir = tmp_path / "frozen"
    config = tmp_path / "frozen.yaml"
    config.write_text(
        f"launch:\n  script: {SCRIPT}\n  nproc-per-node: 2\n  stop-grace-s: 2\n"
        f"  args: [--max_iters=80, --sleep=0.03, --out_dir={tmp_path / 'out'}]\n"
        f"run_dir: {run_dir}\npolicy: {{name: {FAST_POLICY}}}\n"
        + ("tensorboard: {enabled: true}\n" if TENSORBOARD else "")
        + ("wandb: {enabled: true, mode: offline, project: frozen}\n" if WANDB else ""))
    env = WANDB.own_dirs(tmp_path, babysit_env()) if WANDB else babysit_env()
    proc = subprocess.Popen([sys.executable, "-m", "babysit", "run", str(config)], cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 90
        metrics = run_dir / "metrics.jsonl"
        while time.monotonic() < deadline and not (
                metrics.exists() and len(metrics.read_text().splitlines()) >= 10):
            time.sleep(0.1)
        pid = _rank_pid(proc.pid, 1)
        assert pid is not None
        psutil.Process(pid).send_signal(signal.SIGSTOP)  # rank 1 freezes; rank 0 waits on it
        status = _status(run_dir)
        assert status and status["step"] >= 10 and status["loss"] is not None, status
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:  # babysit failed to act: leave nothing behind
            for p in psutil.Process(proc.pid).children(recursive=True):
                p.kill()
            proc.kill()
    assert proc.returncode == 0, out
    findings = journal(run_dir, "finding")
    hangs = [f for f in findings if f["finding"]["incident"] == "hang"]
    assert len(hangs) == 1 and hangs[0]["remedy"]["action"] == "relaunch", findings
    assert hangs[0]["finding"]["ranks"] == [1], hangs  # the frozen rank, not the printing one
    # Anything else seen (a slowdown on a loaded machine) was only alerted.
    assert all(f["remedy"]["action"] in ("alert", "ignore") for f in findings if f not in hangs)
    hellos = journal(run_dir, "worker_hello")
    assert hellos[0]["data"]["source"] == "output" and hellos[0]["data"]["format"] == "nanogpt"
    assert len(journal(run_dir, "launch")) == 2
    # No view of the optimizer: no just-in-time state, said once, the hang resumed as before.
    [off] = journal(run_dir, "just_in_time_off")
    assert "stdout mode" in off["why"], off
    assert not journal(run_dir, "just_in_time")
    # The relaunched attempt ran to the end; every step is in metrics.jsonl, with its loss.
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["attempt"] == 1]
    assert [r["step"] for r in rows] == list(range(80))
    assert all(r["loss"] > 0 for r in rows)
    acted = [f for f in findings if f["remedy"]["action"] != "ignore"]  # in the dashboards
    if TENSORBOARD:  # the same story, where the team looks
        events = TENSORBOARD.EventAccumulator(str(run_dir / "tensorboard"),
                                              size_guidance={TENSORBOARD.TENSORS: 0})
        events.Reload()
        assert len(events.Scalars("babysit/loss")) >= 90
        texts = [t.tensor_proto.string_val[0].decode()
                 for t in events.Tensors("babysit/incidents/text_summary")]
        assert len(texts) == len(acted) and "hang" in texts[0]
    if WANDB:  # and in W&B's own records of its offline run
        logged = WANDB.history(WANDB.run_file(run_dir))
        assert len([r for r in logged if "babysit/loss" in r]) >= 90
        *_, incidents = [r["babysit/incidents"] for r in logged if "babysit/incidents" in r]
        table = json.loads(next(run_dir.glob(f"wandb/*/files/{incidents['path']}")).read_text())
        assert len(table["data"]) == len(acted)  # the newest table holds every incident
        assert table["data"][0][2] == "hang" and table["data"][0][5] == "relaunch"


def test_a_resume_whose_loss_is_back_near_the_start_is_caught_and_stopped(
        tmp_path: Path) -> None:
    """Stdout mode has no parameters to compare: the loss says the restore did not take.

    The script saves every second (10 iterations of 0.1 s): a babysitter slowed by a loaded
    machine still sees each save hold still, and keeps a copy of each (at 0.05 s a CI run's
    copies were of 10 and 40 only, the rollback went back to 10, where a fresh model's loss is
    not yet far from the recorded one)."""
    out_dir = tmp_path / "out"
    result, run_dir = babysat(
        tmp_path, "forgot", "--max_iters=60", f"--out_dir={out_dir}", "--die_at=45",
        "--forget_weights", "--sleep=0.1", script=SCRIPT, checkpoints="{}",
        extra=f"stdout:\n  checkpoint_dir: {out_dir}\n  resume_args: [--init_from=resume]\n")
    assert result.returncode == 1, result.stdout + result.stderr
    # What babysit did (a loaded machine slows the script's own printed step times, and the
    # throughput alert that may bring is true but beside the point here).
    crash, *resumes = (e for e in journal(run_dir, "finding")
                       if e["remedy"]["action"] not in ("ignore", "alert"))
    assert crash["finding"]["incident"] == "crash" and crash["remedy"]["action"] == "relaunch"
    # Caught a few printed steps after each resume: from the newest copy of the script's
    # checkpoint, then once from the one before it; then stopped, never "succeeded".
    restored = [e["checkpoint_step"] for e in journal(run_dir, "script_checkpoint_restored")]
    assert len(restored) == 2 and restored[1] < restored[0]
    assert [e["remedy"]["action"] for e in resumes] == ["rollback", "stop"]
    for entry, step in zip(resumes, restored, strict=True):
        finding = entry["finding"]
        assert finding["incident"] == "resume" and finding["detector"] == "resume_loss"
        # The checkpoint's step as babysit registered it: the last printed before the save.
        assert finding["message"].startswith(f"resume from step {step}: loss ")
        assert "the restore did not take" in finding["message"]
        assert finding["evidence"]["ratio"] > 3  # back near the first iterations' loss
        # Judged on the first printed steps after the restore (the journal's own step is the
        # newest line read by then, later on a loaded machine).
        assert finding["evidence"]["steps_seen"] == 5 and entry["step"] >= step
    assert journal(run_dir, "run_finished")[-1]["state"] == "failed"
    assert "the restore did not take" in result.stdout


def test_with_its_checkpoint_keys_set_a_printing_script_rolls_back_over_poison(
        tmp_path: Path) -> None:
    out_dir = tmp_path / "out"
    result, run_dir = babysat(
        tmp_path, "poisoned", "--max_iters=40", f"--out_dir={out_dir}", "--poison=25:29",
        script=SCRIPT, checkpoints="{}",
        extra=f"stdout:\n  checkpoint_dir: {out_dir}\n  resume_args: [--init_from=resume]\n")
    assert result.returncode == 0, result.stdout + result.stderr
    rollbacks = [f for f in journal(run_dir, "finding") if f["remedy"]["action"] == "rollback"]
    assert len(rollbacks) == 1, journal(run_dir, "finding")
    finding = rollbacks[0]
    assert finding["finding"]["incident"] in ("loss_spike", "nonfinite")
    restored = journal(run_dir, "script_checkpoint_restored")[0]
    assert restored["checkpoint_step"] < finding["finding"]["onset_step"]
    assert Path(restored["set_aside"], "ckpt.pt").exists()  # the poisoned save, kept aside
    # The journal, which tools read, names what the relaunch really resumed from: the
    # script's own checkpoint put back, not babysit's empty catalog.
    [resume] = journal(run_dir, "resume")
    assert (resume["from"], resume["checkpoint_step"], resume["source"]) == (
        restored["from"], restored["checkpoint_step"], "script"), resume
    launches = journal(run_dir, "launch")
    assert launches[-1]["command"][-1] == "--init_from=resume"
    assert "resuming from iteration" in result.stdout
    # The resumed attempt never met the poison (its data stream restarted) and ended healthy.
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["attempt"] == 1]
    assert rows[-1]["step"] == 39 and rows[-1]["loss"] < 0.1
    assert len(journal(run_dir, "checkpoint_saved")) >= 2
    # The record says where it really resumed: the script's own checkpoint, not "from start";
    # the ledger counts as lost only the steps past it; the copies are shown as copies.
    status = _status(run_dir)
    assert status is not None
    resumed = status["attempt_history"][1]
    assert resumed["resume_step"] == restored["checkpoint_step"]
    assert resumed["resume_note"].startswith("the script's own checkpoint")
    assert {c["verdict"] for c in status["checkpoints"]} == {"copy"}
    human = run_babysit("status", str(run_dir), cwd=tmp_path, timeout=30).stdout
    assert f"resume step {restored['checkpoint_step']} (the script's own checkpoint" in human
