"""The leader's side of a multi-node run: who takes part, what the nodes report, what they are
told.

The leader's babysitter (node rank 0) listens on ``nodes.leader``; every other node's babysitter
joins it over an authenticated channel (``supervisor.cluster.wire``). The control loop
(``babysit.supervisor.run.loop``) stays the one place that decides; this class only turns the nodes'
messages into things it can decide on, and its decisions into messages (declared, encoded and
decoded in ``supervisor.cluster.messages``)::

    follower -> leader                      leader -> follower
    summary   one node's StepSummary        launch   attempt, directive, rendezvous, nnodes
    finding   per-rank detector, hang       stop     stop the attempt's workers, say stopped
    hang_suspected  reading stacks now
    rank_died a rank's process died (its exit follows)
    hang_cleared    its ranks were working
    event     checkpoint, fingerprint, ...  control  checkpoint cadence / final checkpoint
    exited    torchrun's code, log tails    finish   the run is over
    stopped   the stop asked for is done    refused  this connection is not taken
    leaving   a signal stops the node       beat     heartbeat (both ways)
    beat      heartbeat

Two things need every node's view before the leader acts, so they *settle* for ``nodes.settle_s``: a
crash (the node whose rank failed has the telling log; the others see only a peer that closed its
connection; a rank dead of a native signal or SIGKILL is the cause by itself: ``telling``) and a
hang (the node with the stuck rank names it from its stacks; the others see ranks
waiting in a collective). A node reads its ranks' stacks before it reports a hang, which takes
seconds under load, so it says ``hang_suspected`` first and the leader waits for its view (up to
``STACK_READING_S``) however long the settle time. A node that vanishes (its connection closes, or
it is silent for ``nodes.lost_after_s``) is reported at once (``Lost``): the crashes of its peers
that follow are its consequence. An object from a follower that is no message of this version is
handed on as ``Unreadable``, with the reason, never raised.

The leader's own node takes part like any other (node 0); its messages come from the loop, not
the wire.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from babysit.policies.types import Finding, Incident, Severity, Spread
from babysit.supervisor.cluster.eviction import NATIVE_SIGNALS
from babysit.supervisor.cluster.merge import NodeMerger
from babysit.supervisor.cluster.messages import (
    Beat,
    Finish,
    FollowerMessage,
    Launch,
    LeaderMessage,
    MessageError,
    Refused,
    encode,
    from_follower,
)
from babysit.supervisor.cluster.node_view import node_name
from babysit.supervisor.cluster.wire import Listener, Peer
from babysit.supervisor.config.address import format_address, parse_address
from babysit.supervisor.config.plan import RunPlan
from babysit.supervisor.contract.directive import Directive
from babysit.supervisor.node.launcher import free_port
from babysit.supervisor.node.sketch import StepSummary

LEADER = 0
"""The node rank that leads when a run starts (another takes over if it is lost)."""


@dataclass(frozen=True, slots=True)
class Lost:
    """Never on the wire: what ``Cluster.receive`` says of a follower whose connection closed
    or that fell silent for ``nodes.lost_after_s`` (once, after its last messages)."""

    why: str
    """What happened, for the journal and the finding (``its connection closed (eof)``)."""


@dataclass(frozen=True, slots=True)
class Unreadable:
    """Never on the wire: an object a follower sent that is no message of this version."""

    error: MessageError
    """Why it could not be read: its claimed kind (``error.kind``) and what is wrong."""


Heard = FollowerMessage | Lost | Unreadable
"""What ``Cluster.receive`` hands on for each follower."""


CAUSE_SIGNALS = frozenset({*NATIVE_SIGNALS, int(signal.SIGKILL)})
"""Signals a rank dies of by itself (native code, the machine, the OOM killer), never because a
peer on another node died: that one sees a closed connection (an exception, exit 1), NCCL's
error handling aborts it (SIGABRT), or its torchrun stops it (SIGTERM)."""


def telling(exit: dict[str, Any]) -> bool:
    """A node's exit that names the crash's cause by itself: one of its ranks died of a
    ``CAUSE_SIGNALS`` signal. The other nodes can add only a closed connection, so the leader
    settles on it at once instead of waiting ``settle_s`` for them (their ranks may never exit
    by themselves: with NCCL they block in the collective until its timeout)."""
    return int(exit["code"]) != 0 and any(
        int(code) < 0 and -int(code) in CAUSE_SIGNALS for code in exit["rank_exits"].values())


@dataclass
class JobExit:
    """Every node taking part has exited (or the settle time ran out after a failure)."""

    code: int
    """0 when every node's torchrun exited 0; else the first non-zero code seen."""
    tails: dict[int, str] = field(default_factory=dict)
    """Each failed rank's log tail, from every node, by global rank."""
    root: int | None = None
    """The rank torchrun named as the first failure, on the first node that named one."""
    exits: dict[int, int] = field(default_factory=dict)
    """Each failed rank's own exit code, from every node's torchrun summary, by global rank."""
    nodes: dict[int, int] = field(default_factory=dict)
    """Each node's exit code."""

STACK_READING_S = 25.0
"""How long the leader waits for a node that is reading its ranks' stacks (two rounds of
``stacks.dump_stacks``' 10 s deadline, and some room)."""

RANK_DEATH_EXIT_S = 40.0
"""How long the leader holds a hang after a node saw a rank die, for that node's torchrun to
tear down and exit (its shutdown waits up to 30 s for the other ranks)."""


@dataclass
class _Attempt:
    """What the nodes of one attempt said about its end and its hangs."""

    nodes: list[int]
    exits: dict[int, dict[str, Any]] = field(default_factory=dict)
    failed_at: float | None = None
    hangs: dict[int, Finding] = field(default_factory=dict)
    hang_at: float | None = None
    reading_stacks: dict[int, float] = field(default_factory=dict)
    dying: dict[int, float] = field(default_factory=dict)
    """Nodes that saw one of their ranks' processes die, and since when: their exit is coming."""
    """Nodes that said they are reading their ranks' stacks for a hang, and since when."""
    stopped: set[int] = field(default_factory=set)
    done: bool = False
    peers: dict[int, Peer] = field(default_factory=dict)
    """The followers' connections this attempt was launched on."""


class Cluster:
    """The leader's view of the nodes. ``open()`` starts listening; the loop polls."""

    def __init__(self, plan: RunPlan, secret: bytes,
                 clock: Callable[[], float] = time.monotonic) -> None:
        nodes = plan.config.nodes
        self.config = nodes
        self.low, self.high = plan.config.launch.node_range
        self.ranks = self.high + nodes.spares
        """Node ranks 0..ranks-1 may join: the job's MAX, then the hot spares."""
        _, port = parse_address(plan.leader_address)
        # Every interface: the followers reach this host by the name in nodes.leader.
        self.leader_host = parse_address(plan.leader_address)[0]
        self.listener = Listener("::" if ":" in self.leader_host else "", port, secret)
        self.clock = clock
        self.me = plan.node_rank
        """The leading node's rank: 0, or the node that took over from a lost leader."""
        self.peers: dict[int, Peer] = {}
        """Followers connected now, by node rank."""
        self.hosts: dict[int, str] = {self.me: node_name()}
        self.rank_node: dict[int, int] = {}
        """Global rank -> node rank, from the hellos of the current attempt."""
        self.evicted: dict[int, str] = {}
        """Nodes taken out of the run (``cluster.eviction``), and why: never taken back."""
        self.merger = NodeMerger({self.me})
        self.attempt = _Attempt([self.me])
        self._launched = False
        """An attempt was launched by this leader (``attempt`` holds its nodes)."""
        self._backlog: list[tuple[int, Heard]] = []

    def open(self) -> None:
        self.listener.open()

    def close(self, code: int | None = None) -> None:
        """Tell every follower the run is over (with its exit code; None: tell nobody
        anything, as a fenced leader must), then hang up."""
        if code is not None:
            for peer in self.peers.values():
                peer.send(encode(Finish(code)))
        self.listener.close()

    # -- membership -------------------------------------------------------------------------------

    def accept(self) -> list[tuple[str, dict[str, Any]]]:
        """Followers that joined since the last call; returns journal entries."""
        entries = []
        for peer in self.listener.accept():
            node, host = peer.info.get("node_rank"), str(peer.info.get("host", "?"))
            old = self.peers.get(node) if isinstance(node, int) else None
            if not isinstance(node, int) or not 0 <= node < self.ranks or node == self.me:
                # Never going to work: another config, or a typo in --node-rank.
                why = (f"node rank {node!r} is not in 0..{self.ranks - 1} (launch.nnodes and "
                       f"nodes.spares) or is the leader's own ({self.me})")
                final = True
            elif node in self.evicted:
                why, final = f"node {node} was evicted from this run: {self.evicted[node]}", True
            elif old is not None and not old.closed:
                # Its previous connection may not have been seen closing yet: it may retry.
                why, final = f"node rank {node} is already taken by {self.hosts.get(node)}", False
            else:
                if old is not None:  # gone, but what it said last (its exit, its loss) counts
                    self._backlog.extend(self._hear(node, old, time.monotonic()))
                self.peers[node], self.hosts[node] = peer, host
                peer.keep_alive(self.config.heartbeat_s, encode(Beat()))
                entries.append(("node_joined", {"node": node, "host": host,
                                                "pid": peer.info.get("pid"),
                                                "address": peer.info.get("address")}))
                continue
            peer.send(encode(Refused(why, final)))
            peer.close()
            entries.append(("node_refused", {"node": node, "host": host, "reason": why}))
        if self.listener.last_rejected:
            entries.append(("node_rejected", {"why": self.listener.last_rejected,
                                              "counts": dict(self.listener.rejected)}))
            self.listener.last_rejected = ""
        return entries

    def present(self) -> list[int]:
        """Nodes that could take part in an attempt now (the leader and live followers)."""
        return [self.me, *sorted(n for n, p in self.peers.items()
                                 if not p.closed and n not in self.evicted)]

    def chosen(self, without: int | None = None) -> tuple[list[int], list[int]]:
        """The nodes the next attempt takes (the leader, then the lowest node ranks present, up
        to ``launch.nnodes``' most) and the rest, which wait as spares; ``without``: as if that
        node were gone (one about to be evicted)."""
        present = [n for n in self.present() if n != without]
        return present[:self.high], present[self.high:]

    def links(self) -> Spread | None:
        """The slowest follower's link against the others' (the lower median), by the round
        trip of its connection (``Peer.rtt``), over the running attempt's followers; named by
        the node's lowest rank. None below two followers measured (one link alone cannot say
        which end is slow) or before the attempt's ranks said where they run."""
        rtts = sorted((rtt, node) for node, peer in self.attempt.peers.items()
                      if (rtt := peer.rtt()) is not None)
        if len(rtts) < 2:
            return None
        value, node = rtts[-1]
        rank = min((r for r, n in self.rank_node.items() if n == node), default=None)
        if rank is None:
            return None
        return Spread(rank=rank, value=value, median=rtts[(len(rtts) - 1) // 2][0],
                      count=len(rtts))

    def describe(self, node: int) -> str:
        return f"node {node} ({self.hosts.get(node, '?')})"

    # -- telling the nodes ---------------------------------------------------------------------

    def launch(self, attempt: int, directive: Directive, rdzv_id: str,
               endpoint: str | None, keep: bool = False) -> tuple[list[int], str]:
        """Tell the followers the attempt takes (``chosen``) to start ``attempt``; returns the
        nodes taking part and the rendezvous endpoint. The leader's own node is node index 0 of
        the attempt. ``keep``: the nodes of the attempt before that are still here, and as
        many others as replace those gone, none added (a rerun replays the same batches only
        at the same world size: with an ElasticSampler a global batch holds other samples at
        another)."""
        nodes, _ = self.chosen()
        before = self.attempt.nodes
        if keep and self._launched:
            # Those still here, in their places; one lost is replaced, to keep the size.
            kept = [n for n in before if n in nodes]
            nodes = kept + [n for n in nodes if n not in kept][:len(before) - len(kept)]
        self._launched = True
        endpoint = endpoint or format_address(self.leader_host, free_port(""))
        self.attempt = _Attempt(nodes, peers={n: self.peers[n] for n in nodes if n != self.me})
        for index, node in enumerate(nodes):
            if node != self.me:
                self.peers[node].send(encode(Launch(
                    attempt=attempt, directive=directive, rdzv_id=rdzv_id,
                    rdzv_endpoint=endpoint, nnodes=len(nodes), node_rank=index)))
        self.merger.reset(set(nodes))
        self.rank_node = {}
        return nodes, endpoint

    def tell(self, message: LeaderMessage) -> None:
        """Send ``message`` to every follower of the current attempt (not to a babysitter that
        has since taken a lost node's place: it runs nothing of this attempt)."""
        body = encode(message)
        for peer in self.attempt.peers.values():
            peer.send(body)

    # -- hearing from the nodes ------------------------------------------------------------------

    def receive(self) -> list[tuple[int, Heard]]:
        """Every follower's messages since the last call, then ``Lost`` for followers that
        closed or fell silent (each once)."""
        out, self._backlog = self._backlog, []
        now = time.monotonic()  # the wire stamps last_heard with the real monotonic clock
        for node, peer in list(self.peers.items()):
            out.extend(self._hear(node, peer, now))
        return out

    def _hear(self, node: int, peer: Peer, now: float) -> list[tuple[int, Heard]]:
        """One follower's messages, then ``Lost`` (once) if it closed or fell silent."""
        closed = peer.closed  # before draining: the reader queues its last message, then closes
        out: list[tuple[int, Heard]] = [(node, _read(m)) for m in peer.receive()]
        silent = now - peer.last_heard
        if closed or silent > self.config.lost_after_s:
            why = (f"its babysitter was silent for {silent:.0f} s" if not closed
                   else f"its connection closed ({peer.close_reason or 'eof'})")
            peer.close()
            if self.peers.get(node) is peer:
                del self.peers[node]
            out.append((node, Lost(why)))
        return out

    def summary(self, node: int, summary: StepSummary) -> list[StepSummary]:
        """A node's summary of a step; the job's merged steps that are complete now."""
        return self.merger.add(node, summary)

    def exited(self, node: int, code: int, tails: dict[int, str], root: int | None,
               rank_exits: dict[int, int] | None = None) -> None:
        a = self.attempt
        if node not in a.nodes or node in a.exits:
            return
        a.exits[node] = {"code": code, "tails": tails, "root": root,
                         "rank_exits": rank_exits or {}}
        if code != 0 and a.failed_at is None:
            a.failed_at = self.clock()

    def rank_died(self, node: int) -> None:
        """A rank's process on ``node`` died: a crash whose exit is on its way. Until it settles,
        a stall elsewhere (ranks waiting in a collective for the dead one) is its consequence."""
        a = self.attempt
        if node in a.nodes:
            a.dying.setdefault(node, self.clock())

    def hang_suspected(self, node: int) -> None:
        """``node`` saw its ranks stall and is reading their stacks: its view is on the way."""
        a = self.attempt
        if node in a.nodes and node not in a.hangs:
            a.reading_stacks.setdefault(node, self.clock())
            if a.hang_at is None:
                a.hang_at = self.clock()

    def hang_cleared(self, node: int) -> None:
        """``node``'s ranks were found working after all: no view of a hang is coming."""
        a = self.attempt
        if a.reading_stacks.pop(node, None) is not None and not a.hangs and \
                not a.reading_stacks:
            a.hang_at = None

    def hang(self, node: int, finding: Finding) -> None:
        a = self.attempt
        if node in a.nodes:
            a.hangs.setdefault(node, finding)
            a.reading_stacks.pop(node, None)
            if a.hang_at is None:
                a.hang_at = self.clock()

    def stopped(self, node: int) -> None:
        self.attempt.stopped.add(node)

    def all_stopped(self) -> bool:
        """Every follower of the attempt said it stopped (or is gone)."""
        a = self.attempt
        return all(n in a.stopped or peer.closed for n, peer in a.peers.items())

    def settled_exit(self) -> JobExit | None:
        """The attempt's end once every node's view is in, a view that can only be the cause
        is (``telling``), or the settle time is up."""
        a = self.attempt
        if a.done or not a.exits:
            return None
        everyone = all(n in a.exits for n in a.nodes)
        if not everyone and not any(telling(e) for e in a.exits.values()) and (
                a.failed_at is None or self.clock() - a.failed_at < self.config.settle_s):
            return None
        a.done = True
        codes = {n: int(e["code"]) for n, e in a.exits.items()}
        failed = [n for n in a.exits if codes[n] != 0]  # in the order they came: cause first
        job = JobExit(code=codes[failed[0]] if failed else 0, nodes=codes)
        for n in failed:
            job.tails.update(a.exits[n]["tails"])
            job.exits.update(a.exits[n]["rank_exits"])
            if job.root is None:
                job.root = a.exits[n]["root"]
        return job

    def settled_hang(self) -> Finding | None:
        """The most telling node's hang finding: one whose stacks named a rank, else one that
        named a rank at all, else the first."""
        a = self.attempt
        if a.hang_at is None or not a.hangs:
            return None
        now = self.clock()
        if a.done:  # the attempt's end settled (a crash): the stall was its consequence
            a.hangs, a.hang_at, a.reading_stacks = {}, None, {}
            return None
        if a.failed_at is not None or \
                any(now - since < RANK_DEATH_EXIT_S for since in a.dying.values()):
            return None  # a crash is settling: it explains the stall, and is judged instead
        if any(now - since < STACK_READING_S for since in a.reading_stacks.values()):
            return None  # the node with the stuck rank is often the slowest to answer
        if len(a.hangs) < len(a.nodes) and now - a.hang_at < self.config.settle_s:
            return None
        found = list(a.hangs.values())
        a.hangs, a.hang_at, a.reading_stacks = {}, None, {}
        return max(found, key=lambda f: ("stacks" in f.evidence, bool(f.ranks)))

    def lost_finding(self, node: int, why: str, step: int) -> Finding:
        """The finding for a node that vanished, naming its ranks in this attempt."""
        ranks = tuple(sorted(r for r, n in self.rank_node.items() if n == node))
        return Finding(
            incident=Incident.NODE_LOST, detector="cluster", severity=Severity.CRITICAL,
            step=step, onset_step=step, ranks=ranks,
            message=f"{self.describe(node)} lost at step {step}: {why}",
            evidence={"node": node, "host": self.hosts.get(node), "why": why,
                      "nodes_left": [n for n in self.present() if n != node]})


def _read(obj: dict[str, Any]) -> FollowerMessage | Unreadable:
    try:
        return from_follower(obj)
    except MessageError as exc:
        return Unreadable(exc)
