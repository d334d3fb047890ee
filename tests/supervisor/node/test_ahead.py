"""torchrun started ahead (``node.ahead``): the order it reads, and which runs get one. The
process itself, started and fed, under real torchrun: ``tests/e2e/test_standby.py``."""

from __future__ import annotations

from pathlib import Path

from babysit.supervisor.config import plan as plan_mod
from babysit.supervisor.node import ahead
from babysit.supervisor.node.launcher import torchrun_command
from babysit.supervisor.node.workers import NodeWorkers


def test_an_order_carries_torchruns_arguments_environment_and_folder() -> None:
    command = ["/usr/bin/python3", "-m", "torch.distributed.run", "--nnodes", "1", "train.py"]
    order = ahead.Order.of(command, {"A": "1"}, "/work")
    assert order == ahead.Order(["--nnodes", "1", "train.py"], {"A": "1"}, "/work")
    assert ahead.Order.decode(order.encode()) == order
    assert order.encode().endswith(b"\n") and order.encode().count(b"\n") == 1
    assert ahead.Order.of(["python", "train.py"], {}, "/") is None  # not torchrun's
    assert ahead.command("/opt/py") == ["/opt/py", "-m", "babysit.supervisor.node.ahead"]


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
