"""Where a node stands in a multi-node attempt (``launcher.Placement``): what torchrun and gloo
are told when the user did not say, and that what the user said wins."""

from __future__ import annotations

from pathlib import Path

from babysit.supervisor.config.schema import LaunchConfig
from babysit.supervisor.node import launcher
from babysit.supervisor.node.launcher import Placement


def launch(**fields: object) -> LaunchConfig:
    return LaunchConfig.model_validate({"script": "train.py", "nnodes": "2", **fields})


def test_the_leaders_node_hosts_the_store_and_each_node_says_its_own_address() -> None:
    host, env = Placement(rdzv_host=True, local_addr="127.0.0.1").apply(launch(), {})
    assert host.rdzv_conf == "is_host=1" and host.local_addr == "127.0.0.1"
    assert env == {"GLOO_SOCKET_IFNAME": "lo"}  # the interface holding that address
    follower, _ = Placement(rdzv_host=False, local_addr="127.0.0.1").apply(
        launch(rdzv_conf="join_timeout=900"), {})
    assert follower.rdzv_conf == "join_timeout=900,is_host=0"
    cmd = launcher.torchrun_command(follower, None, python="python", rdzv_id="r",
                                    rdzv_endpoint="10.0.0.1:29400", log_dir=Path("logs"))
    assert cmd[cmd.index("--local-addr") + 1] == "127.0.0.1"


def test_what_the_user_set_wins_and_an_endpoint_nobody_vouches_for_is_left_alone() -> None:
    mine = launch(rdzv_conf="is_host=0", local_addr="gpu-7.cluster")
    kept, env = Placement(rdzv_host=True, local_addr="127.0.0.1").apply(
        mine, {"GLOO_SOCKET_IFNAME": "ib0"})
    assert kept.rdzv_conf == "is_host=0" and kept.local_addr == "gpu-7.cluster" and env == {}
    unsure, _ = Placement(rdzv_host=None, local_addr=None).apply(launch(), {})
    assert unsure.rdzv_conf is None and unsure.local_addr is None
    static, _ = Placement(rdzv_host=True, local_addr=None).apply(
        launch(rdzv_backend="static"), {})
    assert static.rdzv_conf is None  # is_host is the c10d backend's


def test_an_address_no_interface_holds_sets_no_interface() -> None:
    assert launcher.interface_of("192.0.2.123") is None  # TEST-NET-1: never on a host
    assert launcher.route_source("127.0.0.1", 9) == "127.0.0.1"
