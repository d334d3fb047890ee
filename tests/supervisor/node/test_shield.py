"""The ranks and their torchrun kept from a scheduler's SIGTERM (``node.shield``): under
``srun`` they start with SIGTERM ignored, torchrun handles the other signals only, and babysit
stops them with SIGHUP; elsewhere nothing changes. Under a real Slurm cluster, the time limit's
SIGTERM reaching every process of the step: ``tests/e2e/test_slurm.py``."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from babysit.supervisor.config.schema import LaunchConfig
from babysit.supervisor.node import shield
from babysit.supervisor.node.launcher import torchrun_command


@pytest.fixture
def srun(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("SLURM_STEP_ID", "0")


@pytest.fixture
def no_slurm(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("SLURM_JOB_ID", "SLURM_STEP_ID"):
        monkeypatch.delenv(key, raising=False)


def test_outside_srun_the_workers_stop_on_sigterm_as_ever(no_slurm: None) -> None:
    assert not shield.shielded()
    assert shield.stop_signal() is signal.SIGTERM and shield.preexec() is None


def test_this_torchrun_can_leave_sigterm_alone() -> None:
    assert shield.torchrun_can()  # torch 2.13: --signals-to-handle


def test_under_srun_the_tree_ignores_sigterm_and_stops_on_sighup(srun: None) -> None:
    assert shield.shielded() and shield.stop_signal() is signal.SIGHUP
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; print('up', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, preexec_fn=shield.preexec())
    try:
        assert child.stdout is not None and child.stdout.readline() == b"up\n"
        child.send_signal(signal.SIGTERM)  # Slurm's, to every process of the step
        time.sleep(0.3)
        assert child.poll() is None
        child.send_signal(shield.stop_signal())  # babysit's
        assert child.wait(timeout=10) == -signal.SIGHUP
    finally:
        child.kill()
        child.wait()


def test_torchrun_is_told_to_leave_sigterm_alone_unless_the_user_said_otherwise() -> None:
    launch = LaunchConfig(script="t.py")
    plain = torchrun_command(launch, Path("t.py"), python="python", rdzv_id="r",
                             rdzv_endpoint="h:1", log_dir=Path("/l"))
    shielded = torchrun_command(launch, Path("t.py"), python="python", rdzv_id="r",
                                rdzv_endpoint="h:1", log_dir=Path("/l"), shielded=True)
    assert "--signals-to-handle" not in plain
    at = shielded.index("--signals-to-handle")
    assert shielded[at + 1] == "SIGINT,SIGHUP,SIGQUIT" and shielded[-1] == "t.py"
    assert shield.torchrun_args(["--signals-to-handle=SIGTERM,SIGUSR1"]) == []
    assert shield.torchrun_args(["--signals_to_handle", "SIGTERM"]) == []
