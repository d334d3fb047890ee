"""Hang diagnosis of a real hung gloo job under torchrun: py-spy dumps name the rank outside the
collective, the incident folder says so, and the stacks read ahead serve the confirmation (the
pure judgment: ``tests/supervisor/node/test_stacks.py``)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from babysit.policies.types import Finding, Incident, Severity
from babysit.supervisor.node.hang import EarlyLook, confirm
from babysit.supervisor.node.incident import write_incident
from babysit.supervisor.node.launcher import free_port
from babysit.supervisor.node.stacks import Diagnosis, diagnose
from tests.conftest import ROOT, WORKERS, babysit_env

pytestmark = pytest.mark.e2e


@pytest.fixture
def hung_job(tmp_path: Path) -> Iterator[dict[int, int]]:
    """A real 2-rank gloo job under torchrun where rank 1 sleeps at step 5 and rank 0 waits for
    it in the gradient all-reduce. Yields rank -> pid once rank 1 has hung; leaves no process
    behind."""
    output = tmp_path / "torchrun.log"
    with output.open("wb") as sink:
        torchrun = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
             "--max-restarts", "0", "--rdzv-backend", "c10d",
             "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
             str(WORKERS / "tiny_train.py"), "--ddp", "--hang", "1:5", "--steps", "100000"],
            cwd=ROOT, env=babysit_env(), start_new_session=True, stdin=subprocess.DEVNULL,
            stdout=sink, stderr=subprocess.STDOUT)
    launcher = psutil.Process(torchrun.pid)
    workers: list[psutil.Process] = []
    try:
        pids = _worker_pids(launcher, deadline=time.monotonic() + 60)
        workers = [psutil.Process(pid) for pid in pids.values()]
        deadline = time.monotonic() + 60
        while "injected hang" not in output.read_text(errors="replace"):
            assert time.monotonic() < deadline and torchrun.poll() is None, output.read_text()
            time.sleep(0.2)
        yield pids
    finally:
        workers = workers or [p for p in _children(launcher) if _is_worker(p)]
        # torchrun puts each worker in a session of its own: signal every group.
        for proc in [launcher, *workers]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        torchrun.wait(timeout=10)
        _gone, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive, f"orphans left: {alive}"


def _children(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return proc.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _is_worker(proc: psutil.Process) -> bool:
    try:
        return any("tiny_train.py" in part for part in proc.cmdline())
    except psutil.Error:
        return False


def _worker_pids(launcher: psutil.Process, deadline: float) -> dict[int, int]:
    while time.monotonic() < deadline:
        pids = {}
        for proc in filter(_is_worker, _children(launcher)):
            try:
                rank = proc.environ().get("RANK")
            except psutil.Error:
                continue
            if rank is not None:
                pids[int(rank)] = proc.pid
        if len(pids) == 2:
            return pids
        time.sleep(0.2)
    raise AssertionError("the two workers never started")


def test_real_hang_names_the_rank_outside_the_collective(hung_job: dict[int, int],
                                                          tmp_path: Path) -> None:
    # Rank 1 printed its hang message just before sleeping; rank 0 gets to the all-reduce
    # within a step (20 ms), so poll briefly rather than sleep a guessed time.
    deadline = time.monotonic() + 20
    while True:
        dumps, verdict = diagnose(hung_job)
        if verdict.waiting or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert all(d.error is None for d in dumps.values()), dumps
    assert verdict.suspects == (1,) and verdict.waiting == (0,), verdict
    assert "rank 1 is outside any collective" in verdict.reason
    assert "main (tiny_train.py:" in verdict.reason
    assert verdict.evidence[1][0].startswith("main (tiny_train.py:")
    # Rank 0 waits in the gradient all-reduce: a Python all_reduce frame, or (DDP) C++ c10d.
    assert "all_reduce (torch/distributed/" in dumps[0].raw or "c10d::" in dumps[0].raw
    hang = Finding(Incident.HANG, "hang", Severity.CRITICAL, 5, 5,
                   "no rank made progress for 12.0 s (limit 10.0 s)")
    folder = write_incident(tmp_path / "run", 0, hang,
                            "stopped the group; relaunching from the last good checkpoint",
                            Diagnosis(dumps, verdict),
                            {0: "rank 0 log\n", 1: "rank 1: injected hang at step 5\n"})
    text = (folder / "summary.txt").read_text()
    print(text)
    assert "which rank:    rank 1" in text and "[suspect]" in text
    assert "c10d::" in (folder / "stacks" / "rank0.txt").read_text() or \
        "all_reduce" in (folder / "stacks" / "rank0.txt").read_text()

    # Read ahead while the stall was only half-way to a suspicion, the native stacks serve the
    # confirmation (no rank moved since), which then needs no native pass of its own.
    early = EarlyLook(hung_job)
    early.wait()
    suspicion = Finding(Incident.HANG, "hang", Severity.CRITICAL, 5, 5, "no step for 2 s",
                        evidence={"confirm": True})
    seen = confirm(suspicion, hung_job, early)
    assert seen.finding is not None and seen.finding.ranks == (1,), seen.fields
    assert seen.fields["read_ahead"] == ("c10d::" in dumps[0].raw), seen.fields
