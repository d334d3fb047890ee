"""The warm standby: its decisions and handshake without processes. A real torchrun standby
promoted and one that fails on its own: ``tests/e2e/test_standby.py``."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from babysit.policies.loader import load_policy
from babysit.policies.types import RankStep, StepRecord
from babysit.supervisor.config.schema import LaunchConfig
from babysit.supervisor.node import standby
from babysit.supervisor.rank import api
from babysit.supervisor.run.watch import Watch


def launch(**fields: object) -> LaunchConfig:
    return LaunchConfig.model_validate({"script": "train.py", **fields})


def test_single_node_runs_get_a_standby_unless_turned_off_or_pinned() -> None:
    assert standby.off_reason(launch(), gpus=False) is None
    assert "warm_standby" in str(standby.off_reason(launch(warm_standby=False), gpus=False))
    assert "multi-node" in str(standby.off_reason(launch(nnodes="2"), gpus=False))
    assert "fixed" in str(standby.off_reason(launch(rdzv_endpoint="10.0.0.1:29500"),
                                             gpus=False))
    # Where the job sees GPUs, auto's standby waits before the script: no CUDA context.
    assert standby.off_reason(launch(), gpus=True) is None
    assert standby.kind(launch(), gpus=True) == "imports"
    assert standby.kind(launch(), gpus=False) == "full"
    assert standby.kind(launch(warm_standby=True), gpus=True) == "full"
    assert standby.kind(launch(warm_standby="imports"), gpus=False) == "imports"
    # An import standby runs the script with Python: not with no_python.
    assert "no_python" in str(standby.off_reason(launch(no_python=True), gpus=True))
    assert standby.off_reason(launch(no_python=True, warm_standby=True), gpus=True) is None


def test_an_import_standby_runs_the_prewarm_module_with_the_script_or_module() -> None:
    from babysit.supervisor.node.launcher import PREWARM, torchrun_command
    from babysit.supervisor.rank import prewarm

    assert PREWARM == prewarm.MODULE
    common = {"python": "python", "rdzv_id": "r", "rdzv_endpoint": "127.0.0.1:1",
              "log_dir": Path("/tmp/logs")}
    script = torchrun_command(launch(args=["--lr", "3"]), Path("/p/train.py"), prewarm=True,
                              **common)  # type: ignore[arg-type]
    assert script[-5:] == ["-m", PREWARM, "/p/train.py", "--lr", "3"]
    module = torchrun_command(LaunchConfig.model_validate({"module": "pkg.train"}), None,
                              prewarm=True, **common)  # type: ignore[arg-type]
    assert module[-4:] == ["-m", PREWARM, "-m", "pkg.train"]


def test_gpus_are_visible_when_the_driver_lists_one_the_job_is_not_hidden_from(
        tmp_path: Path) -> None:
    driver = tmp_path / "gpus"
    assert not standby.gpus_visible(launch(), {}, driver)  # no NVIDIA driver here
    (driver / "0000:3b:00.0").mkdir(parents=True)
    assert standby.gpus_visible(launch(), {}, driver)
    assert not standby.gpus_visible(launch(), {"CUDA_VISIBLE_DEVICES": ""}, driver)
    assert not standby.gpus_visible(launch(env={"CUDA_VISIBLE_DEVICES": "-1"}),
                                    {"CUDA_VISIBLE_DEVICES": "0"}, driver)


def started(trigger: standby.Trigger, attempt: int = 0) -> standby.Trigger:
    trigger.new_attempt(attempt)
    trigger.observe(10.0, hello=True, stepped=True)
    return trigger


def test_a_standby_starts_only_after_an_attached_attempt_stepped_and_trained_a_while() -> None:
    trigger = standby.Trigger(None, after_s=5.0)
    assert trigger.due(100.0, True, None) is None  # no attempt yet
    trigger.new_attempt(0)
    trigger.observe(10.0, hello=False, stepped=True)  # stdout mode: steps, never a hello
    assert trigger.due(100.0, True, None) is None
    trigger.new_attempt(0)
    trigger.observe(10.0, hello=True, stepped=False)
    assert trigger.due(100.0, True, None) is None  # attached, no step yet
    trigger.observe(10.0, hello=False, stepped=True)
    assert trigger.due(14.9, True, None) is None  # its start-up still fresh
    assert trigger.due(15.0, False, None) is None  # being replaced: not watched
    assert trigger.due(15.0, True, None) == 1
    assert trigger.due(16.0, True, None) is None  # once per attempt, even if it exited
    started(trigger, 1)
    assert trigger.due(16.0, True, 2) is None  # already there
    assert trigger.due(16.0, True, None) == 2


def test_no_standby_starts_once_every_rank_closed_its_run() -> None:
    # The run ends about when a standby would be due: one started then would only take the CPU
    # the ranks' exit needs, and be stopped at once. The next attempt's trigger starts afresh.
    trigger = started(standby.Trigger(None, after_s=5.0))
    trigger.observe(14.9, hello=False, stepped=True, closed=True)
    assert trigger.due(15.0, True, None) is None
    trigger.observe(15.1, hello=False, stepped=False)  # closed stays closed for the attempt
    assert trigger.due(16.0, True, None) is None
    assert started(trigger, 1).due(16.0, True, None) == 2


def test_a_stall_in_the_first_seconds_starts_the_standby_where_cores_allow() -> None:
    # The attempt stepped at t=10 and stalls at t=11: half-way to a hang suspicion, a standby
    # starts at once where every rank has a core; else after after_s as before.
    eager = started(standby.Trigger(None, after_s=5.0, at_stall=True))
    assert eager.due(11.0, True, None) is None  # no stall: wait as before
    assert eager.due(11.0, True, None, looming=True) == 1
    patient = started(standby.Trigger(None, after_s=5.0, at_stall=False))
    assert patient.due(11.0, True, None, looming=True) is None
    assert patient.due(15.0, True, None, looming=True) == 1
    # Never before the attempt attached and stepped, nor when off.
    unattached = standby.Trigger(None, after_s=5.0, at_stall=True)
    unattached.new_attempt(0)
    assert unattached.due(11.0, True, None, looming=True) is None
    off = started(standby.Trigger("launch.warm_standby is false", at_stall=True))
    assert off.due(11.0, True, None, looming=True) is None
    assert standby.spare_cores(2, cores=2) and not standby.spare_cores(24, cores=2)


def test_a_rerun_attempt_starts_its_standby_as_it_is_launched() -> None:
    # A rerun that reproduces is followed by the skip's relaunch within seconds: its standby
    # starts with the rerun, before any hello or step of it, where every rank has a core and an
    # earlier attempt showed that the script attaches.
    soon = standby.Trigger(None, after_s=5.0, at_stall=True)
    soon.new_attempt(0)
    soon.observe(1.0, hello=True, stepped=True)
    soon.new_attempt(1, soon=True)
    assert soon.due(10.0, True, None) == 2
    # The next attempt is an ordinary one again.
    soon.new_attempt(2)
    soon.observe(20.0, hello=True, stepped=True)
    assert soon.due(20.2, True, None) is None
    # Where the ranks outnumber the cores, after its first step and after_s, as any attempt.
    crowded = standby.Trigger(None, after_s=5.0, at_stall=False)
    crowded.new_attempt(0)
    crowded.observe(1.0, hello=True, stepped=True)
    crowded.new_attempt(1, soon=True)
    assert crowded.due(10.0, True, None) is None
    crowded.observe(10.0, hello=True, stepped=True)
    assert crowded.due(10.2, True, None) is None
    assert crowded.due(15.0, True, None) == 2
    # A script no attempt of the run saw attach (stdout mode) would train a second time.
    never = standby.Trigger(None, after_s=5.0, at_stall=True)
    never.new_attempt(1, soon=True)
    assert never.due(10.0, True, None) is None


def test_no_standby_when_off() -> None:
    trigger = started(standby.Trigger("launch.warm_standby is false", after_s=0.0))
    assert trigger.due(100.0, True, None) is None


def test_ready_once_every_rank_said_so(tmp_path: Path) -> None:
    spare = standby.Standby(1, None, tmp_path, "127.0.0.1:1", started=100.0)  # type: ignore[arg-type]
    assert spare.ready_at() is None
    ready = tmp_path / standby.READY
    ready.mkdir()
    (ready / "0").write_text(json.dumps({"world_size": 2, "time": 103.0}))
    (ready / "1.tmp").write_text("{")  # half-written: not counted
    assert spare.ready_at() is None
    (ready / "1").write_text(json.dumps({"world_size": 2, "time": 104.5}))
    assert spare.ready_at() == 104.5
    assert spare.launch_fields(110.0) == {"standby": True, "standby_kind": "full",
                                          "rdzv_endpoint": "127.0.0.1:1",
                                          "standby_age_s": 10.0, "standby_ready_s": 5.5}


def test_a_starting_standby_is_babysits_own_load_for_a_minute_at_most(tmp_path: Path) -> None:
    spare = standby.Standby(1, None, tmp_path, "", started=100.0)  # type: ignore[arg-type]
    assert spare.warming(101.0)
    assert not spare.warming(100.0 + standby.WARMING_MAX_S)  # one never ready blinds no one
    ready = tmp_path / standby.READY
    ready.mkdir()
    (ready / "0").write_text(json.dumps({"world_size": 1, "time": 104.0}))
    assert not spare.warming(105.0)


def test_steps_under_babysits_own_load_are_not_judged_for_throughput() -> None:
    watch = Watch(load_policy("default"))

    def slow_steps(first: int, step_time: float) -> list[str]:
        found = []
        for s in range(first, first + 40):
            rank = RankStep(rank=0, step=s, time=float(s), cursor=s, loss=1.0,
                            step_time=step_time, tokens=4096.0)
            record = StepRecord(step=s, time=float(s), ranks=(rank,), world_size=1)
            found += [f.detector for f in watch.observe_record(record)]
        return found
    assert slow_steps(1, 0.5) == []  # the baseline
    watch.own_load = True  # the warm standby starting
    assert slow_steps(41, 1.0) == []  # 2x slower, but babysit's doing
    watch.own_load = False
    assert slow_steps(81, 1.0) == ["throughput"]  # the run's own: judged against the baseline


def test_a_standby_rank_waits_in_attach_until_promoted(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    spare = standby.Standby(1, None, tmp_path, "", started=0.0)  # type: ignore[arg-type]
    go = threading.Timer(0.3, spare.promote)
    go.start()
    t0 = time.monotonic()
    api._await_promotion(tmp_path, 2, 0)
    assert 0.25 < time.monotonic() - t0 < 2.0
    said = json.loads((tmp_path / standby.READY / "1").read_text())
    assert said["world_size"] == 2 and said["time"] <= time.time()


def test_a_standby_rank_whose_supervisor_died_exits(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # reaped: its pid names no process now
    with pytest.raises(SystemExit) as exit_:
        api._await_promotion(tmp_path, 1, gone.pid)
    assert exit_.value.code == 0


def test_a_cold_start_sets_an_unpromoted_standbys_logs_aside(tmp_path: Path) -> None:
    standby.set_aside(tmp_path)  # no standby ran here: nothing moves
    (tmp_path / "launcher.log").write_text("a cold attempt's own")
    standby.set_aside(tmp_path)
    assert (tmp_path / "launcher.log").exists()
    (tmp_path / standby.FOLDER).mkdir()
    (tmp_path / "torchrun" / "run_x" / "attempt_0" / "0").mkdir(parents=True)
    (tmp_path / "torchrun" / "run_x" / "attempt_0" / "0" / "stderr.log").write_text("import err")
    standby.set_aside(tmp_path)
    assert not (tmp_path / "torchrun").exists() and not (tmp_path / "launcher.log").exists()
    moved = tmp_path / standby.FOLDER / "torchrun" / "run_x" / "attempt_0" / "0" / "stderr.log"
    assert moved.read_text() == "import err"
