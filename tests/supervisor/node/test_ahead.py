"""torchrun started ahead (``node.ahead``): the order it reads, which runs get one, and the
first attempt's, started by ``babysit run`` itself. The process itself, started and fed, under
real torchrun: ``tests/e2e/test_standby.py`` (and every e2e run's first launch)."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from babysit.supervisor.config import plan as plan_mod
from babysit.supervisor.contract.protocol import ENV_RUN_DIR
from babysit.supervisor.node import ahead
from babysit.supervisor.node.launcher import free_port, stop_leftovers, torchrun_command
from babysit.supervisor.node.workers import NodeWorkers


def test_an_order_carries_torchruns_arguments_environment_and_folder() -> None:
    command = ["/usr/bin/python3", "-m", "torch.distributed.run", "--nnodes", "1", "train.py"]
    order = ahead.Order.of(command, {"A": "1"}, "/work")
    assert order == ahead.Order(["--nnodes", "1", "train.py"], {"A": "1"}, "/work")
    assert ahead.Order.decode(order.encode()) == order
    assert order.encode().endswith(b"\n") and order.encode().count(b"\n") == 1
    assert ahead.Order.of(["python", "train.py"], {}, "/") is None  # not torchrun's
    assert ahead.command("/opt/py") == ["/opt/py", "-m", "babysit.supervisor.node.ahead"]


def test_the_torchrun_that_hosts_the_rendezvous_store_holds_it_until_babysit_lets_go() -> None:
    """The node whose torchrun hosts the c10d store (the leader's: ``is_host=1``) keeps it
    open past its torchrun's end, until babysit closes its standard input: the other nodes'
    torchruns shut the rendezvous down on it after their exit barrier, and fail to (a warning
    and a C++ stack on each) when it is gone. torchrun's own store shares the held server
    (multi-tenant: one server per port and process) and may go first."""
    def command(conf: str, backend: str = "c10d") -> list[str]:
        return ["python", "-m", "torch.distributed.run", "--nnodes", "2", "--rdzv-backend",
                backend, "--rdzv-endpoint", "10.0.0.1:29400", "--rdzv-conf", conf, "train.py"]

    order = ahead.Order.of(command("is_host=1"), {}, "/")
    assert order is not None and order.hold == "10.0.0.1:29400"
    assert ahead.Order.decode(order.encode()) == order
    for other in (command("is_host=0"), command("read_timeout=60"),
                  command("is_host=1", backend="static")):
        assert ahead.Order.of(other, {}, "/") == ahead.Order(other[3:], {}, "/")

    from datetime import timedelta

    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    port = free_port()
    held = ahead._hold(f"127.0.0.1:{port}")
    agent = TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True)  # as torchrun's
    agent.set("torch.rendezvous.r", "closed")
    del agent
    client = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5))
    assert client.get("torch.rendezvous.r") == b"closed"  # the server outlived torchrun's
    assert held is not None and ahead._hold("no port") is None


def test_every_torchrun_command_babysit_builds_can_be_run_ahead(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("")
    plan = plan_mod.from_mapping({"launch": {"script": "train.py"}}, "t", tmp_path, "t",
                                 run_dir=str(tmp_path / "run"))
    command = torchrun_command(plan.config.launch, plan.script, python="python", rdzv_id="r",
                               rdzv_endpoint="127.0.0.1:1", log_dir=tmp_path)
    assert command[1:3] == ahead.TORCHRUN


def plan(tmp_path: Path, **launch: object) -> plan_mod.RunPlan:
    (tmp_path / "train.py").write_text("")
    return plan_mod.from_mapping({"launch": {"script": "train.py", **launch}}, "t", tmp_path,
                                 "t", run_dir=str(tmp_path / "run"))


def test_only_runs_no_warm_standby_serves_start_torchrun_ahead(tmp_path: Path) -> None:
    def on(**launch: object) -> bool:
        return NodeWorkers(plan(tmp_path, **launch), tmp_path / "run")._ahead_on

    assert not on()  # the warm standby serves the relaunches
    assert on(warm_standby=False)
    assert on(rdzv_endpoint="127.0.0.1:29500")
    assert not on(warm_standby=False, torchrun_ahead=False)


def test_the_first_attempts_torchrun_fits_a_launch_only_where_its_start_makes_no_difference(
        ) -> None:
    """``babysit run`` starts it before reading the config (``ahead.Early``), with babysit's
    own interpreter and environment: a launch that asks for another, or sets what an
    interpreter reads as it starts, cannot take it. A real process, stopped at the end."""
    early, proc = ahead.Early(), None
    try:
        command = [sys.executable, "-m", "torch.distributed.run", "train.py"]
        assert early.unfit(sys.executable, {"OMP_NUM_THREADS": "1"}, True, command) is None
        assert early.unfit(sys.executable, {}, False, command) == \
            "launch.torchrun_ahead is false"
        assert "not" in (early.unfit("/opt/other/python", {}, True, command) or "")
        assert early.unfit(sys.executable, {}, True, [sys.executable, "train.py"]) == \
            "the launch is not torchrun's"
        assert early.unfit(sys.executable, {"LD_PRELOAD": "x.so", "PYTHONPATH": "/p"}, True,
                           command) == \
            "launch.env sets LD_PRELOAD, PYTHONPATH, read as the interpreter starts"
        same = {"PYTHONPATH": os.environ["PYTHONPATH"]} if "PYTHONPATH" in os.environ else {}
        assert early.unfit(sys.executable, same, True, command) is None
        proc = early.take()
        assert proc is not None and proc.poll() is None
        assert early.take() is None  # once
        early.stop()  # taken: not its to stop
        assert proc.poll() is None
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_an_untaken_first_torchrun_is_stopped_at_once_and_stopping_twice_is_harmless() -> None:
    early = ahead.Early()
    proc = early._proc
    assert proc is not None
    started = time.monotonic()
    early.stop()
    early.stop()
    assert proc.poll() is not None and time.monotonic() - started < 5
    assert early.take() is None


def test_leftovers_are_known_by_the_run_they_were_started_for(tmp_path: Path) -> None:
    """A takeover stops what the dead supervisor of this run left: processes whose
    environment names the run directory, with their children, and a torchrun started before
    babysit read the config (its own environment names no run) by its ranks'. A stranger's
    process (a reused pid) is never signalled."""
    def tree(child_env: dict[str, str]) -> subprocess.Popen[bytes]:
        code = ("import os, subprocess, sys, time\n"
                "subprocess.Popen(['sleep', '60'], env={**os.environ, **eval(sys.argv[1])})\n"
                "time.sleep(60)\n")
        return subprocess.Popen([sys.executable, "-c", code, repr(child_env)],
                                start_new_session=True)

    run_dir = tmp_path / "run"
    ours = tree({ENV_RUN_DIR: str(run_dir)})
    stranger = tree({ENV_RUN_DIR: str(tmp_path / "another run")})
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not all(
                psutil.Process(p.pid).children() for p in (ours, stranger)):
            time.sleep(0.05)
        child = psutil.Process(ours.pid).children()[0].pid
        stopped = stop_leftovers((ours.pid, stranger.pid), run_dir, grace_s=2)
        assert stopped == sorted([ours.pid, child])
        assert ours.wait(timeout=5) is not None and stranger.poll() is None
    finally:
        for p in (ours, stranger):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def test_torchs_launcher_is_imported_with_the_collector_set_aside_then_running_as_ever(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent lives as long as its attempt: the collector must run again after the import,
    whatever became of it, and what the import built is frozen out of its collections."""
    import torch.distributed.run

    frozen = gc.get_freeze_count()
    try:
        assert ahead.import_launcher() is torch.distributed.run
        assert gc.isenabled() and gc.get_freeze_count() > frozen
        monkeypatch.setitem(sys.modules, "torch.distributed.run", None)  # an import that fails
        monkeypatch.delattr(torch.distributed, "run")
        with pytest.raises(ImportError):
            ahead.import_launcher()
        assert gc.isenabled()
    finally:
        gc.unfreeze()
