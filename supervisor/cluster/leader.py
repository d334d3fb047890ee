"""The leader's members: every node's workers, as the one control loop sees them.

A multi-node run's leader is the single-node loop (``run.loop.Supervisor``) with these members
in place of ``run.members.LocalMembers``; the state machine, the rules, recovery, cadence,
alerts and the journal are the same objects doing the same things. What the members do, by the
loop's call::

    ready     listen for the other nodes; wait for every node ``launch.nnodes`` allows
    launch    the nodes present take part: same attempt, directive and rendezvous; a node
              short of the minimum is paged and waited for
    gather    this node's tick (``node.tick``: per-rank detectors, hang timers, torchrun's
              exit) and the other nodes' messages (joins, summaries, findings, rank events,
              exits, losses): the nodes' summaries merge into the job's steps (``NodeMerger``),
              a crash or a hang settles until every node's view is in (``Cluster``)
    stop      every node stops its workers; the leader waits until they say so
    request   the control file here, and the same request to every node
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Mapping
from typing import Any

from babysit.policies.rerun import TRANSIENT as TRANSIENT_VERDICT
from babysit.policies.types import Action, Finding, Incident, Remedy, Severity
from babysit.supervisor.cluster import keeping, leadership
from babysit.supervisor.cluster.eviction import NodeFaults, SlowCost, recall
from babysit.supervisor.cluster.leadership import Lease, LeaseWatch, Term
from babysit.supervisor.cluster.membership import (
    Cluster,
    Heard,
    JobExit,
    Lost,
    Unreadable,
)
from babysit.supervisor.cluster.messages import (
    Control,
    Exited,
    Finish,
    HangCleared,
    HangSuspected,
    Leaving,
    NodeFinding,
    RankDied,
    RankEvent,
    Stop,
    Stopped,
    Summary,
    encode,
)
from babysit.supervisor.cluster.node_view import NodeView, located
from babysit.supervisor.config.plan import RunPlan
from babysit.supervisor.config.slurm import Taken
from babysit.supervisor.contract.directive import Directive
from babysit.supervisor.contract.protocol import WorkerEvent, mfu_inputs
from babysit.supervisor.node import ahead, standby
from babysit.supervisor.node.aggregate import with_rates
from babysit.supervisor.node.gpu_watch import GpuWatch
from babysit.supervisor.node.last_step import Outcome
from babysit.supervisor.node.launcher import Placement
from babysit.supervisor.node.sketch import StepSummary, SummaryRecord
from babysit.supervisor.node.tick import OwnNode
from babysit.supervisor.node.workers import NodeWorkers
from babysit.supervisor.run import exit_codes, journal, run_dir
from babysit.supervisor.run.members import (
    Entry,
    Fenced,
    Gathered,
    JobEnd,
    MembersMissing,
    OnThisNode,
    Voice,
)

TICK_S = 0.1
_ABOUT_AN_ATTEMPT = (Summary, NodeFinding, HangSuspected, HangCleared, RankDied, RankEvent, Exited,
                     Stopped)
"""The follower messages that say something about one attempt (and carry its number)."""
LOST_EXIT_CODE = 137
"""The exit a lost node's torchrun is counted with: killed, as far as anyone can tell."""
SLOW_DETECTORS = ("slow_compute", "slow_link")
"""The detectors that name a slow node (weighed for eviction)."""


class ClusterMembers(OnThisNode):
    """Every node of a multi-node run, led from node rank 0 (this process)."""

    scope = "job"

    def __init__(self, plan: RunPlan, secret: bytes, term: Term, lease: Lease,
                 expect: list[int] | None = None, early: ahead.Early | None = None) -> None:
        """``term``: the leadership this babysitter won (``cluster.leadership``); ``lease``:
        its own, beating. ``expect``: after taking over from a lost leader, the nodes of the
        last attempt still to be waited for (briefly); None waits for ``launch.nnodes``."""
        self.plan = plan
        self.clock = time.monotonic
        self.term, self.lease, self.expect = term, lease, expect
        self._term_checked = 0.0
        self.fenced: str | None = None
        self.workers = NodeWorkers(plan, plan.run_dir, early)
        self.view = NodeView.from_plan(plan, plan.node_rank)
        self.node: OwnNode[tuple[list[StepSummary], list[Finding]]] = OwnNode(
            self.workers, self.view, flush_on_exit=True,
            gpus=GpuWatch(plan.config.schedule.health_every_s), on_ending=self._ending_here,
            others_up=self._others_up)
        self._ending: str | None = None
        """Ranks are ending on their own somewhere (a crash, a SIGTERM, a lost node): the
        fault the just-in-time save at the end of this tick is for (``_keep_last_step``)."""
        self._hang_settled = False
        """A hang of the running attempt was settled: its relaunch keeps the last step."""
        self.cluster = Cluster(plan, secret, self.clock)
        launch = plan.config.launch
        self._standby_off = standby.off_reason(launch, standby.gpus_visible(launch))
        """Why every relaunch is cold (multi-node: always a reason)."""
        self._voice: Voice | None = None
        self._attempt = -1
        self._step = 0
        """The newest merged step."""
        self._reported = 0
        """The newest step any node reported: what a lost node's finding is dated with. Its own
        last steps never merge, and the others' ranks may have finished (and saved) one more
        than the job's merged step: a relaunch's checkpoint is one before the finding's next
        step, and the one the ranks saved must not be left out for an older one (the attempt
        after it trained those steps again and saved the same step twice)."""
        self._crash_tails: dict[int, str] = {}
        """The failed ranks' log tails from every node, for the crash's incident folder."""
        self.faults = NodeFaults(plan.config.nodes.evict_after)
        self._evictable: dict[int, str] = {}
        """Nodes the machine faults traced to them made evictable, not yet evicted."""
        self._grown = -1
        """The attempt whose growth was asked for (``_grow_at``): once per attempt."""
        self._rerunning = False
        """The running attempt is a spike's rerun on the nodes of the attempt it replays, its
        verdict not in yet: a node that joined waits for it (``_grow_at``)."""
        self._first_pass: dict[int, int] = {}
        """The rank -> node map of the attempt a rerun replays: its verdict's ranks that moved
        first are that attempt's (a node lost and replaced moves ranks between nodes)."""
        self._began = self.clock()
        self._launched: float | None = None
        """When the running attempt was launched, until its first merged step."""
        self._starts: list[float] = []
        self._stops: list[float] = []
        """Each attempt's launch to first step, and each stop: what a relaunch costs here."""
        self._slow: tuple[int, str] | None = None
        """A slow node to take out at the attempt's next checkpoint, and why."""
        self._flops_per_token: float | None = None
        self._peak_flops: float | None = None

    @property
    def voice(self) -> Voice:
        assert self._voice is not None, "ready() first"
        return self._voice

    # -- the members interface ------------------------------------------------------------------

    def ready(self, voice: Voice) -> None:
        """Listen, then wait for every node ``launch.nnodes`` allows, or the fewest it allows."""
        self._voice = voice
        try:
            self.cluster.open()
        except OSError as exc:
            raise MembersMissing(
                f"cannot listen for the other nodes at {self.plan.leader_address} "
                f"({exc.strerror or exc}): another run holds the port, or the host is not this "
                f"machine; change nodes.leader") from None
        voice.journal("leader_listening", address=self.plan.leader_address,
                      nnodes=self.plan.config.launch.nnodes, term=self.term.epoch,
                      node=self.cluster.me)
        low, high = self.cluster.low, self.cluster.high
        timeout = self.plan.config.nodes.join_timeout_s
        want = high
        if self.expect is not None:  # a takeover: the last attempt's nodes find us by the term
            want = len({self.cluster.me, *self.expect})
            timeout = 2 * self.plan.config.nodes.lost_after_s
            self._took_over(voice)
        spares = self.plan.config.nodes.spares
        voice.log(f"babysit: leading {low if low == high else f'{low} to {high}'} nodes "
                  + (f"and {spares} spare(s) " if spares else "")
                  + f"({self.term.describe()}); waiting for the others at "
                  f"{self.plan.leader_address}")
        if not self._await_nodes(want, timeout)[0] and \
                (len(self.cluster.present()) < low or voice.stopping()):
            raise MembersMissing(
                f"only {len(self.cluster.present())} of at least {low} nodes joined within "
                f"{timeout:g} s (nodes.join_timeout_s); check that every node runs babysit "
                f"with the same secret and can reach {self.plan.leader_address}",
                lost=self.expect is not None)

    def _took_over(self, voice: Voice) -> None:
        """Say in the run's record that the leader was lost and this node leads now; and know
        what it knew of the nodes' machines (``eviction.recall``)."""
        self.faults, evictable, evicted = recall(
            journal.read(self.plan.shared_dir / "events.jsonl"), self.plan.config.nodes.evict_after)
        self._evictable.update(evictable)
        self.cluster.evicted.update(evicted)
        lost = leadership.read(self.plan.shared_dir, self.term.epoch - 1)
        if lost is None or lost.node == self.cluster.me:
            return
        why = (f"its babysitter stopped beating its lease; node {self.cluster.me} "
               f"({self.view.host}) leads from here ({self.term.describe()})")
        voice.journal("node_lost", node=lost.node, host=lost.host, why=why)
        voice.journal("leader_changed", term=self.term.epoch, node=self.cluster.me,
                      host=self.view.host, previous=lost.node, previous_host=lost.host)
        voice.alert(Severity.CRITICAL, f"the leader, node {lost.node} ({lost.host}), is lost; "
                                       f"node {self.cluster.me} ({self.view.host}) took over "
                                       f"the run from the newest good checkpoint")

    def launch(self, attempt: int, directive: Directive, now: float,
               keep_nodes: bool = False) -> dict[str, Any]:
        self._term_checked = 0.0
        self._rerunning = keep_nodes
        self._first_pass = dict(self.cluster.rank_node) if keep_nodes else {}
        self._check_term()  # never start ranks under a term another node has taken
        self._evict()
        self._launched, self._slow = self.clock(), None
        present = len(self.cluster.present())
        if present < self.cluster.low:
            self._await_rejoin(present)
        launch = self.plan.config.launch
        rdzv_id = launch.rdzv_id or f"{self.plan.name}-{attempt}"
        nodes, endpoint = self.cluster.launch(attempt, directive, rdzv_id, launch.rdzv_endpoint,
                                              keep=keep_nodes)
        self._attempt = attempt
        self._ending, self._hang_settled = None, False
        place = Placement.in_attempt(endpoint, self.cluster.leader_host, leads=True,
                                     local_addr=self.cluster.leader_host)
        command = self.node.launch(attempt, directive, now, lambda: self.workers.launch(
            attempt, directive, rdzv_endpoint=endpoint, rdzv_id=rdzv_id,
            nnodes=str(len(nodes)), node_rank=0, place=place))
        _, spares = self.cluster.chosen()
        waiting = f"; spare(s) waiting: {', '.join(map(str, spares))}" if spares else ""
        self.voice.log(f"babysit: attempt {attempt} on {len(nodes)} node(s): "
                       f"{', '.join(self.cluster.describe(n) for n in nodes)}{waiting}")
        assert self.workers.group is not None
        return {"pid": self.workers.group.pid, "command": command, "rdzv_endpoint": endpoint,
                "standby": False, "standby_off": self._standby_off,
                "torchrun_ahead": self.workers.launched_ahead, "nodes": nodes,
                "hosts": {str(n): self.cluster.hosts.get(n, self.view.host) for n in nodes},
                "spares": {str(n): self.cluster.hosts.get(n, "?") for n in spares},
                **Taken.fields(self.plan.slurm)}

    def stop(self, reason: str, *, replacing: bool = False) -> int | None:
        moot = Gathered()
        if replacing and self._hang_settled:  # a relaunch after a hang: keep its last step
            moot.entries += self._keep_last_step("hang", moot, watching=False)
        self.cluster.attempt.done = True  # what the nodes say of its end is moot now
        began = self.clock()
        self.cluster.tell(Stop(reason, replacing))
        code = self.node.stop(replacing)
        deadline = self.clock() + self.plan.config.launch.stop_grace_s + 10.0
        while not self.cluster.all_stopped() and self.clock() < deadline:
            time.sleep(TICK_S)
            for node, message in self.cluster.receive():
                if isinstance(message, (Stopped, Lost, Leaving)):
                    self._node_message(node, message, moot, watching=False)
        for event, fields in moot.entries:
            self.voice.journal(event, **fields)
        missing = [n for n in self.cluster.attempt.nodes
                   if n != self.cluster.me and n not in self.cluster.attempt.stopped]
        self.voice.journal("nodes_stopped", missing=missing)
        self._stops.append(self.clock() - began)
        return code

    def request(self, **fields: Any) -> None:
        self.workers.control.request(**fields)
        self.cluster.tell(Control(fields))

    def gather(self, now: float, watching: bool) -> Gathered:
        self._check_term()
        out = Gathered()
        self._own_node(now, watching, out)
        # Settled before this tick's messages: a node lost in this tick is judged first, and
        # once its remedy stops the workers, the others' exits are its consequence.
        if watching:
            hang = self.cluster.settled_hang()
            if hang is not None:
                out.findings.append(hang)
                self._hang_settled = True
            end = self.cluster.settled_exit()
            if end is not None:
                out.end = self._job_end(end, out)
        out.entries.extend(self.cluster.accept())
        out.entries.extend(self.workers.take_standby_entries())  # its torchrun ahead's
        for node, message in self.cluster.receive():
            self._node_message(node, message, out, watching)
        if self._ending is not None and watching:
            out.entries += self._keep_last_step(self._ending, out, watching)
        return out

    def _ending_here(self, fault: str) -> None:
        self._ending = self._ending or fault

    def keep_last_step(self, fault: str) -> Outcome | None:
        moot = Gathered()  # the run is stopping: what the nodes say meanwhile is recorded only
        outcome = self._keep(fault, moot, watching=False)
        for event, fields in moot.entries:
            self.voice.journal(event, **fields)
        return outcome

    def _keep(self, fault: str, out: Gathered, watching: bool) -> Outcome | None:
        """The just-in-time save of the last completed step from every node's ranks, once per
        attempt (``cluster.keeping``): what the nodes say meanwhile is handled as ever."""
        return self.workers.keep_last_step(
            fault, keeping.OtherNodes(
                self.cluster, self.cluster.rank_node,
                lambda node, message: self._node_message(node, message, out, watching)))

    def _keep_last_step(self, fault: str, out: Gathered, watching: bool) -> list[Entry]:
        outcome = self._keep(fault, out, watching)
        if outcome is None:
            return []
        return [outcome.entry()]

    def live_nodes(self) -> list[int]:
        return sorted({self.cluster.me, *self.cluster.present()})

    def tails(self, attempt: int) -> dict[int, str]:
        tails = {**self.workers.tails(attempt, 8192), **self._crash_tails}
        self._crash_tails = {}
        return tails

    def locate(self, finding: Finding) -> Finding:
        """The finding with its node and host; a machine fault is also counted against that
        node (``cluster.eviction``), for the next launch to act on. Ranks on several nodes (an
        SDC vote that could not tell which was wrong) place it on none."""
        nodes = {self.cluster.rank_node.get(rank, self.cluster.me) for rank in finding.ranks}
        if len(nodes) != 1:
            return finding
        node = nodes.pop()
        placed = located(finding, node, self.cluster.hosts.get(node, self.view.host))
        self._evictable_if(node, self.faults.add(placed))
        if placed.detector in SLOW_DETECTORS:
            placed = self._slow_node(node, placed)
        return placed

    def hear(self, entry: Mapping[str, Any]) -> None:
        """A rerun that did not reproduce its spike: a transient fault of the machine of the
        rank that moved first, counted against its node when the ranks that moved first are
        on one node. Any verdict ends the rerun: a node waiting to join may now."""
        self._rerunning = False
        if entry.get("verdict") != TRANSIENT_VERDICT or not entry.get("moved_first"):
            return
        where = self._first_pass or self.cluster.rank_node
        nodes = {where.get(int(rank)) for rank in entry["moved_first"]}
        node = nodes.pop() if len(nodes) == 1 else None
        if node is not None:
            self._evictable_if(node, self.faults.transient(node, int(entry.get("detected_step")
                                                                     or entry.get("step") or 0)))

    def _slow_node(self, node: int, finding: Finding) -> Finding:
        """A node whose ranks' compute, or whose link, lags the others': evicted at the next
        checkpoint when
        keeping it costs more than a relaunch without it (``eviction.SlowCost``). The verdict
        and its numbers go into the finding (and so its alert and the journal)."""
        nodes = self.plan.config.nodes
        slowdown = finding.evidence.get("slowdown")
        running = self.cluster.attempt.nodes
        if not isinstance(slowdown, float | int) or not self._starts or node not in running:
            return finding
        taking, _ = self.cluster.chosen(node)
        cost = SlowCost(
            slowdown=float(slowdown),
            horizon_s=nodes.run_left_s or self.clock() - self._began,
            relaunch_s=statistics.median(self._starts)
            + (statistics.median(self._stops) if self._stops else 0.0),
            nodes=len(running), spare=len(taking) >= len(running))
        host = self.cluster.hosts.get(node, "?")
        if not cost.evict:
            kept: str | None = "it costs less than a relaunch without it"
        elif not nodes.evict_slow:
            kept = "nodes.evict_slow is false"
        elif node == self.cluster.me:
            kept = "it is the leader's own node"
        elif len(taking) < self.cluster.low:
            kept = f"{len(taking)} node(s) would be left, below the minimum {self.cluster.low}"
        else:
            kept = None
        if kept is None:
            why = f"{_what_is_slow(finding)} ({cost.describe()})"
            self._slow = (node, why)
        verdict = ("evicting it at the next checkpoint" if kept is None else f"kept: {kept}")
        self.voice.journal("slow_node_cost", node=node, host=host, detected_step=finding.step,
                           verdict="evict" if kept is None else "keep", kept=kept,
                           **cost.to_json())
        return dataclasses.replace(
            finding, message=f"{finding.message}; {verdict} ({cost.describe()})",
            evidence={**finding.evidence, "cost": cost.to_json(), "verdict": verdict})

    def _evictable_if(self, node: int, why: str | None) -> None:
        if why is not None:
            self._evictable[node] = why

    def prepare(self, remedy: Remedy | None, attempt: int) -> list[Entry]:
        """A fault the rules traced to the data (the same batch twice: skipped) was not the
        machine's after all: it no longer counts against its node, which stays in."""
        if remedy is not None and remedy.finding.evidence.get("follows") == "data":
            node = remedy.finding.evidence.get("node")
            if isinstance(node, int) and self.faults.forgive(node, remedy.finding):
                self._evictable.pop(node, None)
        slow = self._slow_going(remedy)
        if slow is not None:
            self._evictable[slow[0]] = slow[1]
        return []

    def _slow_going(self, remedy: Remedy | None) -> tuple[int, str] | None:
        """The slow node this relaunch leaves out, and why: the one its ``slow_node`` finding
        names, or one the cost said to evict whose checkpoint has not come yet, when this
        relaunch (for another reason) comes first and the policy relaunches for slow nodes."""
        if remedy is None:
            return None
        ev = remedy.finding.evidence
        if remedy.finding.incident is Incident.SLOW_NODE and isinstance(ev.get("node"), int):
            return ev["node"], str(ev.get("why", ""))
        ladder = self.view.watch.policy.incidents.slow_node.ladder
        return self._slow if ladder[0] is Action.RELAUNCH else None

    def close(self, code: int | None) -> list[Entry]:
        if self.fenced is not None:  # another leads: command nobody, keep nothing running
            self.cluster.close(None)
            self.close_workers()
            return []
        self.cluster.close(code if code is not None else 1)
        return self.close_workers()

    # -- eviction ---------------------------------------------------------------------------------

    def _evict(self) -> None:
        """Take out each evictable node the run can do without: the next attempt runs on the
        others. Never this leader's own node, nor below ``launch.nnodes``' minimum."""
        for node, why in list(self._evictable.items()):
            del self._evictable[node]
            host = self.cluster.hosts.get(node, "?")
            left = [n for n in self.cluster.present() if n != node]
            if node == self.cluster.me or len(left) < self.cluster.low:
                reason = ("it is the leader's own node" if node == self.cluster.me else
                          f"{len(left)} node(s) would be left, below the minimum "
                          f"{self.cluster.low} (launch.nnodes)")
                self.voice.journal("node_kept", node=node, host=host, why=why, kept=reason)
                self.voice.alert(Severity.WARNING, f"node {node} ({host}) should be evicted "
                                 f"({why}) but is kept: {reason}")
                continue
            self.cluster.evicted[node] = why
            peer = self.cluster.peers.get(node)
            if peer is not None:  # its babysitter leaves with the code a scheduler replaces
                peer.send(encode(Finish(exit_codes.REQUEUE)))
            run_dir.exclude_hosts(self.plan.shared_dir, [host])
            self.voice.journal("node_evicted", node=node, host=host, why=why, nodes_left=left)
            self.voice.alert(Severity.CRITICAL, f"node {node} ({host}) evicted: {why}; "
                             f"{self._going_on(node)}")

    def _going_on(self, without: int) -> str:
        """How the next attempt goes on without node ``without``: at full size with a spare in
        its place, or on fewer nodes."""
        attempt = self.cluster.attempt.nodes
        taking, _ = self.cluster.chosen(without)
        spare = [n for n in taking if n not in attempt]
        if without in attempt and spare and len(taking) >= len(attempt):
            return (f"spare {self.cluster.describe(spare[0])} takes its place; continuing on "
                    f"{len(taking)} node(s)")
        return f"continuing on {len(taking)} node(s)"

    # -- the term ---------------------------------------------------------------------------------

    def _check_term(self) -> None:
        """Raise ``Fenced`` once another node leads a newer term, or once this babysitter has
        not been able to beat its lease for ``nodes.lost_after_s`` (the others will elect)."""
        now = self.clock()
        nodes = self.plan.config.nodes
        if now - self._term_checked < min(1.0, nodes.heartbeat_s):
            return
        self._term_checked = now
        current = leadership.newest(self.plan.shared_dir)
        if current is not None and current.epoch > self.term.epoch:
            self.fenced = (f"node {current.node} ({current.host}) leads term {current.epoch}: "
                           f"the other nodes gave this leader (term {self.term.epoch}) up")
        elif now - self.lease.last_ok > nodes.lost_after_s:
            self.fenced = (f"could not beat this node's lease in {self.lease.path} for "
                           f"{now - self.lease.last_ok:.0f} s: the other nodes may elect "
                           f"another leader")
        if self.fenced is not None:
            if self.workers.group is not None and self.workers.group.processes():
                self.workers.stop()
            raise Fenced(self.fenced)

    # -- this node ------------------------------------------------------------------------------

    def _own_node(self, now: float, watching: bool, out: Gathered) -> None:
        tick = self.node.tick(now, watching)
        for summaries, findings in tick.outputs:
            self._node_report(self.cluster.me, summaries, findings, out)
        self._node_report(self.cluster.me, [], tick.faults, out)
        for event in tick.events:
            self._rank_event(self.cluster.me, event, out)
        self.record_tick(tick, out)
        for hang in tick.hangs:
            self.cluster.hang(self.cluster.me, hang.finding)
        if tick.rank_died:
            self.cluster.rank_died(self.cluster.me)
        end = tick.exit
        if end is not None:
            self.cluster.exited(self.cluster.me, end.code, end.tails, end.root, end.exits)

    # -- the other nodes ------------------------------------------------------------------------

    def _node_message(self, node: int, message: Heard, out: Gathered, watching: bool) -> None:
        if isinstance(message, _ABOUT_AN_ATTEMPT) and message.attempt != self._attempt:
            return  # about an attempt already replaced: it judges nothing now
        try:
            match message:
                case Summary():
                    self._node_report(node, [message.summary], [], out)
                case HangSuspected():
                    self.cluster.hang_suspected(node)
                case RankDied():
                    self.cluster.rank_died(node)
                    self._ending = self._ending or "crash"
                case HangCleared():
                    self.cluster.hang_cleared(node)
                case NodeFinding():
                    self._node_report(node, [], [message.finding], out)
                case RankEvent():
                    self._rank_event(node, message.event, out)
                case Exited():
                    self.cluster.exited(node, message.code, message.tails, message.root,
                                        message.exits)
                case Stopped():
                    self.cluster.stopped(node)
                case Lost() | Leaving() if node not in self.cluster.evicted:
                    self._node_lost(node, message.why, out, watching)
                case Unreadable():
                    # A follower of another babysit version, or a bug: say so, never stop the run.
                    out.entries.append(("node_message_refused", {
                        "node": node, "type": message.error.kind, "error": str(message.error)}))
        except Exception as exc:  # a bug in handling a readable message: never stop the run
            out.entries.append(("node_message_refused", {
                "node": node, "type": type(message).__name__,
                "error": f"{type(exc).__name__}: {exc}"}))

    def _node_report(self, node: int, summaries: list[StepSummary], findings: list[Finding],
                     out: Gathered) -> None:
        for summary in summaries:
            out.newest = max(out.newest or 0, summary.step)
            self._reported = max(self._reported, summary.step)
            for merged in self.cluster.summary(node, summary):
                if self._launched is not None:  # the attempt's first step: its start's cost
                    self._starts.append(self.clock() - self._launched)
                    self._launched = None
                record = SummaryRecord(merged, self._flops_per_token, self._peak_flops,
                                       self.cluster.links())
                out.steps.append((record, with_rates(merged.to_row(self._attempt), record)))
                self._step = max(self._step, merged.step)
        for finding in findings:
            if finding.incident is Incident.HANG:
                self.cluster.hang(node, finding)
            else:
                out.findings.append(finding)

    def _rank_event(self, node: int, event: WorkerEvent, out: Gathered) -> None:
        if event.type == "hello":
            self.cluster.rank_node[event.rank] = node
            event.data.setdefault("node", node)
            if event.rank == 0:
                self._flops_per_token, self._peak_flops = mfu_inputs(event.data)
        elif event.type == "checkpoint" and isinstance(event.data.get("step"), int):
            self._evict_slow_at(event.data["step"], out)
            self._grow_at(event.data["step"], out)
        out.events.append(event)

    def _others_up(self) -> bool:
        """Another node of the attempt has not exited yet: its torchrun may still need the
        rendezvous store this node's torchrun hosts (its exit barrier, its shutdown)."""
        a = self.cluster.attempt
        return any(node not in a.exits for node in a.nodes if node != self.cluster.me)

    def _evict_slow_at(self, step: int, out: Gathered) -> None:
        """The running attempt saved a checkpoint at ``step``: the slow node the cost said to
        evict goes now, by the finding that relaunches from that checkpoint without it
        (``incidents.slow_node``)."""
        if self._slow is None:
            return
        (node, why), self._slow = self._slow, None
        host = self.cluster.hosts.get(node, "?")
        out.findings.append(Finding(
            incident=Incident.SLOW_NODE, detector="cluster", severity=Severity.WARNING,
            step=step, onset_step=step,
            message=f"node {node} ({host}) is slow: {why}; relaunch without it from the "
                    f"checkpoint of step {step}",
            evidence={"node": node, "host": host, "why": why, "checkpoint_step": step}))

    def _grow_at(self, step: int, out: Gathered) -> None:
        """The running attempt saved a checkpoint at ``step``: if it runs on fewer nodes than
        it may and others wait (a lost node back, a new one), the finding that grows the job
        back from that checkpoint (``incidents.node_joined``), once per attempt."""
        running = self.cluster.attempt.nodes
        taking, _ = self.cluster.chosen()
        if self._grown == self._attempt or len(taking) <= len(running) or self._rerunning:
            return  # (a rerun's relaunch would end it before its verdict: after it)
        self._grown = self._attempt
        joining = [n for n in taking if n not in running]
        names = ", ".join(self.cluster.describe(n) for n in joining)
        out.findings.append(Finding(
            incident=Incident.NODE_JOINED, detector="cluster", severity=Severity.WARNING,
            step=step, onset_step=step,
            message=f"{names} can take part: the job runs on {len(running)} of up to "
                    f"{self.cluster.high} nodes; grow back to {len(taking)} from the checkpoint "
                    f"of step {step}",
            evidence={"joining": joining, "nodes": running, "grow_to": taking,
                      "checkpoint_step": step}))

    def _node_lost(self, node: int, why: str, out: Gathered, watching: bool) -> None:
        out.entries.append(("node_lost", {"node": node, "host": self.cluster.hosts.get(node),
                                          "why": why}))
        self.voice.log(f"babysit: {self.cluster.describe(node)} is lost: {why}")
        a = self.cluster.attempt
        if node in a.nodes and node not in a.exits:
            # Its ranks are gone: an exit, so the others' exits still settle the attempt if
            # the policy's answer to the loss leaves the run going.
            self.cluster.exited(node, LOST_EXIT_CODE, {}, None)
            self._ending = self._ending or "loss of a node"
            if watching:
                out.findings.append(self.cluster.lost_finding(
                    node, why, max(self._step, self._reported)))

    def _job_end(self, end: JobExit, out: Gathered) -> JobEnd:
        out.entries.append(("nodes_exited", {"codes": {str(n): c for n, c in end.nodes.items()}}))
        if end.code == 0:
            return JobEnd(0)
        # Whatever still runs of the attempt (ranks blocked in a collective with a dead peer)
        # stops now, not when the next attempt starts on the same devices; torchrun's own
        # shutdown is not waited for (1.3 s of this loop's tick, on the leader's node, before
        # the remedy was even chosen): the attempt is over and the ranks' logs are on disk.
        self.cluster.tell(Stop("the attempt failed on another node", replacing=True))
        if self.workers.group is not None and self.workers.group.processes():
            self.workers.stop(replacing=True)
        self._crash_tails = end.tails
        return JobEnd(end.code, end.tails, end.root, end.exits)

    # -- waiting for nodes ----------------------------------------------------------------------

    def _await_nodes(self, want: int, timeout: float, awaited: list[int] | None = None
                     ) -> tuple[bool, list[int]]:
        """Wait until ``want`` nodes are present, up to ``timeout`` s: (True, []) once they
        are; (False, []) if they are not in time; (False, those) once every node in ``awaited``
        that is not back has left the run for good (its lease says so)."""
        deadline = self.clock() + timeout
        leases = [LeaseWatch(self.plan.shared_dir, n, self.plan.config.nodes.lost_after_s)
                  for n in awaited or []]
        while len(self.cluster.present()) < want:
            if self.clock() >= deadline or self.voice.stopping():
                return False, []
            present = self.cluster.present()
            if leases and all(w.node in present or w.state() == "gone" for w in leases):
                left = [w.node for w in leases if w.node not in present]
                self.voice.journal("nodes_gone", nodes=left)
                return False, left
            time.sleep(TICK_S)
            for event, fields in self.cluster.accept():
                self.voice.journal(event, **fields)
            for node, message in self.cluster.receive():
                if isinstance(message, Lost):
                    self.voice.journal("node_lost", node=node, why=message.why)
            self.voice.status(f"waiting for nodes: {len(self.cluster.present())}/{want}")
        return True, []

    def _await_rejoin(self, present: int) -> None:
        """Fewer nodes than ``launch.nnodes`` allows: page, and wait for the lost to return."""
        low, timeout = self.cluster.low, self.plan.config.nodes.rejoin_timeout_s
        self.voice.journal("waiting_for_nodes", present=self.cluster.present(), need=low)
        self.voice.alert(Severity.CRITICAL,
                         f"{present} of at least {low} nodes present; waiting up to "
                         f"{timeout:g} s for the lost node(s) to rejoin "
                         f"(nodes.rejoin_timeout_s)")
        lost = [n for n in self.cluster.attempt.nodes if n not in self.cluster.present()]
        back, left = self._await_nodes(low, timeout, awaited=lost)
        if not back:
            why = (f"the babysitter of node(s) {', '.join(map(str, left))} left the run "
                   f"(its lease says gone)" if left else
                   f"not within {timeout:g} s (nodes.rejoin_timeout_s)")
            raise MembersMissing(f"only {len(self.cluster.present())} of at least {low} nodes "
                                 f"came back: {why}", lost=True)
        self.voice.journal("nodes_rejoined", present=self.cluster.present())


def _what_is_slow(finding: Finding) -> str:
    """A slow node's finding in words: its compute's ratio to the others', or its link's round
    trip against theirs (a ratio of microseconds says little)."""
    ev = finding.evidence
    link, median = ev.get("link_s"), ev.get("median_s")
    if finding.detector == "slow_link" and isinstance(link, float | int) \
            and isinstance(median, float | int):
        return (f"its link's round trip is {1000 * link:.3g} ms against the others' "
                f"{1000 * median:.3g} ms")
    return f"its compute is {ev.get('ratio')}x the others'"
