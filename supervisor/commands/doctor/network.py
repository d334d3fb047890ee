"""Multi-node: where the nodes meet and the address this node is reached at (fast, no torch, at
every ``babysit run``).

A multi-node start is the same on every node: node 0's torchrun opens the c10d rendezvous store
when the run starts there, and until then nothing listens on its port. That is the expected
state of a start, so it passes with a line that says so; what warns is what is wrong: a name
that does not resolve, a port on node 0 that another process holds, a host that does not
answer at all. A node that never comes is the leader's to say (``nodes.join_timeout_s``).
"""

from __future__ import annotations

import errno
import os
import socket
from urllib.parse import urlsplit

import psutil

from babysit.supervisor.commands.doctor.core import CheckResult, Context, Status
from babysit.supervisor.commands.doctor.runtime import expects_gpus
from babysit.supervisor.config import schema as cfg
from babysit.supervisor.config.address import parse_address
from babysit.supervisor.config.plan import RunPlan
from babysit.supervisor.node import launcher

RDZV_TIMEOUT_S = 3.0
"""How long a follower waits for node 0's host to answer a TCP connect."""
_TORCHRUN_DEFAULT_RDZV_PORT = 29400  # torchrun's port when --rdzv-endpoint names only a host


def rendezvous(plan: RunPlan, ctx: Context) -> CheckResult:
    """Multi-node: the rendezvous endpoint resolves; on node 0 its port is free for the store
    that node's torchrun opens there, on the other nodes node 0's host answers at it (the
    store up, or nothing listening yet: both fine)."""
    name = "rendezvous"
    launch = plan.config.launch
    endpoint = launch.rdzv_endpoint
    if endpoint is None and launch.rendezvous == "static" and launch.master_addr:
        endpoint = f"{launch.master_addr}:{launch.master_port or _TORCHRUN_DEFAULT_RDZV_PORT}"
    if endpoint is None and launch.multinode and plan.config.nodes.leader:
        leader, leader_port = parse_address(plan.config.nodes.leader)
        unresolved = _unresolved(leader, leader_port)
        if unresolved is not None:
            return CheckResult(name, Status.WARN, f"nodes.leader: '{leader}' does not resolve "
                               f"({unresolved})", _RESOLVE_FIX)
        return CheckResult(name, Status.PASS, f"the leader at {leader}:{leader_port} picks a "
                           f"fresh rendezvous port on {leader} for every attempt")
    if endpoint is None:
        if launch.nnodes == "1":
            return CheckResult(name, Status.SKIP, "single node: babysit picks a free local "
                               "port for every attempt")
        return CheckResult(name, Status.FAIL, f"nnodes is {launch.nnodes} but "
                           "launch.rdzv_endpoint and nodes.leader are unset", "Set nodes.leader "
                           "(or launch.rdzv_endpoint) to the same host:port on every node: "
                           "node 0's address and a free port.")
    try:
        parts = urlsplit(f"//{endpoint}")
        host, port = parts.hostname, parts.port or _TORCHRUN_DEFAULT_RDZV_PORT
    except ValueError:
        host, port = None, 0
    if not host:
        return CheckResult(name, Status.FAIL, f"launch.rdzv_endpoint '{endpoint}' is not "
                           "host:port", "Write it as host:port, e.g. node0.cluster:29400.")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port,
                                                             type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        return CheckResult(name, Status.WARN, f"launch.rdzv_endpoint: '{host}' does not "
                           f"resolve ({exc.strerror})", _RESOLVE_FIX)
    where = f"{host}:{port}"
    if launch.node_rank == 0:
        return _store_port(name, where, family, port)
    failed = _connect(family, kind, proto, address)
    if failed is None:
        return CheckResult(name, Status.PASS, f"{where} answers: node 0's rendezvous store "
                           "is up")
    if isinstance(failed, ConnectionRefusedError):  # the host is up, its port not open yet
        return CheckResult(name, Status.PASS, f"nothing listens at {where} yet, as expected "
                           "before node 0's torchrun opens the rendezvous store there")
    why = f"no answer within {RDZV_TIMEOUT_S:g} s" if isinstance(failed, TimeoutError) \
        else (failed.strerror or type(failed).__name__).lower()
    return CheckResult(
        name, Status.WARN, f"{where} does not answer ({why})",
        f"If node 0's host is up, a firewall drops what this node sends to port {port}; open "
        f"it between the nodes (and the leader's port, nodes.leader), or the nodes cannot "
        f"meet.")


_RESOLVE_FIX = (
    "Use node 0's IP address, or a name every node's DNS knows. Until it resolves the nodes "
    "cannot meet: the others keep trying for nodes.join_timeout_s, then the run fails. (A "
    "Kubernetes headless Service names a pod only once it runs: there, a name that resolves "
    "a moment later is fine.)")


def _store_port(name: str, where: str, family: int, port: int) -> CheckResult:
    """Node 0: the port its torchrun will open the rendezvous store on is free here."""
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            # As the store binds: a port in TIME_WAIT from an earlier run is free.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("::" if family == socket.AF_INET6 else "", port))
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            return CheckResult(name, Status.WARN, f"this node cannot listen on port {port} "
                               f"({exc.strerror or exc}), where its torchrun opens the "
                               f"rendezvous store ({where})", "Pick another port in "
                               "launch.rdzv_endpoint, the same on every node.")
        who = holder(port) or "another process (psutil cannot tell which: another user's?)"
        return CheckResult(
            name, Status.WARN, f"{who} holds port {port} on this node, where its torchrun "
            f"opens the rendezvous store ({where})",
            "Stop that process, or pick another port in launch.rdzv_endpoint, the same on "
            "every node. A leftover of this run's own workers (its babysit was killed) is "
            "stopped by this babysit before its first launch.")
    return CheckResult(name, Status.PASS, f"port {port} is free on this node: its torchrun "
                       f"opens the rendezvous store at {where} when the run starts")


def _unresolved(host: str, port: int) -> str | None:
    """Why ``host`` does not resolve, or None when it does."""
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return str(exc.strerror)
    return None


def _connect(family: int, kind: int, proto: int, address: tuple[object, ...]
             ) -> OSError | None:
    """Why a TCP connect to ``address`` failed (``TimeoutError`` after ``RDZV_TIMEOUT_S``), or
    None when something answered."""
    try:
        with socket.socket(family, kind, proto) as sock:
            sock.settimeout(RDZV_TIMEOUT_S)
            sock.connect(address)
    except OSError as exc:
        return exc
    return None


def holder(port: int) -> str | None:
    """The process listening on TCP ``port`` on this machine, as ``pid N (its command)``; None
    when psutil cannot tell (a process of another user, without the rights to see it)."""
    try:
        listening = [c for c in psutil.net_connections(kind="tcp")
                     if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port]
    except (psutil.Error, OSError):
        return None
    for conn in listening:
        if conn.pid is None:
            continue
        try:
            argv = psutil.Process(conn.pid).cmdline()
            # the program by its name, not its path: a venv's path would fill the line
            command = " ".join(" ".join([os.path.basename(argv[0]), *argv[1:]]).split()) \
                if argv else ""
        except psutil.Error:
            command = ""
        if len(command) > 80:
            command = command[:77] + "..."
        return f"pid {conn.pid}" + (f" ({command})" if command else "")
    return None


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
