"""The warm standby under real torchrun: one promoted, one that fails on its own, one stopped with
the run (the decisions and handshake alone: ``tests/supervisor/node/test_standby.py``; the whole
relaunch through a standby is in tests/e2e/test_recovery.py's hang test)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from babysit.supervisor.config import plan as plan_mod
from babysit.supervisor.contract.directive import Directive, SkipRange
from babysit.supervisor.node.launcher import WorkerGroup, free_port
from babysit.supervisor.node.workers import NodeWorkers
from tests.conftest import FAST_POLICY, SYNC_SAVES, WORKERS, babysit_env, journal

pytestmark = pytest.mark.e2e


STANDBY_SCRIPT = """\
import os, sys, time
from babysit import attach
if os.environ["BABYSIT_ATTEMPT"] == "2":
    sys.exit("cannot import the model code")  # only this standby: it fails on its own
time.sleep(2)  # a model build: still starting when the test pauses it, whatever the disk cache
run = attach()
print("attempt", run.directive.attempt, "skips", [r.start for r in run.directive.skip])
run.close()
"""


def wait_for(condition: Callable[[], object], timeout_s: float = 60.0,
             seen: Callable[[], object] = lambda: None) -> None:
    """Until ``condition()``; on timeout the failure says what ``seen()`` then reads."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out; {seen()}"
        time.sleep(0.05)


def statuses(group: WorkerGroup) -> list[tuple[int, str, str]]:
    """(pid, state, command line) of each process of an attempt's tree, for a failure's
    message."""
    out = []
    for p in group.processes():
        with contextlib.suppress(psutil.Error):
            out.append((p.pid, p.status(), " ".join(p.cmdline())[:120]))
    return out


def open_workers(tmp_path: Path, script: str, launch: str = "") -> NodeWorkers:
    """A single node's workers (opened) for ``script`` as ``train.py``, with ``launch`` added
    to the launch section (flow style)."""
    (tmp_path / "train.py").write_text(script)
    (tmp_path / "run.yaml").write_text(f"launch: {{script: train.py, nproc-per-node: 1{launch}}}"
                                       f"\nrun_dir: {tmp_path / 'run'}\n")
    (tmp_path / "run").mkdir(mode=0o700)
    workers = NodeWorkers(plan_mod.from_file(tmp_path / "run.yaml"), tmp_path / "run")
    workers.open()
    return workers


def test_a_standby_waits_silent_until_promoted_and_one_that_fails_is_journaled(
        tmp_path: Path) -> None:
    """Real torchrun: the standby's rank waits in attach() and sends nothing (paused and
    continued while it starts); promoted, it reads the directive written then and reports; one
    that exits on its own is never used; one still waiting when the run ends is stopped with
    it."""
    workers = open_workers(tmp_path, STANDBY_SCRIPT)
    try:
        workers.start_standby(1, rdzv_endpoint=f"127.0.0.1:{free_port()}", rdzv_id="t-1")
        spare = workers.standby
        assert spare is not None
        # While a hang is confirmed the starting standby is paused (its start-up would take
        # the CPU the stack reads need), then continued.
        wait_for(lambda: len(spare.group.processes()) >= 2)  # torchrun and its rank
        workers.hold_standby(True)
        assert spare.paused
        wait_for(lambda: all(p.status() == psutil.STATUS_STOPPED
                             for p in spare.group.processes()), timeout_s=5,
                 seen=lambda: statuses(spare.group))
        workers.hold_standby(False)
        assert not spare.paused
        wait_for(spare.ready_at)
        workers.hold_standby(True)  # ready: nothing to pause
        assert not spare.paused
        assert all(p.status() != psutil.STATUS_STOPPED for p in spare.group.processes())
        time.sleep(0.3)
        assert workers.telemetry() == []  # waiting: not even a hello
        assert spare.group.poll() is None
        directive = Directive(attempt=1, skip=(SkipRange(7, 9),))
        assert workers.promote(1, directive) is spare and workers.group is spare.group
        wait_for(lambda: workers.poll() is not None)
        assert workers.poll() == 0
        hello = [m for m in workers.telemetry() if getattr(m, "type", None) == "hello"]
        assert len(hello) == 1
        assert "attempt 1 skips [7]" in "\n".join(workers.output())

        workers.start_standby(2, rdzv_endpoint=f"127.0.0.1:{free_port()}", rdzv_id="t-2")
        wait_for(lambda: workers.standby is not None and workers.standby.group.poll() is not None)
        workers.standby_exit()
        said = [e for e in workers.standby_entries if e[0] != "standby_started"]
        exited = [fields for event, fields in said if event == "standby_exited"]
        # Once a full suite's run journaled one entry more here; which one, this says.
        assert len(exited) == 1, said
        fields = exited[0]
        assert fields["for_attempt"] == 2
        assert "cannot import the model code" in str(fields["tail"])
        assert workers.standby is None and workers.promote(2, Directive(attempt=2)) is None

        workers.start_standby(3, rdzv_endpoint=f"127.0.0.1:{free_port()}", rdzv_id="t-3")
        spare = workers.standby
        assert spare is not None
        wait_for(spare.ready_at)  # waiting in attach() when the run ends: it goes too
        workers.take_standby_entries()
        workers.close()
        assert [(event, fields["for_attempt"], fields["reason"])
                for event, fields in workers.take_standby_entries()] == \
            [("standby_stopped", 3, "the run ended")]
    finally:
        workers.close()
    assert not [p for p in psutil.process_iter() if _of_run(p, tmp_path / "run")]


IMPORTS_SCRIPT = """\
import sys, time
from pathlib import Path
Path(__file__).with_name("started").write_text(str(time.time()))  # its first line
warm = [m for m in ("torch._dynamo", "torch.distributed.checkpoint") if m in sys.modules]
from babysit import attach
run = attach()
print("attempt", run.directive.attempt, "argv", sys.argv[1:], "main", __name__, "warm", warm)
run.close()
"""


def test_an_import_standby_waits_before_the_script_and_runs_it_once_promoted(
        tmp_path: Path) -> None:
    """``warm_standby: imports`` (auto's choice on GPUs): the standby's rank imports torch (and
    what DDP's constructor and the restore import next) and waits before the script's first
    line; promoted, it runs the script as ``python train.py`` would (its arguments,
    ``__main__``) and attaches to the attempt."""
    workers = open_workers(tmp_path, IMPORTS_SCRIPT, ", args: [--lr, '3'], warm_standby: imports")
    try:
        workers.start_standby(1, "imports", rdzv_endpoint=f"127.0.0.1:{free_port()}",
                              rdzv_id="t-1")
        spare = workers.standby
        assert spare is not None and spare.kind == "imports"
        wait_for(spare.ready_at)
        rank = next(p for p in spare.group.processes() if "--lr" in p.cmdline()
                    and "torch.distributed.run" not in p.cmdline())
        assert "babysit.supervisor.rank.prewarm" in rank.cmdline()
        assert "torch" in {Path(m.path).parts[-2] for m in rank.memory_maps()
                           if len(Path(m.path).parts) > 1}  # torch is loaded
        time.sleep(0.3)
        assert not (tmp_path / "started").exists()  # nothing of the script ran
        promoted = time.time()
        assert workers.promote(1, Directive(attempt=1)) is spare
        wait_for(lambda: workers.poll() is not None)
        assert workers.poll() == 0
        assert float((tmp_path / "started").read_text()) >= promoted
        assert ("attempt 1 argv ['--lr', '3'] main __main__ warm ['torch._dynamo', "
                "'torch.distributed.checkpoint']") in "\n".join(workers.output())
        hello = [m for m in workers.telemetry() if getattr(m, "type", None) == "hello"]
        assert len(hello) == 1
    finally:
        workers.close()
    assert not [p for p in psutil.process_iter() if _of_run(p, tmp_path / "run")]


def _of_run(proc: psutil.Process, run_dir: Path) -> bool:
    try:
        return proc.environ().get("BABYSIT_RUN_DIR") == str(run_dir)
    except psutil.Error:
        return False


AHEAD_SCRIPT = """\
import os
print("attempt", os.environ["BABYSIT_ATTEMPT"], "run dir", os.environ["BABYSIT_RUN_DIR"],
      "in", os.getcwd(), "world", os.environ["WORLD_SIZE"], flush=True)
"""


def test_torchrun_started_ahead_becomes_the_next_attempt_and_is_stopped_with_the_run(
        tmp_path: Path) -> None:
    """Real torchrun started ahead (``node.ahead``, the standby off): attempt 1's launch feeds
    it the command line and environment, and it runs the attempt as a fresh torchrun would;
    the one started for attempt 2 is stopped when the run ends; one that cannot start (no
    babysit in ``launch.python``) is journaled once and never tried again."""
    workers = open_workers(tmp_path, AHEAD_SCRIPT, ", warm_standby: false")
    try:
        workers.keep_ahead(1)
        assert workers.ahead is not None
        waiting = workers.ahead[1]
        wait_for(lambda: any("torch" in m.path for p in waiting.processes()
                             for m in p.memory_maps()), timeout_s=30)  # torch imported
        workers.keep_ahead(1)  # already up for attempt 1: nothing new
        assert workers.ahead is not None and workers.ahead[1] is waiting
        workers.launch(1, Directive(attempt=1), rdzv_endpoint=f"127.0.0.1:{free_port()}",
                       rdzv_id="t-1")
        assert workers.launched_ahead and workers.group is waiting and workers.ahead is None
        wait_for(lambda: workers.poll() is not None)
        assert workers.poll() == 0
        printed = [line for line in workers.output() if "attempt" in line]
        assert printed == [f"[r0] attempt 1 run dir {tmp_path / 'run'} in {Path.cwd()} world 1"]
        assert "--nproc-per-node" in " ".join(waiting.command)  # the journal's command line

        workers.keep_ahead(2)
        assert workers.ahead is not None
        pid = workers.ahead[1].pid
    finally:
        workers.close()
    assert pid is not None and not psutil.pid_exists(pid)


def test_torchrun_ahead_that_cannot_start_is_said_once_and_never_tried_again(
        tmp_path: Path) -> None:
    workers = open_workers(tmp_path, AHEAD_SCRIPT, ", warm_standby: false, python: /bin/false")
    try:
        workers.keep_ahead(1)
        assert workers.ahead is not None
        wait_for(lambda: workers.ahead is not None and workers.ahead[1].poll() is not None)
        workers.keep_ahead(1)
        assert workers.ahead is None
        [(event, fields)] = workers.take_standby_entries()
        assert event == "ahead_exited" and fields["for_attempt"] == 1
        workers.keep_ahead(2)
        assert workers.ahead is None  # not again in this run
    finally:
        workers.close()


def test_a_standby_whose_rank_was_killed_is_not_promoted_and_no_batch_is_skipped(
        tmp_path: Path) -> None:
    """A SIGKILL reaches the warm standby's rank 1 while it waits in attach() (the OOM killer,
    a person), before its torchrun looks at its ranks again; then the running rank 1 dies. The
    relaunch must not promote that standby: it would fail at once on the rank that trained
    nothing, at the step the relaunch resumed from, and babysit once took that for the same
    crash at the same batch twice and skipped the batch. Its processes are checked first: it is
    stopped, journaled, and the relaunch is cold; the run resumes and skips nothing.

    The order is arranged, not hoped for: the standby's torchrun is stopped (SIGSTOP) before its
    rank is killed, so that it cannot notice before the relaunch (as when the relaunch comes
    between two of its looks), and continued only if babysit promotes it anyway."""
    run_dir, pace = tmp_path / "run", tmp_path / "pace"
    pace.write_text("0.25")  # slow until the standby is ready and both kills are done
    (tmp_path / "run.yaml").write_text(
        f"launch:\n  script: {WORKERS / 'tiny_train.py'}\n  nproc-per-node: 2\n"
        f"  args: {json.dumps(['--steps', '400', '--pace-file', str(pace)])}\n"
        f"run_dir: {run_dir}\ncheckpoints: {SYNC_SAVES}\npolicy: {{name: {FAST_POLICY}}}\n")
    proc = subprocess.Popen([sys.executable, "-m", "babysit", "run", "run.yaml"], cwd=tmp_path,
                            env=babysit_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    folder = run_dir / "attempts" / "1" / "standby"
    done = threading.Event()
    try:
        ready = [folder / "ready" / str(rank) for rank in (0, 1)]
        wait_for(lambda: all(r.exists() for r in ready) or proc.poll() is not None, 240)
        assert proc.poll() is None, "the run ended before its standby was ready"
        (started,) = [e for e in journal(run_dir, "standby_started") if e["for_attempt"] == 1]
        standby_torchrun = int(started["pid"])
        waiting_rank = int(json.loads(ready[1].read_text())["pid"])
        (running_rank,) = [e["data"]["pid"] for e in journal(run_dir, "worker_hello")
                           if e["attempt"] == 0 and e["rank"] == 1]

        def continue_if_promoted() -> None:
            while not done.is_set():
                if (folder / "go").exists():  # promoted after all: let its torchrun look
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(standby_torchrun, signal.SIGCONT)
                    return
                time.sleep(0.02)

        threading.Thread(target=continue_if_promoted, daemon=True).start()
        os.kill(standby_torchrun, signal.SIGSTOP)
        os.kill(waiting_rank, signal.SIGKILL)
        os.kill(running_rank, signal.SIGKILL)
        wait_for(lambda: [e for e in journal(run_dir, "launch") if e["attempt"] == 1]
                 or proc.poll() is not None, 120)
        pace.write_text("0")  # the rest at full speed
        out, _ = proc.communicate(timeout=240)
    finally:
        done.set()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out
    (stopped,) = [e for e in journal(run_dir, "standby_stopped") if e["for_attempt"] == 1]
    assert f"its rank 1's process (pid {waiting_rank}) is gone" in stopped["reason"], stopped
    assert "the relaunch starts cold" in stopped["reason"]
    launches = journal(run_dir, "launch")
    assert [e["standby"] for e in launches if e["attempt"] == 1] == [False]
    assert not (folder / "go").exists()
    # One crash, relaunched; nothing skipped, nothing rolled back.
    findings = [e for e in journal(run_dir, "finding") if e["finding"]["incident"] == "crash"]
    assert [(e["finding"]["ranks"], e["remedy"]["action"]) for e in findings] == \
        [([1], "relaunch")], findings
    assert all(e["directive"]["skip"] == [] for e in launches)
    assert journal(run_dir, "worker_skip") == []
    (resume,) = [e for e in journal(run_dir, "resume") if e.get("from")]
    assert resume["checkpoint_step"] > 0  # resumed, not restarted
    (finished,) = journal(run_dir, "run_finished")
    assert finished["state"] == "succeeded" and finished["step"] == 400
