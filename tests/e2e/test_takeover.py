"""babysit itself killed (SIGKILL, as the OOM killer or a reboot would): running it again on the
same run directory stops the workers it left behind and resumes from its checkpoints."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

from babysit.checkpoints import Catalog
from tests.conftest import WORKERS, babysit_env, read_jsonl, run_babysit, take_over
from tests.journal_text import problems

pytestmark = pytest.mark.e2e


def test_a_killed_supervisor_is_taken_over_and_the_run_resumes(tmp_path: Path) -> None:
    """The orphaned ranks hold before step 36 until the second ``babysit run`` has taken the
    run over (``--hold-until``, a file made once its ``supervisor_takeover`` is journaled):
    there is always a training job to stop, however slow the machine."""
    run_dir = tmp_path / "run"
    config = tmp_path / "run.yaml"
    taken_over = tmp_path / "taken_over"
    args = ["--steps", "40", "--step-sleep", "0.15", "--hold-at", "36",
            "--hold-until", str(taken_over)]
    config.write_text(
        f"launch:\n  script: {WORKERS / 'tiny_train.py'}\n  nproc-per-node: 2\n"
        f"  args: {json.dumps(args)}\n"
        f"run_dir: {run_dir}\n"
        "checkpoints: {every_steps: 5, probation_steps: 2, keep: 20}\n")
    first = subprocess.Popen([sys.executable, "-m", "babysit", "run", str(config)],
                             cwd=tmp_path, env=babysit_env(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 90
        saved: list[int] = []
        while time.monotonic() < deadline and not any(s >= 10 for s in saved):
            time.sleep(0.2)
            if (run_dir / "events.jsonl").exists():
                saved = [e["checkpoint_step"] for e in read_jsonl(run_dir / "events.jsonl")
                         if e["event"] == "checkpoint_saved"]
        assert any(s >= 10 for s in saved), "no checkpoint within 90 s"
        first.send_signal(signal.SIGKILL)
        first.wait(10)
    finally:
        if first.poll() is None:
            first.kill()
    before = read_jsonl(run_dir / "events.jsonl")
    workers = [e["data"]["pid"] for e in before if e["event"] == "worker_hello"]
    assert all(psutil.pid_exists(p) for p in workers)  # orphans, still training unwatched
    # The newest step it observed: the attempt's newest row in metrics.jsonl (the journal's
    # step stamps may lag it by a step).
    watched = max(m["step"] for m in read_jsonl(run_dir / "metrics.jsonl"))
    # Let them write two checkpoints nobody watches before taking over (35 the last: they
    # hold before step 36).
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (
            run_dir / "checkpoints" / f"step_{min((watched // 5 + 2) * 5, 35):08d}").exists():
        time.sleep(0.1)

    code, out = take_over(config, run_dir, taken_over)  # the ranks go on past step 35
    assert code == 0, out[-6000:]
    journal = read_jsonl(run_dir / "events.jsonl")
    (takeover,) = [e for e in journal if e["event"] == "supervisor_takeover"]
    assert set(workers) <= set(takeover["stopped_pids"])
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                   for p in workers)
    after = journal[journal.index(takeover):]
    resume = next(e for e in after if e["event"] == "resume" and e.get("from"))
    assert resume["checkpoint_step"] >= 10
    new_attempt = max(e["attempt"] for e in before) + 1
    rows = [m for m in read_jsonl(run_dir / "metrics.jsonl") if m["attempt"] == new_attempt]
    assert rows[0]["step"] == resume["checkpoint_step"] + 1 and rows[-1]["step"] == 40
    assert journal[-1]["event"] == "run_finished" and journal[-1]["state"] == "succeeded"
    # What the workers saved unwatched is still pending: its probation was never observed.
    assert takeover["watched_until_step"] == watched
    unwatched = [e["checkpoint_step"] for e in after if e["event"] == "checkpoint_verdict"
                 and e["verdict"] == "pending"]
    assert unwatched and all(watched < s + 2 and s < resume["checkpoint_step"] for s in unwatched)
    verdicts = {c.step: c.verdict.value for c in Catalog(run_dir / "checkpoints").checkpoints()}
    assert all(verdicts[s] == "pending" for s in unwatched), verdicts


def test_a_job_that_finished_while_no_supervisor_watched_is_not_retrained(
        tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text(
        f"launch:\n  script: {WORKERS / 'tiny_train.py'}\n  nproc-per-node: 2\n"
        f"  args: {json.dumps(['--steps', '30', '--step-sleep', '0.05'])}\n"
        f"run_dir: {run_dir}\ncheckpoints: {{every_steps: 10}}\n")
    first = subprocess.Popen([sys.executable, "-m", "babysit", "run", str(config)],
                             cwd=tmp_path, env=babysit_env(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 90
        hellos: list[dict[str, object]] = []
        while time.monotonic() < deadline and len(hellos) < 2:
            time.sleep(0.1)
            if (run_dir / "events.jsonl").exists():
                hellos = [e for e in read_jsonl(run_dir / "events.jsonl")
                          if e["event"] == "worker_hello"]
        first.send_signal(signal.SIGKILL)
        first.wait(10)
    finally:
        if first.poll() is None:
            first.kill()
    pids = [int(e["data"]["pid"]) for e in hellos]  # type: ignore[index]
    psutil.wait_procs([psutil.Process(p) for p in pids if psutil.pid_exists(p)], timeout=60)
    launches = len([e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "launch"])

    second = run_babysit("run", str(config), cwd=tmp_path, timeout=120)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    journal = read_jsonl(run_dir / "events.jsonl")
    (takeover,) = [e for e in journal if e["event"] == "supervisor_takeover"]
    assert takeover["finished_unwatched"] == 30
    assert len([e for e in journal if e["event"] == "launch"]) == launches  # nothing retrained
    assert journal[-1]["state"] == "succeeded" and "no supervisor watched" in \
        journal[-1]["reason"]


def _sigterm_once(config: Path, cwd: Path, when: Callable[[list[dict[str, Any]]], bool]
                  ) -> tuple[int, str]:
    """``babysit run config``, SIGTERMed once ``when(metrics rows)``: its exit code and output."""
    run = subprocess.Popen([sys.executable, "-m", "babysit", "run", str(config)], cwd=cwd,
                           env=babysit_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
    metrics = cwd / "run" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            time.sleep(0.05)
            rows = read_jsonl(metrics) if metrics.exists() else []
            if rows and when(rows):
                break
        run.send_signal(signal.SIGTERM)  # what a scheduler sends before reclaiming the node
        out, _ = run.communicate(timeout=90)
    finally:
        if run.poll() is None:
            run.kill()
    return run.returncode, out


def test_sigterm_saves_a_final_checkpoint_and_the_next_run_resumes_from_it(
        tmp_path: Path) -> None:
    """Three sessions of one run directory: SIGTERMed while training, the first saves a final
    checkpoint at a step the ranks agree on; the second, SIGTERMed while its rank 1 is stopped
    (no step boundary will come), gets none within ``final_grace_s``, and rank 0's
    just-in-time state of its last completed step stands in for it; the third resumes from
    that and finishes."""
    run_dir = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text(
        f"launch:\n  script: {WORKERS / 'tiny_train.py'}\n  nproc-per-node: 2\n"
        # 20 ms steps: the ranks run well ahead of what the supervisor last heard, so only a
        # step the ranks agree on themselves can be saved by all of them. The second session
        # (attempt 1) has rank 1 stop itself before step 40.
        "  args: " + json.dumps(["--steps", "80", "--step-sleep", "0.02",
                                 "--at", "1:1:40:SIGSTOP"]) + "\n"
        f"run_dir: {run_dir}\n"
        # No checkpoint on the cadence before the end: only the final one can be resumed from.
        "checkpoints: {every_steps: 1000, final_grace_s: 5}\n")
    code, out = _sigterm_once(config, tmp_path, lambda rows: rows[-1]["step"] >= 10)
    assert code == 128 + signal.SIGTERM, out[-3000:]
    journal = read_jsonl(run_dir / "events.jsonl")
    (asked,) = [e for e in journal if e["event"] == "final_checkpoint_requested"]
    (final,) = [e for e in journal if e["event"] == "final_checkpoint"]
    assert final["saved"] and final["checkpoint_step"] >= asked["newest_step"]
    assert not final["just_in_time"] and "final checkpoint saved at step" in out
    assert journal[-1]["state"] == "stopped"

    # Rank 1 stopped before step 40, rank 0 waits for it in step 40's all-reduce.
    code, out = _sigterm_once(config, tmp_path, lambda rows: rows[-1]["attempt"] == 1 and
                              rows[-1]["step"] >= 39)
    assert code == 128 + signal.SIGTERM, out[-3000:]
    journal = read_jsonl(run_dir / "events.jsonl")
    resume = [e for e in journal if e["event"] == "resume" and e.get("from")]
    assert resume[-1]["checkpoint_step"] == final["checkpoint_step"]
    *_, kept = [e for e in journal if e["event"] == "just_in_time"]
    assert (kept["fault"], kept["outcome"], kept["checkpoint_step"], kept["writers"]) == (
        "preemption", "saved", 39, [0]), kept
    *_, final = [e for e in journal if e["event"] == "final_checkpoint"]
    assert final["saved"] and final["just_in_time"] and final["checkpoint_step"] == 39
    assert "the just-in-time state of step 39 stands in for it" in out
    assert not [e for e in journal if e["event"] == "final_checkpoint_missing"]

    third = run_babysit("run", str(config), cwd=tmp_path, timeout=180)
    assert third.returncode == 0, third.stdout[-3000:] + third.stderr[-3000:]
    journal = read_jsonl(run_dir / "events.jsonl")
    *_, resume = [e for e in journal if e["event"] == "resume" and e.get("from")]
    assert resume["checkpoint_step"] == 39 and resume["just_in_time"], resume
    assert resume["before_step"] is None  # a takeover takes the newest, bound by no step
    assert journal[-1]["state"] == "succeeded"
    # Three sessions' SIGTERMs, final checkpoints and takeovers: no number in the journal
    # stands for "none", and every message reads as a sentence.
    assert problems(journal) == []
