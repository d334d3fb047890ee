"""Whose machine is it: machine faults traced to one node, and when that node is taken out.

A crash located on a node (``ClusterMembers.locate``: the rank that failed, its node and host)
counts against that node when its cause is the machine's, not the job's:

    hardware                a GPU fallen off the bus, an uncorrectable ECC error, an Xid ...
    SIGSEGV, SIGBUS, SIGILL native code that died of the machine it ran on (or of a driver)

So does a spike that the rerun did not reproduce (``policies.rerun``: a transient fault of the
machine), against the node of the rank whose loss moved first (``transient``).

``nodes.evict_after`` such faults on the same node (2 by default; 0 never evicts) make it
*evictable*: the next attempt runs without it, if ``launch.nnodes`` allows the nodes left. A
silent data corruption the SDC vote placed on ranks of one node makes it evictable at once:
ranks that must compute the same bits did not, and the majority says whose are wrong (a vote
with no majority, two ranks on two nodes, blames nobody). The job's own faults (a Python
exception, an OOM, a NaN) never count: a relaunch elsewhere would meet them again. Nor does a
native crash the rules traced to the data (the same batch on the same rank twice,
``policies.cause``: a decoder meeting a corrupt sample): ``forgive`` takes it back before the
next launch.

A node that is slow rather than faulty (``detectors.slow_compute``: its ranks' forward lags
the others' for minutes) is evicted only when that pays (``SlowCost``): keeping it costs the
job's lost pace over the rest of the run; evicting it costs a relaunch, and without a spare
the node's share of the work. Pure: what to do with a verdict is the leader's.
"""

from __future__ import annotations

import signal
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from babysit.policies.types import Finding, Incident
from babysit.supervisor.node.gpu_watch import describe

NATIVE_SIGNALS = {int(signal.SIGSEGV): "SIGSEGV", int(signal.SIGBUS): "SIGBUS",
                  int(signal.SIGILL): "SIGILL"}
SDC = "silent data corruption"
GPU = "GPU fault"
AT_ONCE = (SDC, GPU)
"""Faults whose witness already says whose machine it is: evicted on the first."""
TRANSIENT = "transient fault"


def machine_fault(finding: Finding) -> str | None:
    """What makes ``finding`` a fault of its node's machine (``SIGSEGV``, ``hardware crash``,
    ``silent data corruption``), or None when it is not one."""
    ev = finding.evidence
    if finding.incident is Incident.SDC:
        return None if "no_majority" in (ev.get("rules") or ()) else SDC
    if finding.incident is Incident.GPU_FAULT:
        return GPU
    if finding.incident is not Incident.CRASH:
        return None
    if ev.get("class") == "hardware":
        return "hardware crash"
    sig = ev.get("signal")
    if ev.get("class") == "signal" and isinstance(sig, int) and sig in NATIVE_SIGNALS:
        return NATIVE_SIGNALS[sig]
    return None


@dataclass
class NodeFaults:
    """Machine faults seen on each node this run, and the nodes they made evictable."""

    evict_after: int
    seen: dict[int, list[str]] = field(default_factory=dict)

    def add(self, finding: Finding) -> str | None:
        """Count ``finding`` against the node it names; the eviction's reason when this one
        makes that node evictable (once), else None."""
        node = finding.evidence.get("node")
        what = machine_fault(finding)
        if what is None or not isinstance(node, int) or self.evict_after <= 0:
            return None
        return self._count(node, what, _fault(what, finding))

    def transient(self, node: int, step: int) -> str | None:
        """A spike of ``step`` that its rerun did not reproduce, first seen on a rank of
        ``node``: as ``add``."""
        if self.evict_after <= 0:
            return None
        return self._count(node, TRANSIENT, f"{TRANSIENT} at step {step}")

    def _count(self, node: int, what: str, fault: str) -> str | None:
        faults = self.seen.setdefault(node, [])
        faults.append(fault)
        if what in AT_ONCE:  # the vote, or NVML, already told whose machine: no second chance
            return f"{fault} on its rank(s)"
        if len(faults) != self.evict_after:
            return None
        return f"{len(faults)} machine faults on it: {', '.join(faults)}"

    def forgive(self, node: int, finding: Finding) -> bool:
        """``finding`` followed the data after all (``policies.cause``: the same batch twice):
        it and the faults like it at the same step no longer count against ``node``. True when
        one was counted."""
        what = machine_fault(finding)
        faults = self.seen.get(node, [])
        if what is None or _fault(what, finding) not in faults:
            return False
        self.seen[node] = [f for f in faults if f != _fault(what, finding)]
        return True


def recall(entries: Iterable[Mapping[str, Any]], evict_after: int
           ) -> tuple[NodeFaults, dict[int, str], dict[int, str]]:
    """What a lost leader knew of the nodes' machines, read back from the run's journal by the
    leader that takes over: the faults it counted, the nodes they made evictable and not yet
    evicted, and the nodes it evicted (``faults, evictable, evicted``). The journal holds every
    finding as judged (a crash the rules traced to the data says so: taken back, as the lost
    leader's ``prepare`` did), every rerun's verdict, and the ranks' nodes (``worker_hello``)."""
    faults = NodeFaults(evict_after)
    evictable: dict[int, str] = {}
    evicted: dict[int, str] = {}
    rank_node: dict[int, int] = {}
    for e in entries:
        kind = e.get("event")
        node = e.get("node")
        if kind == "worker_hello":
            data = e.get("data")
            if isinstance(data, dict) and isinstance(data.get("node"), int) \
                    and isinstance(e.get("rank"), int):
                rank_node[e["rank"]] = data["node"]
        elif kind == "finding" and isinstance(e.get("finding"), dict):
            finding = Finding.from_json(e["finding"])
            where = finding.evidence.get("node")
            why = faults.add(finding)
            if isinstance(where, int):
                if why is not None:
                    evictable[where] = why
                if finding.evidence.get("follows") == "data" and faults.forgive(where, finding):
                    evictable.pop(where, None)
        elif kind == "rerun" and e.get("verdict") == "transient" and e.get("moved_first"):
            nodes = {rank_node.get(int(r)) for r in e["moved_first"]}
            if len(nodes) == 1 and (one := nodes.pop()) is not None:
                why = faults.transient(one, int(e.get("detected_step") or e.get("step") or 0))
                if why is not None:
                    evictable[one] = why
        elif kind == "node_evicted" and isinstance(node, int):
            evicted[node] = str(e.get("why", ""))
            evictable.pop(node, None)
    return faults, evictable, evicted


def _fault(what: str, finding: Finding) -> str:
    gpus = finding.evidence.get("gpus") if what == GPU else None
    said = describe(gpus) if isinstance(gpus, dict) else ""
    return f"{what} at step {finding.step}" + (f" ({said})" if said else "")


@dataclass(frozen=True)
class SlowCost:
    """What a slow node costs the job over ``horizon_s`` seconds kept, and evicted.

    ``slowdown``: the fraction of the job's pace lost to it (0.5: steps take twice as long);
    ``relaunch_s``: what a relaunch costs this run (measured); ``nodes``: the attempt's nodes;
    ``spare``: whether one takes its place (else the job goes on with ``nodes - 1``, doing that
    share less work: data parallelism, every node an equal share).
    """

    slowdown: float
    horizon_s: float
    relaunch_s: float
    nodes: int
    spare: bool

    @property
    def keep_s(self) -> float:
        """Seconds of the healthy job's work lost by keeping the node."""
        return self.horizon_s * self.slowdown

    @property
    def evict_s(self) -> float:
        """Seconds of the healthy job's work lost by a relaunch without it."""
        smaller = 0.0 if self.spare else self.horizon_s / max(self.nodes, 1)
        return self.relaunch_s + smaller

    @property
    def evict(self) -> bool:
        return self.keep_s > self.evict_s

    def describe(self) -> str:
        without = ("a spare in its place" if self.spare else
                   f"{self.nodes - 1} node(s) doing {1 - 1 / max(self.nodes, 1):.0%} of the work")
        return (f"keeping it costs ~{self.keep_s:.0f} s of work over the ~{self.horizon_s:.0f} s "
                f"left ({self.slowdown:.0%} slower); evicting ~{self.evict_s:.0f} s (a "
                f"relaunch of ~{self.relaunch_s:.0f} s, {without})")

    def to_json(self) -> dict[str, Any]:
        return {"slowdown": round(self.slowdown, 4), "horizon_s": round(self.horizon_s, 1),
                "relaunch_s": round(self.relaunch_s, 2), "nodes": self.nodes,
                "spare": self.spare, "keep_s": round(self.keep_s, 1),
                "evict_s": round(self.evict_s, 1), "evict": self.evict}
