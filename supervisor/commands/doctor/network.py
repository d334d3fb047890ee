"""Multi-node: the address this node is reached at (fast, no torch, at every ``babysit run``)."""

from __future__ import annotations

import socket

from babysit.supervisor.commands.doctor.core import CheckResult, Context, Status
from babysit.supervisor.commands.doctor.runtime import expects_gpus
from babysit.supervisor.config import schema as cfg
from babysit.supervisor.config.address import parse_address
from babysit.supervisor.config.plan import RunPlan
from babysit.supervisor.node import launcher


def node_address(plan: RunPlan, ctx: Context) -> CheckResult:
    """Multi-node: which address the other nodes reach this node at, and whether this host's
    name would tell them another (127.0.0.1 on many multi-homed hosts and containers)."""
    name = "node address"
    if not plan.config.launch.multinode:
        return CheckResult(name, Status.SKIP, "single node")
    try:
        leader_host, leader_port = parse_address(plan.leader_address)
    except (cfg.ConfigError, ValueError) as exc:  # none, or not host:port: see "rendezvous"
        return CheckResult(name, Status.SKIP, f"no leader address ({exc})")
    local = launcher.route_source(leader_host, leader_port)
    if local is None:
        return CheckResult(name, Status.WARN, f"no route from this node to the leader's host "
                           f"{leader_host}", "Check the node's network and nodes.leader.")
    interface = launcher.interface_of(local) or "?"
    host = socket.gethostname()
    try:
        named = sorted({str(i[4][0]) for i in socket.getaddrinfo(host, None)})
    except OSError:
        named = []
    babysit_sets = (f"babysit passes torchrun --local-addr {local} and sets "
                    f"GLOO_SOCKET_IFNAME={interface} (unless you set them)")
    if local in named or not all(_loopback(a) for a in named):
        return CheckResult(name, Status.PASS, f"the others reach this node at {local} "
                           f"({interface}); {babysit_sets}")
    nccl = {**ctx.environ, **plan.config.launch.env}.get("NCCL_SOCKET_IFNAME")
    fix = None
    if nccl is None and expects_gpus(plan):
        fix = (f"Set NCCL_SOCKET_IFNAME={interface} in launch.env for NCCL jobs (babysit sets "
               f"only gloo's), or make '{host}' resolve to {local} on this node.")
    return CheckResult(
        name, Status.WARN if fix else Status.PASS,
        f"this host's name '{host}' resolves to {', '.join(named) or 'nothing'}, which the other "
        f"nodes cannot reach; they reach it at {local} ({interface}): {babysit_sets}", fix)


def _loopback(address: str) -> bool:
    return address.startswith("127.") or address == "::1"
