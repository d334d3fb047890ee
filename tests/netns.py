"""Real networks for multi-node tests: one network namespace per "node", each with its own
address, joined by a bridge (in a namespace of its own), as a rack's switch would join hosts.

The machine's host name still resolves as the machine has it (to 127.0.0.1 here, as on many
multi-homed hosts and containers): exactly the case where a node cannot tell the others its
own address. A partition takes one node's link down on the bridge; a slow link is a ``tc``
token bucket on it. Everything is created by the test and removed after it, and only the
addresses inside these namespaces (10.77.0.0/24, unreachable from the host) are ever targets.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator

SUBNET = "10.77.0"


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
    """``nodes`` namespaces on one bridge; node ``i`` has address ``10.77.0.<i+1>``."""

    def __init__(self, nodes: int) -> None:
        tag = f"bs{os.getpid() % 100000}"
        self.hub = f"{tag}h"
        self.names = [f"{tag}n{i}" for i in range(nodes)]

    def address(self, node: int) -> str:
        return f"{SUBNET}.{node + 1}"

    def prefix(self, node: int) -> list[str]:
        """The command prefix that runs a process inside ``node``'s namespace."""
        return ["ip", "netns", "exec", self.names[node]]

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
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def remove(self) -> None:
        for name in [*self.names, self.hub]:  # a namespace's veth ends go with it
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


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
