"""A follower node's babysitter: runs its node's workers as the leader says, and reports.

It decides nothing about the run. It joins the leader (``supervisor.cluster.wire``), then, a
tick at a time (the messages both ways are ``supervisor.cluster.messages``)::

    the leader's commands             launch / stop / control / finish / beat
    the ranks' telemetry              per-rank detectors and hang timers over this node's ranks;
                                      each step summarised for the leader; rare events passed on
    has torchrun exited?              the exit code and the failed ranks' log tails
    heartbeat                         so the leader knows this node is alive

A hang found here is diagnosed here (only this node can read its ranks' stacks) and its incident
folder written here; the finding goes to the leader, which chooses between the nodes' views.

If the leader vanishes (its connection closes, or it falls silent), the follower stops its
workers at once: they cannot train without the others. Then it asks the shared run directory
(``cluster.leadership``) whose fault it was. The leader's lease still beats: this node is the
one cut off, and it keeps trying to rejoin (up to ``nodes.rejoin_timeout_s``), so a partition
that heals costs one relaunch. The lease is stale (silent for ``nodes.lost_after_s``; for
``2 x nodes.heartbeat_s + 1`` s when the leader's host refuses the connection: it answers, nobody
listens): the leader is gone, and this follower claims the next term. The claim that wins
becomes the leader (``run()`` returns its ``Term``); the others join it. A message from the
leader that it cannot read (another babysit version, or a bug) is journaled
(``leader_message_refused``) and otherwise ignored.
Its journal (``RUN_DIR/nodes/<node rank>/``) records what it saw and did; the leader's is the
run's record.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from types import FrameType
from typing import Any, cast

from babysit.policies.types import Finding
from babysit.supervisor.cluster import keeping, leadership
from babysit.supervisor.cluster.leadership import LeaseWatch, Term
from babysit.supervisor.cluster.messages import (
    Beat,
    Control,
    Exited,
    Finish,
    FollowerMessage,
    HangCleared,
    HangSuspected,
    KeepAsk,
    KeepRelease,
    KeepWrite,
    Launch,
    LeaderMessage,
    Leaving,
    MessageError,
    NodeFinding,
    RankDied,
    RankEvent,
    Refused,
    Stop,
    Stopped,
    Summary,
    encode,
    from_leader,
)
from babysit.supervisor.cluster.node_view import NodeView
from babysit.supervisor.cluster.wire import AuthError, Peer, connect
from babysit.supervisor.config.address import format_address, parse_address
from babysit.supervisor.config.plan import RunPlan
from babysit.supervisor.config.slurm import Taken
from babysit.supervisor.node import ahead, incident, launcher
from babysit.supervisor.node.gpu_watch import GpuWatch
from babysit.supervisor.node.sketch import StepSummary
from babysit.supervisor.node.tick import Hang, OwnNode
from babysit.supervisor.node.workers import NodeWorkers
from babysit.supervisor.run import exit_codes
from babysit.supervisor.run import journal as journal_mod
from babysit.supervisor.run.console import Console

TICK_S = 0.1
FORWARDED = ("hello", "close", "skip", "checkpoint", "checkpoint_failed", "checkpoint_sync",
             "checkpoints_off", "cadence", "fingerprint", "stream", "memory_copy",
             "memory_copy_failed", "memory_copy_skipped", "memory_copy_off", "memory_copy_plan")
"""Rank events the leader needs: the run's record, checkpoints (memory copies too: the leader
commits each once every rank's part is in), cadence, SDC checks and where the data stream is
(rank 0 is on node 0 unless the ranks were placed otherwise)."""


class Follower:
    """Runs a follower node to the end of the run; ``run()`` returns the exit code."""

    def __init__(self, plan: RunPlan, console: Console, secret: bytes,
                 early: ahead.Early | None = None) -> None:
        self.plan = plan
        self.console = console
        self.node = plan.node_rank
        self.view = NodeView.from_plan(plan, self.node)
        self.host = self.view.host
        self.secret = secret
        self.workers = NodeWorkers(plan, plan.run_dir, early)
        # Reading stacks takes seconds: the leader waits for this view rather than settle on
        # another node's, whose ranks only wait in the collective.
        self.own: OwnNode[tuple[list[StepSummary], list[Finding]]] = OwnNode(
            self.workers, self.view, flush_on_exit=True,
            on_suspect=lambda _: self._send(HangSuspected(self.attempt)),
            gpus=GpuWatch(plan.config.schedule.health_every_s),
            # A rank ending (holding on at an exception, a SIGTERM): the leader saves the last
            # step from every node's ranks before anything stops (``cluster.keeping``).
            on_ending=lambda _: self._send(RankDied(self.attempt)))
        self.journal = journal_mod.Journal(plan.run_dir / "events.jsonl")
        self.peer: Peer | None = None
        self.attempt = -1
        self._step = 0
        self._signal: int | None = None
        self._term_at: float | None = None
        self._join_deadline: float | None = None
        self.term: Term | None = None
        """The term of the leader this node follows (None: node 0's first, not yet claimed)."""
        self._lost = False
        """This node lost its leader and has not joined one again."""
        self._leader_lease: LeaseWatch | None = None
        """The lease of the leader of ``term``, watched from the first join on."""
        self._term_checked = 0.0
        self._refused = False
        """The last try to reach the leader was refused: its host answers, its port does not."""

    def run(self) -> int | Term:
        """The exit code; or the term this node won when its leader was lost (the caller leads
        from here on, with the same console)."""
        self.plan.run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.plan.run_dir, 0o700)
        self.journal.open()
        self.workers.open()
        launcher.become_subreaper()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        self._journal("follower_started", host=self.host, pid=os.getpid(),
                      leader=self.plan.leader_address)
        code: int | Term | None = None
        try:
            while code is None:
                code = self._join()
                if code is None:
                    try:
                        code = self._loop()
                    except _Rejoin:  # our node rank was still held by our previous connection
                        time.sleep(1.0)
            if isinstance(code, Term):
                self._journal("leading", term=code.epoch, address=code.address)
            else:
                self._journal("follower_finished", exit_code=code)
            return code
        finally:
            self.workers.close()
            if self.peer is not None:
                self.peer.close()
            self.journal.close()
            if not isinstance(code, Term):
                self.console.close()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signal = signum

    def _join(self) -> int | Term | None:
        """Connect to the leader of the term in force, retrying until ``nodes.join_timeout_s``
        (``nodes.rejoin_timeout_s`` after a loss); an exit code if not, or the term this node
        won because the leader it lost is gone."""
        nodes = self.plan.config.nodes
        timeout = nodes.rejoin_timeout_s if self._lost else nodes.join_timeout_s
        if self._join_deadline is None:  # one deadline, however often the leader refuses us
            self._join_deadline = time.monotonic() + timeout
        deadline = self._join_deadline
        address = self._leader_address()
        self.console.log(f"babysit: node {self.node} joining the leader at {address}")
        refused = False
        last: Exception | None = None
        while self._signal is None:
            won = self._elect()  # first: a leader that still answers may have lost its lease
            if won is not None:
                return won
            address = self._leader_address()
            try:
                self.peer = connect(address, self.secret,
                                    {"node_rank": self.node, "host": self.host,
                                     "pid": os.getpid()}, timeout_s=min(10.0, nodes.lost_after_s))
                self.peer.keep_alive(nodes.heartbeat_s, encode(Beat()))
                self._journal("joined", leader=address,
                              term=self.term.epoch if self.term else None)
                self.console.log(f"babysit: node {self.node} joined the leader at {address}")
                self._lost, self._join_deadline, self._refused = False, None, False
                self._leader_address()  # the term it leads, if it was claimed meanwhile
                return None
            except AuthError as exc:
                # Most likely another secret; but a leader that is restarting or swamped hangs
                # up the same way, so say it once and keep trying until the deadline.
                if not refused:
                    self._fail("join_refused", f"the leader at {address} refused us: {exc}")
                refused, last = True, exc
            except OSError as exc:
                last = exc
            # Nobody listens on the leader's port although its host answers: its babysitter
            # is gone, and the lease can be judged on a shorter silence.
            self._refused = isinstance(last, ConnectionRefusedError)
            if time.monotonic() > deadline:
                if not self._lost:
                    return self._fail("join_timeout", f"could not join the leader at {address} "
                                      f"within {timeout:g} s (nodes.join_timeout_s): {last}")
                self._fail("rejoin_timeout", f"cut off from the leader at {address}, which "
                           f"lives, for {timeout:g} s (nodes.rejoin_timeout_s): {last}; "
                           f"leaving the run to it")
                return exit_codes.REQUEUE
            time.sleep(min(1.0, nodes.heartbeat_s))
        return 128 + self._signal

    def _leader_address(self) -> str:
        """Where the leader listens: the newest term's, when another node holds it; else
        ``nodes.leader`` (node 0's, which claims the first term when it starts)."""
        current = leadership.newest(self.plan.shared_dir)
        if current is not None and current.node != self.node:
            if self.term is None or current.epoch > self.term.epoch:
                self.term = current
                self._leader_lease = LeaseWatch(self.plan.shared_dir, current.node,
                                                self.plan.config.nodes.lost_after_s)
            return current.address
        return self.plan.leader_address

    def _elect(self) -> Term | None:
        """After losing the leader: if its lease went stale, claim the next term. The term this
        node won, or None (the leader lives, or another node won: the next join finds it)."""
        if not self._lost or self.term is None or self._leader_lease is None:
            return None
        current = leadership.newest(self.plan.shared_dir)
        if current is not None and current.epoch > self.term.epoch:
            return None  # already elected: join the new leader
        quick = self._refused and \
            self._leader_lease.silent_s() > 2 * self.plan.config.nodes.heartbeat_s + 1.0
        if self._leader_lease.state() == "alive" and not quick:
            return None  # the leader lives: this node is the one cut off
        host = self.peer.info.get("local") if self.peer is not None else None
        address = format_address(host or self.host, parse_address(self.plan.leader_address)[1])
        won = leadership.claim(self.plan.shared_dir, self.term.epoch + 1, self.node, self.host,
                               address)
        if won is not None:
            self._journal("leader_elected", term=won.epoch, address=won.address,
                          previous=self.term.node,
                          silent_s=round(self._leader_lease.silent_s(), 1))
            self.console.log(f"babysit: node {self.node}: the leader (node {self.term.node}) is "
                             f"gone; this node leads from here ({won.describe()})")
        return won

    def _fail(self, event: str, why: str) -> int:
        self._journal(event, why=why)
        self.console.log(f"babysit: node {self.node}: {why}")
        return 1

    # -- the loop -------------------------------------------------------------------------------

    def _loop(self) -> int | None:
        """Until the run ends (an exit code) or the leader is lost (None: join again)."""
        assert self.peer is not None
        lost_after = self.plan.config.nodes.lost_after_s
        while True:
            time.sleep(TICK_S)
            code = self._on_signal_received()
            if code is not None:
                return code
            gone = self.peer.closed  # before draining: the leader's last word comes first
            for received in self.peer.receive():
                try:
                    message = from_leader(received)
                except MessageError as exc:
                    self._journal("leader_message_refused", type=exc.kind, error=str(exc))
                    self.console.log(f"babysit: node {self.node}: ignoring a message from the "
                                     f"leader: {exc}")
                    continue
                code = self._command(message)
                if code is not None:
                    return code
            self._tick()
            for line in self.workers.output():
                self.console.log(line)
            silent = time.monotonic() - self.peer.last_heard
            deposed = self._deposed()
            if gone or silent > lost_after or deposed:
                why = deposed or (f"silent for {silent:.0f} s" if not gone
                                  else f"connection closed ({self.peer.close_reason or 'eof'})")
                # Cut off, torchrun's own shutdown waits on a store it cannot reach: kill it
                # as soon as the ranks are gone, as when an attempt is replaced.
                self._stop_workers(f"leader lost: {why}", replacing=True)
                self._journal("leader_lost", why=why)
                self.console.log(f"babysit: node {self.node}: lost the leader ({why}); stopped "
                                 f"this node's workers; rejoining, or electing a new leader if "
                                 f"it is gone")
                self._lost = True
                return None

    def _deposed(self) -> str | None:
        """A newer term than the one this node follows: its leader was given up (fenced).
        Also keeps watching the leader's lease, so that once the leader is lost its silence
        is known from when it began, not from when this node started looking."""
        now = time.monotonic()
        if now - self._term_checked < self.plan.config.nodes.heartbeat_s:
            return None
        self._term_checked = now
        if self._leader_lease is not None:
            self._leader_lease.state()
        current = leadership.newest(self.plan.shared_dir)
        if current is not None and self.term is not None and current.epoch > self.term.epoch \
                and current.node != self.node:
            return f"node {current.node} leads a newer term ({current.epoch})"
        return None

    def _on_signal_received(self) -> int | None:
        """SIGINT stops this node at once. SIGTERM (a scheduler ending the job: every node gets
        it) waits for the leader, which asks every rank for a final checkpoint and then stops
        them all; if it says nothing within the grace, this node stops on its own."""
        now = time.monotonic()
        if self._signal == signal.SIGTERM and self._term_at is None and self.workers.running:
            self._term_at, self._signal = now, None
            grace = self._term_grace()
            self._journal("sigterm", waiting_s=grace)
            self.console.log(f"babysit: node {self.node}: SIGTERM: the leader coordinates a "
                             f"final checkpoint; stopping on our own in {grace:g} s otherwise")
        late = self._term_at is not None and now - self._term_at > self._term_grace()
        if self._signal is None and not late:
            return None
        sig = self._signal or signal.SIGTERM
        self._stop_workers(f"signal {sig}")
        assert self.peer is not None
        self.peer.send(encode(Leaving(f"signal {sig}")))
        return 128 + sig

    def _term_grace(self) -> float:
        c = self.plan.config
        return c.checkpoints.final_grace_s + c.launch.stop_grace_s + 10.0

    def _command(self, message: LeaderMessage) -> int | None:
        match message:
            case Launch():
                self._launch(message)
            case Stop():
                self._stop_workers(message.reason, replacing=message.replacing)
                self._send(Stopped(self.attempt))
            case Control():
                self.workers.control.request(**message.fields)
                self._journal("control", fields=message.fields)
            case Refused() if message.final:
                return self._fail("join_refused", message.reason)
            case Refused():
                self._journal("join_refused", why=f"{message.reason}; trying again")
                assert self.peer is not None
                self.peer.close()
                raise _Rejoin
            case Finish():
                self._stop_workers("the run is over")
                return message.code
            case KeepAsk() if message.attempt == self.attempt:
                self._send(keeping.node_answer(self.workers.keepers, self.attempt,
                                               dict(self.workers.rank_pids), message.seconds))
            case KeepWrite() if message.attempt == self.attempt:
                self._send(keeping.node_write(self.workers.keepers, message,
                                              dict(self.workers.rank_pids)))
            case KeepRelease() if message.attempt == self.attempt:
                if self.workers.keepers is not None:
                    self.workers.keepers.release(self.attempt, self.workers.rank_pids)
            case Beat():
                pass
        return None

    def _launch(self, message: Launch) -> None:
        self._stop_workers("a new attempt starts", replacing=True)
        attempt, directive = message.attempt, message.directive
        self.attempt, self._step = attempt, 0
        assert self.peer is not None
        place = launcher.Placement.in_attempt(
            message.rdzv_endpoint, parse_address(self.peer.info["address"])[0], leads=False,
            local_addr=self.peer.info.get("local"))
        command = self.own.launch(attempt, directive, time.monotonic(), lambda: self.workers.launch(
            attempt, directive, rdzv_endpoint=message.rdzv_endpoint, rdzv_id=message.rdzv_id,
            nnodes=str(message.nnodes), node_rank=message.node_rank, place=place))
        self._journal("launch", command=command, rdzv_endpoint=message.rdzv_endpoint,
                      directive=directive.to_json(), torchrun_ahead=self.workers.launched_ahead,
                      **Taken.fields(self.plan.slurm))

    def _stop_workers(self, reason: str, replacing: bool = False) -> None:
        if self.workers.group is not None and self.workers.group.processes():
            self._journal("stop_workers", reason=reason, pids=self.workers.pids())
            code = self.own.stop(replacing)
            self._journal("workers_stopped", exit_code=code)
        self.own.running = False

    # -- reports --------------------------------------------------------------------------------

    def _tick(self) -> None:
        """This node's tick (``node.tick``): summaries and findings for the leader, the
        rare events it needs, a hang named from the stacks, torchrun's exit."""
        tick = self.own.tick(time.monotonic())
        if tick.newest is not None:
            self._step = max(self._step, tick.newest)
        for event in tick.events:
            if event.type in FORWARDED:
                self._send(RankEvent(self.attempt, event))
        for summaries, findings in tick.outputs:
            self._report(summaries, findings)
        if tick.faults:
            self._report([], tick.faults)
        for fields in tick.cleared:
            self._journal("hang_cleared", **fields)
            self._send(HangCleared(self.attempt))
        for event_name, fields in self.workers.take_standby_entries():  # torchrun ahead's
            self._journal(event_name, **cast(dict[str, Any], fields))
        for hang in tick.hangs:
            self._report_hang(hang)
        if tick.rank_died:  # the leader holds any hang elsewhere until our exit explains it
            self._send(RankDied(self.attempt))
        if tick.exit is not None:
            end = tick.exit
            teardown = end.teardown(self.workers.closed_ranks)
            if teardown is not None:
                self._journal(teardown[0], **teardown[1])
            self._journal("workers_exited", exit_code=end.code)
            self._send(Exited(self.attempt, end.code, end.tails, end.root, end.exits,
                              self._step))

    def _report(self, summaries: list[StepSummary], findings: list[Finding]) -> None:
        for summary in summaries:
            self._send(Summary(self.attempt, summary))
        for finding in findings:
            self._journal("finding", finding=finding.to_json())
            self._send(NodeFinding(self.attempt, finding))

    def _report_hang(self, hang: Hang) -> None:
        finding = hang.finding
        if hang.fields:
            self._journal("hang_diagnosis", **hang.fields)
            folder = incident.write_incident(
                self.plan.run_dir, self.attempt, finding, "reported to the leader",
                hang.diagnosis, self.workers.tails(self.attempt, 8192))
            finding = dataclasses.replace(
                finding, evidence={**finding.evidence, "incident_dir": str(folder)})
        self._report([], [finding])

    def _send(self, message: FollowerMessage) -> None:
        """Send to the leader. What is about an attempt says which: the leader drops what an
        attempt it already replaced still had to say."""
        if self.peer is not None:
            self.peer.send(encode(message))

    def _journal(self, event: str, /, step: int | None = None, **fields: Any) -> None:
        self.journal.write(event, time.time(), max(self.attempt, 0),
                           step if step is not None else (self._step or None), node=self.node,
                           **fields)


class _Rejoin(Exception):
    """The leader refused this connection for now: join again."""
