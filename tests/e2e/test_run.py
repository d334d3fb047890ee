"""``babysit run`` end to end: the real CLI, real torchrun, real gloo workers, real signals.

Each test launches a 2-rank job (a few seconds each, mostly ``import torch``).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import (
    ROOT,
    WORKERS,
    babysat,
    babysit_env,
    console_noise,
    journal,
    read_jsonl,
    run_babysit,
)

pytestmark = pytest.mark.e2e


def events(run_dir: Path) -> list[str]:
    return [e["event"] for e in read_jsonl(run_dir / "events.jsonl")]


def test_config_run_to_completion(tmp_path: Path, write_config) -> None:
    config = write_config(
        f"launch:\n  script: {WORKERS / 'tiny_train.py'}\n  nproc-per-node: 2\n"
        f"  args: [--steps, '12']\nrun_dir: {tmp_path / 'run'}\n")
    result = run_babysit("run", str(config), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = tmp_path / "run"
    journal = read_jsonl(run_dir / "events.jsonl")
    assert [e["event"] for e in journal if e["event"] in ("launch", "state", "run_finished")] == [
        "launch", "state", "state", "run_finished"]
    assert journal[-1]["state"] == "succeeded" and journal[-1]["exit_code"] == 0
    assert {e["rank"] for e in journal if e["event"] == "worker_hello"} == {0, 1}
    # Its torchrun was the one `babysit run` started first thing, before it read the config.
    assert [e["torchrun_ahead"] for e in journal if e["event"] == "launch"] == [True]
    # Telemetry from both ranks, merged per step, written as metrics.
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, 13))
    assert all(m["ranks"] == [0, 1] and len(m["loss_per_rank"]) == 2 for m in metrics)
    assert all(len(m["step_time_per_rank"]) == 2 for m in metrics[1:])
    # Per-rank logs are kept, and the console still showed the ranks' output.
    logs = sorted(run_dir.glob("attempts/0/torchrun/*/attempt_0/*/stdout.log"))
    assert [p.parent.name for p in logs] == ["0", "1"]
    assert "rank 1 done at step 12" in logs[1].read_text()
    assert "[r1] rank 1 done at step 12" in result.stdout
    assert "succeeded (workers finished)" in result.stdout
    assert (run_dir / "config.yaml").exists()
    # A clean run's console carries no warning or traceback babysit could have prevented (the
    # flight recorder's settings under the names torch 2.13 reads, not the deprecated ones).
    assert console_noise(result.stdout + result.stderr, journal, [0, 1]) == []


def test_torchrun_style_with_a_script_that_ignores_babysit(tmp_path: Path) -> None:
    result = run_babysit("run", "--nproc_per_node", "2", str(WORKERS / "plain_train.py"),
                         "--lr", "3e-4", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    # Runs exactly as under torchrun: all ranks joined the collective and got the script's args.
    assert "rank 0 sum 3 args ['--lr', '3e-4']" in result.stdout
    assert "rank 1 sum 3 args ['--lr', '3e-4']" in result.stdout
    # The run directory was chosen automatically, printed, and holds the journal.
    run_dirs = list((tmp_path / "runs").glob("plain_train-*"))
    assert len(run_dirs) == 1 and str(run_dirs[0]) in result.stdout
    journal = read_jsonl(run_dirs[0] / "events.jsonl")
    assert journal[-1]["state"] == "succeeded"
    assert not any(e["event"] == "worker_hello" for e in journal)  # watched by exit code only
    assert (run_dirs[0] / "metrics.jsonl").read_text() == ""


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_sigint_stops_cleanly_and_leaves_no_orphans(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "babysit", "run", "--nproc-per-node", "2", "--run-dir",
         str(run_dir), str(WORKERS / "tiny_train.py"), "--steps", "100000"],
        cwd=tmp_path, env=babysit_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    try:
        def workers_running() -> list[dict]:
            if not (run_dir / "events.jsonl").exists():
                return []
            journal = read_jsonl(run_dir / "events.jsonl")
            hellos = [e for e in journal if e["event"] == "worker_hello"]
            steps = (run_dir / "metrics.jsonl").exists() and (run_dir / "metrics.jsonl").read_text()
            return hellos if len(hellos) == 2 and steps else []

        hellos = wait_for(workers_running, 90, "both ranks to report steps")
        tree = psutil.Process(proc.pid).children(recursive=True)
        worker_pids = {h["data"]["pid"] for h in hellos}
        assert worker_pids <= {p.pid for p in tree}
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGINT, out
    survivors = [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert survivors == []
    journal = read_jsonl(run_dir / "events.jsonl")
    assert journal[-1]["event"] == "run_finished" and journal[-1]["state"] == "stopped"
    assert any(e["event"] == "stop_workers" and "signal 2" in e["reason"] for e in journal)
    assert "stopped (signal 2)" in out
    # torchrun's complaint about the stop babysit asked for stays in the attempt's log.
    assert "SignalException" not in out
    assert "SignalException" in (run_dir / "attempts" / "0" / "launcher.log").read_text()


def test_user_code_crash_is_classified_and_not_retried_by_default(tmp_path: Path) -> None:
    result = run_babysit("run", "--nproc-per-node", "2", "--run-dir", str(tmp_path / "run"),
                         str(WORKERS / "tiny_train.py"), "--crash", "1:5", cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    journal = read_jsonl(tmp_path / "run" / "events.jsonl")
    finding = next(e for e in journal if e["event"] == "finding")["finding"]
    assert finding["incident"] == "crash" and finding["ranks"] == [1]
    assert finding["evidence"]["class"] == "user_code"
    assert "injected crash at step" in finding["evidence"]["signature"]
    assert journal[-1]["state"] == "failed"


def test_a_crash_reads_in_a_few_lines_and_its_reports_stay_whole_in_the_logs(
        tmp_path: Path) -> None:
    """A rank segfaults and the run resumes. From its first step to the resumed one the console
    says the crash in a few lines of babysit's own and one of the peer that lost its connection:
    no traceback (torchrun's, of babysit's launcher; the peer's), no ChildFailedError, no Root
    Cause table, nothing of the checkpoint cadence's figures. torchrun's report stays whole in
    the attempt's launcher.log, and a line names it; the peer's traceback in its own log."""
    result, run_dir = babysat(tmp_path, "segv", "--steps", "30", "--at", "0:1:12:SIGSEGV",
                              checkpoints="{every_steps: 5, probation_steps: 5, "
                                          "async_save: false, memory_every_steps: 0}")
    assert result.returncode == 0, result.stdout + result.stderr
    (crash,) = [e for e in journal(run_dir, "finding")
                if e["finding"]["incident"] == "crash"]
    assert crash["finding"]["ranks"] == [1] and crash["remedy"]["action"] == "relaunch"
    lines = [line for line in result.stdout.splitlines()
             if not line.startswith("babysit | ")]  # the status line, every 10 s: not counted
    first = lines.index("babysit: starting -> running (first step 1)")
    resumed = next(i for i, line in enumerate(lines)
                   if line.startswith("babysit: starting -> running (first step 1")
                   and i > first)
    told = lines[first + 1:resumed + 1]
    assert len(told) <= 10, "\n".join(told)
    for said in ("Traceback", "ChildFailedError", "Root Cause", "ahead.py", "cadence",
                 "[torchrun]"):
        assert said not in result.stdout, said
    log = run_dir / "attempts" / "0" / "launcher.log"
    assert f"babysit: torchrun's report of the failure, whole: {log}" in told
    report = log.read_text()
    assert all(part in report for part in ("Traceback", "ahead.py", "ChildFailedError",
                                           "Root Cause", "exitcode  : -11"))


def test_a_crash_at_the_same_step_whatever_the_data_is_the_codes_and_stops(
        tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = run_babysit("run", "--nproc-per-node", "2", "--max-restarts", "3", "--run-dir",
                         str(run_dir), "--policy", str(ROOT / "tests" / "fast_policy.yaml"),
                         str(WORKERS / "tiny_train.py"), "--crash", "0:4", "--every-attempt",
                         cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    journal = read_jsonl(run_dir / "events.jsonl")
    launches = [e for e in journal if e["event"] == "launch"]
    findings = [e for e in journal if e["event"] == "finding"]
    # Relaunched; back at the same batch: maybe the data's, so that batch is skipped; back at
    # the same step over the next batch: it follows the step count, the code's: stop.
    assert [e["remedy"]["action"] for e in findings] == ["relaunch", "rollback", "stop"]
    assert len(launches) == 3
    assert launches[2]["directive"]["skip"] == [{"start": 3, "end": 4}]
    assert "follows the step count, not the data -> the code's" in \
        findings[2]["remedy"]["reason"]
    assert [e["finding"]["evidence"]["deterministic"] for e in findings] == [False, True, True]
    assert journal[-1]["state"] == "failed"
    # Each attempt keeps its own logs.
    assert (run_dir / "attempts" / "1" / "launcher.log").exists()


def test_a_script_flooding_stdout_neither_stalls_babysit_nor_loses_its_log(
        tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = run_babysit("run", "--nproc-per-node", "2", "--run-dir", str(run_dir),
                         str(WORKERS / "tiny_train.py"), "--steps", "60", "--flood", "1000",
                         cwd=tmp_path, timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    # Every step was recorded and judged on time: no hang, no gap in the metrics.
    assert [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")] == list(range(1, 61))
    journal = read_jsonl(run_dir / "events.jsonl")
    assert not any(e["event"] == "finding" and e["finding"]["incident"] == "hang"
                   for e in journal)
    # The rank's own log keeps all 60,000 lines, whatever the console had to drop.
    (log,) = run_dir.glob("attempts/0/torchrun/*/attempt_0/0/stdout.log")
    with open(log, "rb") as f:
        assert sum(1 for _ in f) >= 60_000


def test_a_crash_in_teardown_after_every_rank_closed_counts_as_finished(
        tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = run_babysit("run", "--nproc-per-node", "2", "--run-dir", str(run_dir),
                         str(WORKERS / "tiny_train.py"), "--steps", "10",
                         "--after-close", "abort", cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:]
    journal = read_jsonl(run_dir / "events.jsonl")
    (teardown,) = [e for e in journal if e["event"] == "teardown_crash"]
    assert teardown["exit_code"] != 0 and teardown["closed_ranks"] == [0, 1]
    assert len([e for e in journal if e["event"] == "launch"]) == 1  # nothing redone
    assert journal[-1]["state"] == "succeeded"


def test_a_teardown_stuck_after_every_rank_closed_is_stopped_once_nothing_works(
        tmp_path: Path, write_config) -> None:
    # Rank 0 blocks forever after close (gloo's teardown, hung); rank 1 computes for 3 s after
    # close (a script saving its model) and then exits. babysit waits out rank 1's work, then
    # stops torchrun once nothing makes CPU progress for teardown_idle_s.
    run_dir = tmp_path / "run"
    config = write_config(
        f"launch:\n  script: {WORKERS / 'tiny_train.py'}\n  nproc-per-node: 2\n"
        f"  teardown_idle_s: 1.5\n  stop_grace_s: 2\n"
        f"  args: [--steps, '10', --after-close, hang, --work-after-close, '3']\n"
        f"run_dir: {run_dir}\n")
    result = run_babysit("run", str(config), cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "rank 1 worked 3 s after close" in result.stdout
    journal = read_jsonl(run_dir / "events.jsonl")
    (teardown,) = [e for e in journal if e["event"] == "teardown_hang"]
    assert teardown["closed_ranks"] == [0, 1] and teardown["idle_s"] == 1.5
    closed = max(e["time"] for e in journal if e["event"] == "worker_close")
    assert teardown["time"] - closed >= 3 + 1.5  # rank 1's work, then the idle window
    assert teardown["processes"]["0"]["cpu"] < 0.01
    assert len([e for e in journal if e["event"] == "launch"]) == 1  # nothing redone
    assert journal[-1]["state"] == "succeeded"


def test_an_exception_after_close_is_still_a_crash(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = run_babysit("run", "--nproc-per-node", "2", "--run-dir", str(run_dir),
                         str(WORKERS / "tiny_train.py"), "--steps", "10",
                         "--after-close", "raise", cwd=tmp_path)
    assert result.returncode == 1, result.stdout[-3000:]
    journal = read_jsonl(run_dir / "events.jsonl")
    assert not any(e["event"] == "teardown_crash" for e in journal)
    finding = next(e["finding"] for e in journal if e["event"] == "finding")
    assert finding["evidence"]["class"] == "user_code"
