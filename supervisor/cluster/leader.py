"""The leader's control loop: the single-node loop, over every node.

``Leader`` is ``babysit.supervisor.run.loop.Supervisor`` with its node-facing steps replaced; the
state machine, the rules, recovery, cadence, alerts and the journal are the same objects doing the
same things. What changes, step by step::

    this node's ranks     per-rank detectors and hang timers in a NodeView (as on every node);
                          its step summaries merge with the other nodes' (NodeMerger)
    the job's steps       merged summaries -> metrics row, progress, the job-level detectors
    the other nodes       joins, summaries, findings, rank events, exits, losses (Cluster)
    torchrun's exit       waits for every node's exit, or settles after the first failure
    launch                the nodes present now take part: same attempt, directive, rendezvous
    stop                  every node stops its workers; the leader waits until they say so
    control requests      the control file here, and the same request to every node
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from babysit.policies import decide as sm
from babysit.policies.types import Finding, Incident, RankStep, Severity
from babysit.supervisor.cluster.membership import LEADER, Cluster, JobExit
from babysit.supervisor.cluster.node_view import NodeView, located
from babysit.supervisor.config.plan import RunPlan
from babysit.supervisor.contract.directive import Directive
from babysit.supervisor.contract.protocol import WorkerEvent
from babysit.supervisor.node import forensics
from babysit.supervisor.node.aggregate import with_rates
from babysit.supervisor.node.sketch import StepSummary, SummaryRecord
from babysit.supervisor.run.console import Console
from babysit.supervisor.run.loop import TICK_S, Supervisor
from babysit.supervisor.run.watch import Watch

Pending = deque[sm.Event | Finding]
LOST_EXIT_CODE = 137
"""The exit a lost node's torchrun is counted with: killed, as far as anyone can tell."""


class Leader(Supervisor):
    """Runs a multi-node job from node rank 0. ``run()`` returns the process exit code."""

    def __init__(self, plan: RunPlan, console: Console, secret: bytes) -> None:
        super().__init__(plan, console)
        self.watch = Watch.from_plan(plan, scope="job")
        self.view = NodeView.from_plan(plan, LEADER)
        self.cluster = Cluster(plan, secret, self.clock)
        self._exit_code: int | None = None
        self._local_hang: tuple[Finding, forensics.Diagnosis | None] | None = None

    # -- lifecycle ------------------------------------------------------------------------------

    def _loop(self) -> int:
        try:
            self._await_start()
            return super()._loop()
        except NodesMissing as exc:
            if self._signal is not None:  # asked to stop while waiting for nodes
                code, state, reason = 128 + self._signal, "stopped", f"signal {self._signal}"
            else:
                code, state, reason = 1, "failed", str(exc)
                self._notify(sm.Notify(Severity.CRITICAL, f"run failed: {exc}"))
            self._journal("run_finished", state=state, exit_code=code, reason=reason)
            self._exit_code = code
            return code

    def _await_start(self) -> None:
        """Wait for every node ``launch.nnodes`` allows, or at least the fewest it allows."""
        try:
            self.cluster.open()
        except OSError as exc:
            raise NodesMissing(f"cannot listen for the other nodes at {self.plan.leader_address}"
                               f" ({exc.strerror or exc}): another run holds the port, or the "
                               f"host is not this machine; change nodes.leader") from None
        self._journal("leader_listening", address=self.plan.leader_address,
                      nnodes=self.plan.config.launch.nnodes)
        low, high = self.cluster.low, self.cluster.high
        timeout = self.plan.config.nodes.join_timeout_s
        self.console.log(f"babysit: leading {low if low == high else f'{low} to {high}'} "
                         f"nodes; waiting for the others at {self.plan.leader_address}")
        if not self._await_nodes(high, timeout) and \
                (len(self.cluster.present()) < low or self._signal is not None):
            raise NodesMissing(f"only {len(self.cluster.present())} of at least {low} nodes "
                               f"joined within {timeout:g} s (nodes.join_timeout_s); check "
                               f"that every node runs babysit with the same secret and can "
                               f"reach {self.plan.leader_address}")

    def _await_nodes(self, want: int, timeout: float) -> bool:
        """Wait until ``want`` nodes are present, up to ``timeout`` s; False if they are not."""
        deadline = self.clock() + timeout
        while len(self.cluster.present()) < want:
            if self.clock() >= deadline or self._signal is not None:
                return False
            time.sleep(TICK_S)
            self._journal_all(self.cluster.accept())
            for node, message in self.cluster.receive():
                if message.get("type") == "lost":
                    self._journal("node_lost", node=node, why=message.get("why"))
            self.console.status(f"waiting for nodes: {len(self.cluster.present())}/{want}")
        return True

    def _teardown(self) -> None:
        self.cluster.close(self._exit_code if self._exit_code is not None else 1)
        super()._teardown()

    def _perform(self, action: sm.ActionT, pending: Pending) -> int | None:
        code = super()._perform(action, pending)
        if code is not None:
            self._exit_code = code
        return code

    # -- this node's ranks ----------------------------------------------------------------------

    def _rank_step(self, sample: RankStep, pending: Pending) -> None:
        summaries, findings = self.view.observe_rank(sample, self.clock())
        self._node_report(LEADER, summaries, findings, pending)

    def _local_event(self, event: WorkerEvent, pending: Pending) -> None:
        self.view.observe_event(event, self.clock())
        self._rank_event(LEADER, event, pending)

    def _check_workers(self, now: float, pending: Pending) -> None:
        a = self.cluster.attempt
        if LEADER not in a.exits:
            code = self.workers.poll()
            if code is not None:
                self._take_telemetry(pending)
                self._node_report(LEADER, *self.view.flush(), pending)
                tails: dict[int, str] = {}
                root = None
                if code and not self._teardown_crash(code):
                    tails, root = self.workers.crash_evidence(self.machine.attempt)
                elif code:
                    code = 0
                self.cluster.exited(LEADER, code, tails, root)
            elif self.workers.group is not None and \
                    forensics.ranks_all_alive(self.workers.rank_pids.values()):
                for finding in self.view.check(now):
                    finding, diagnosis = super()._diagnose(finding)
                    finding = self.view.name(finding)
                    self._local_hang = (finding, diagnosis)
                    self.cluster.hang(LEADER, finding)

    # -- the other nodes ------------------------------------------------------------------------

    def _take_telemetry(self, pending: Pending) -> None:
        super()._take_telemetry(pending)  # this node's ranks
        self._gather_nodes(pending)

    def _gather_nodes(self, pending: Pending) -> None:
        # Settled before this tick's messages: a node lost in this tick is judged first, and
        # once its remedy stops the workers, the others' exits are its consequence.
        if self.machine.state in (sm.State.STARTING, sm.State.RUNNING):
            hang = self.cluster.settled_hang()
            if hang is not None:
                pending.append(hang)
            end = self.cluster.settled_exit()
            if end is not None:
                pending.append(self._job_exit(end))
        self._journal_all(self.cluster.accept())
        for node, message in self.cluster.receive():
            self._node_message(node, message, pending)

    def _node_message(self, node: int, message: dict[str, Any], pending: Pending) -> None:
        kind = message.get("type")
        if kind in ("summary", "finding", "hang_suspected", "event", "exited", "stopped") \
                and message.get("attempt") != self.machine.attempt:
            return  # about an attempt already replaced: it judges nothing now
        try:
            if kind == "summary":
                self._node_report(node, [StepSummary.from_dict(message["summary"])], [],
                                  pending)
            elif kind == "hang_suspected":
                self.cluster.hang_suspected(node)
            elif kind == "finding":
                self._node_report(node, [], [Finding.from_json(message["finding"])], pending)
            elif kind == "event":
                self._rank_event(node, WorkerEvent(
                    rank=int(message["rank"]), type=str(message["event"]),
                    time=float(message["time"]), data=dict(message["data"])), pending)
            elif kind == "exited":
                tails = {int(r): str(t) for r, t in dict(message.get("tails") or {}).items()}
                root = message.get("root")
                self.cluster.exited(node, int(message["code"]), tails,
                                    root if isinstance(root, int) else None)
            elif kind == "stopped":
                self.cluster.stopped(node)
            elif kind in ("lost", "leaving"):
                self._node_lost(node, str(message.get("why")), pending)
        except Exception as exc:
            # A follower of another babysit version, or a bug: say so, never stop the run.
            self._journal("node_message_refused", node=node, type=str(kind),
                          error=f"{type(exc).__name__}: {exc}")

    def _node_report(self, node: int, summaries: list[StepSummary], findings: list[Finding],
                     pending: Pending) -> None:
        newest = None
        for summary in summaries:
            self._newest_step = max(self._newest_step, summary.step)
            for merged in self.cluster.summary(node, summary):
                self._job_step(merged, pending)
                newest = max(newest or 0, merged.step)
        if newest is not None:
            pending.append(sm.Progress(newest))
            self._journal_all(self.recovery.on_progress(newest))
        for finding in findings:
            if finding.incident is Incident.HANG:
                self.cluster.hang(node, finding)
            else:
                pending.append(finding)

    def _job_step(self, summary: StepSummary, pending: Pending) -> None:
        agg = self._aggregator
        record = SummaryRecord(summary, agg.flops_per_token, agg.peak_flops)
        self._record(record, with_rates(summary.to_row(self.machine.attempt), record), pending)

    def _rank_event(self, node: int, event: WorkerEvent, pending: Pending) -> None:
        if event.type == "hello":
            self.cluster.rank_node[event.rank] = node
            event.data.setdefault("node", node)
        self._worker_event(event, pending)

    def _node_lost(self, node: int, why: str, pending: Pending) -> None:
        self._journal("node_lost", node=node, host=self.cluster.hosts.get(node), why=why)
        self.console.log(f"babysit: {self.cluster.describe(node)} is lost: {why}")
        a = self.cluster.attempt
        if node in a.nodes and node not in a.exits:
            # Its ranks are gone: an exit, so the others' exits still settle the attempt if
            # the policy's answer to the loss leaves the run going.
            self.cluster.exited(node, LOST_EXIT_CODE, {}, None)
            if self.machine.state in (sm.State.STARTING, sm.State.RUNNING):
                pending.append(self.cluster.lost_finding(node, why, self.machine.step))

    def _job_exit(self, end: JobExit) -> sm.Exited:
        self._journal("nodes_exited", codes={str(n): c for n, c in end.nodes.items()})
        if end.code == 0:
            return sm.Exited(0)
        # Whatever still runs of the attempt (ranks blocked in a collective with a dead peer)
        # stops now, not when the next attempt starts on the same devices.
        self.cluster.tell({"type": "stop", "reason": "the attempt failed on another node"})
        if self.workers.group is not None and self.workers.group.processes():
            self.workers.stop()
        self.crash_tails = end.tails
        finding = self.watch.classify_crash(end.code, end.tails, self.machine.step, end.root)
        if finding.ranks:
            node = self.cluster.rank_node.get(finding.ranks[0], LEADER)
            finding = located(finding, node, self.cluster.hosts.get(node, self.view.host))
        return sm.Exited(end.code, self._judge(finding))

    # -- telling the nodes ----------------------------------------------------------------------

    def _diagnose(self, finding: Finding) -> tuple[Finding, forensics.Diagnosis | None]:
        # Every node diagnosed its own hang before reporting it; this node's stacks go into
        # the incident folder when its view was chosen (the others' are in their own folders).
        if self._local_hang is not None and self._local_hang[0] == finding:
            return finding, self._local_hang[1]
        return finding, None

    def _request(self, **fields: Any) -> None:
        super()._request(**fields)
        self.cluster.tell({"type": "control", "fields": fields})

    def _start_workers(self, attempt: int, directive: Directive) -> dict[str, Any]:
        present = len(self.cluster.present())
        if present < self.cluster.low:
            self._await_rejoin(present)
        self.view.new_attempt(self.clock(), directive)
        launch = self.plan.config.launch
        rdzv_id = launch.rdzv_id or f"{self.plan.name}-{attempt}"
        nodes, endpoint = self.cluster.launch(attempt, directive.to_json(), rdzv_id,
                                              launch.rdzv_endpoint)
        command = self.workers.launch(attempt, directive, rdzv_endpoint=endpoint, rdzv_id=rdzv_id,
                                      nnodes=str(len(nodes)), node_rank=0)
        self.console.log(f"babysit: attempt {attempt} on {len(nodes)} node(s): "
                         f"{', '.join(self.cluster.describe(n) for n in nodes)}")
        return {"command": command, "rdzv_endpoint": endpoint, "nodes": nodes,
                "hosts": {str(n): self.cluster.hosts.get(n, self.view.host) for n in nodes}}

    def _await_rejoin(self, present: int) -> None:
        """Fewer nodes than ``launch.nnodes`` allows: page, and wait for the lost to return."""
        low, timeout = self.cluster.low, self.plan.config.nodes.rejoin_timeout_s
        title = (f"{present} of at least {low} nodes present; waiting up to {timeout:g} s for "
                 f"the lost node(s) to rejoin (nodes.rejoin_timeout_s)")
        self._journal("waiting_for_nodes", present=self.cluster.present(), need=low)
        self._notify(sm.Notify(Severity.CRITICAL, title))
        if not self._await_nodes(low, timeout):
            raise NodesMissing(f"only {len(self.cluster.present())} of at least {low} nodes "
                               f"came back within {timeout:g} s (nodes.rejoin_timeout_s)")
        self._journal("nodes_rejoined", present=self.cluster.present())

    def _stop_workers(self, reason: str) -> None:
        self.cluster.attempt.done = True  # what the nodes say of its end is moot now
        self.cluster.tell({"type": "stop", "reason": reason})
        super()._stop_workers(reason)
        deadline = self.clock() + self.plan.config.launch.stop_grace_s + 10.0
        ignored: Pending = deque()
        while not self.cluster.all_stopped() and self.clock() < deadline:
            time.sleep(TICK_S)
            for node, message in self.cluster.receive():
                if message.get("type") in ("stopped", "lost", "leaving"):
                    self._node_message(node, message, ignored)
        missing = [n for n in self.cluster.attempt.nodes
                   if n != LEADER and n not in self.cluster.attempt.stopped]
        self._journal("nodes_stopped", missing=missing)


class NodesMissing(Exception):
    """Too few nodes joined, or came back, for the run to go on."""

