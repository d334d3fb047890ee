"""Real networks for multi-node tests: one network namespace per "node", each with its own
address, joined by a bridge (in a namespace of its own), as a rack's switch would join hosts.

The machine's host name still resolves as the machine has it (to 127.0.0.1 here, as on many
multi-homed hosts and containers): exactly the case where a node cannot tell the others its
own address. A partition takes one node's link down on the bridge; a slow link is a ``tc``
token bucket on it. Everything is created by the test and removed after it, and only the
addresses inside these namespaces (10.77.0.0/24, unreachable from the host) are ever targets.
Each node's processes also get a ``/dev/shm`` of their own (``prefix``).

A network may also give each node a host name (``names``: an ``/etc/hosts`` of its own, which
``ip netns exec`` mounts over the machine's for what runs in it) and the bridge's namespace an
address of its own (``HUB``, 10.77.0.254, for a service every node reaches: a scheduler's
controller, as on a cluster's head node).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

SUBNET = "10.77.0"
HUB = f"{SUBNET}.254"
"""The bridge's own address, in its namespace (``Network(hub=True)``)."""
NETNS_ETC = Path("/etc/netns")
"""Where ``ip netns exec NAME`` finds files to mount over ``/etc`` (``NAME/hosts``)."""


def available() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    probe = f"bsprobe{os.getpid() % 100000}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


class Network:
    """``nodes`` namespaces on one bridge; node ``i`` has address ``10.77.0.<i+1>``.

    ``hosts``: a host name for each node (``hosts[i]`` resolves to node ``i``'s address in
    every namespace of the network, the hub's too); ``hub``: the bridge's namespace gets
    ``HUB`` (resolving as ``hub_name``)."""

    def __init__(self, nodes: int, hosts: list[str] | None = None, hub: bool = False,
                 hub_name: str = "hub") -> None:
        tag = f"bs{os.getpid() % 100000}"
        self.hub = f"{tag}h"
        self.names = [f"{tag}n{i}" for i in range(nodes)]
        self.hosts = hosts or []
        self.hub_address = HUB if hub else None
        self.hub_name = hub_name

    def address(self, node: int) -> str:
        return f"{SUBNET}.{node + 1}"

    def prefix(self, node: int) -> list[str]:
        """The command prefix that runs a process inside ``node``'s namespace, with a shared
        memory (``/dev/shm``) of its own, as a machine has: ``ip netns exec`` gives what it runs
        a mount namespace of its own (mounts made there never reach the host's), and a tmpfs
        mounted there is gone with the last process of it, as a dead machine's memory is. What
        babysit keeps in shared memory (marks, memory copies) is then really node-local."""
        return ["ip", "netns", "exec", self.names[node], "sh", "-c",
                'mount -t tmpfs -o size=25% tmpfs /dev/shm && exec "$@"', "node-shm"]

    def hub_prefix(self) -> list[str]:
        """The command prefix that runs a process in the bridge's namespace (``HUB``)."""
        return ["ip", "netns", "exec", self.hub]

    def pids(self, node: int) -> list[int]:
        """Every process in ``node``'s namespace."""
        done = subprocess.run(["ip", "netns", "pids", self.names[node]], capture_output=True,
                              text=True)
        return [int(p) for p in done.stdout.split()]

    def kill(self, node: int) -> list[int]:
        """SIGKILL every process in ``node``'s namespace, as a machine that died would lose
        them; returns their pids."""
        pids = self.pids(node)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return pids

    def cut(self, node: int) -> None:
        """A partition: ``node``'s link to the others goes down (the node itself lives)."""
        _ip("-n", self.hub, "link", "set", f"h{node}", "down")

    def heal(self, node: int) -> None:
        _ip("-n", self.hub, "link", "set", f"h{node}", "up")

    def slow(self, node: int, rate: str) -> None:
        """A slow link: ``node``'s link runs at ``rate`` (``tc`` units, e.g. ``200kbit``) both
        ways, a token bucket on either end of it (a NIC that came up at a fraction of its
        speed). A token bucket, not ``netem``: this kernel has no ``netem``."""
        for where, dev in ((self.hub, f"h{node}"), (self.names[node], "eth0")):
            _tc("-n", where, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                "burst", "1600", "latency", "400ms")

    def __enter__(self) -> Network:
        self.remove()  # what an earlier test of this process failed to remove (same names)
        try:
            _ip("netns", "add", self.hub)
            _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.hub, "link", "set", "br0", "up")
            for node, name in enumerate(self.names):
                _ip("netns", "add", name)
                _ip("-n", self.hub, "link", "add", f"h{node}", "type", "veth", "peer", "name",
                    "eth0", "netns", name)
                _ip("-n", self.hub, "link", "set", f"h{node}", "master", "br0", "up")
                _ip("-n", name, "addr", "add", f"{self.address(node)}/24", "dev", "eth0")
                _ip("-n", name, "link", "set", "eth0", "up")
                _ip("-n", name, "link", "set", "lo", "up")
            if self.hub_address is not None:
                _ip("-n", self.hub, "addr", "add", f"{self.hub_address}/24", "dev", "br0")
                _ip("-n", self.hub, "link", "set", "lo", "up")
            if self.hosts or self.hub_address is not None:
                self._write_hosts()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def _write_hosts(self) -> None:
        names = [f"{self.address(i)} {host}\n" for i, host in enumerate(self.hosts)]
        if self.hub_address is not None:
            names.append(f"{self.hub_address} {self.hub_name}\n")
        machine = Path("/etc/hosts").read_text()
        for name in [*self.names, self.hub]:
            (NETNS_ETC / name).mkdir(parents=True, exist_ok=True)
            (NETNS_ETC / name / "hosts").write_text(machine + "".join(names))

    def remove(self) -> None:
        for name in [*self.names, self.hub]:  # a namespace's veth ends go with it
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            shutil.rmtree(NETNS_ETC / name, ignore_errors=True)


@contextlib.contextmanager
def network(nodes: int) -> Iterator[Network]:
    with Network(nodes) as net:
        yield net


def _tc(*args: str) -> None:
    done = subprocess.run(["tc", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"tc {' '.join(args)}: {done.stderr.strip()}")


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
