"""A follower node's babysitter: runs its node's workers as the leader says, and reports.

It decides nothing about the run. It joins the leader (``supervisor.cluster.wire``), then, a
tick at a time::

    the leader's commands             launch / stop / control / finish / beat
    the ranks' telemetry              per-rank detectors and hang timers over this node's ranks;
                                      each step summarised for the leader; rare events passed on
    has torchrun exited?              the exit code and the failed ranks' log tails
    heartbeat                         so the leader knows this node is alive

A hang found here is diagnosed here (only this node can read its ranks' stacks) and its incident
folder written here; the finding goes to the leader, which chooses between the nodes' views.

If the leader vanishes, nobody can coordinate a relaunch: the follower stops its workers and
exits (code 1), and its journal says why. Its journal (``RUN_DIR/nodes/<node rank>/``) records
what it saw and did; the leader's is the run's record.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from types import FrameType
from typing import Any

from babysit.policies.types import Finding, RankStep
from babysit.supervisor.cluster.node_view import NodeView
from babysit.supervisor.cluster.wire import AuthError, Peer, connect
from babysit.supervisor.config.plan import RunPlan
from babysit.supervisor.contract.protocol import WorkerEvent
from babysit.supervisor.node import forensics, launcher
from babysit.supervisor.node.sketch import StepSummary
from babysit.supervisor.node.workers import NodeWorkers
from babysit.supervisor.run import journal as journal_mod
from babysit.supervisor.run.console import Console

TICK_S = 0.1
FORWARDED = ("hello", "close", "skip", "checkpoint", "checkpoint_failed", "cadence",
             "fingerprint")
"""Rank events the leader needs: the run's record, checkpoints, cadence and SDC checks."""


class Follower:
    """Runs a follower node to the end of the run; ``run()`` returns the exit code."""

    def __init__(self, plan: RunPlan, console: Console, secret: bytes) -> None:
        self.plan = plan
        self.console = console
        self.node = plan.node_rank
        self.view = NodeView.from_plan(plan, self.node)
        self.host = self.view.host
        self.secret = secret
        self.workers = NodeWorkers(plan, plan.run_dir)
        self.journal = journal_mod.Journal(plan.run_dir / "events.jsonl")
        self.peer: Peer | None = None
        self.attempt = -1
        self._step = 0
        self._exited = True
        self._signal: int | None = None
        self._term_at: float | None = None
        self._join_deadline: float | None = None

    def run(self) -> int:
        self.plan.run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.plan.run_dir, 0o700)
        self.journal.open()
        self.workers.open()
        launcher.become_subreaper()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        self._journal("follower_started", host=self.host, pid=os.getpid(),
                      leader=self.plan.leader_address)
        try:
            code = None
            while code is None:
                code = self._join()
                if code is None:
                    try:
                        code = self._loop()
                    except _Rejoin:  # our node rank was still held by our previous connection
                        time.sleep(1.0)
            self._journal("follower_finished", exit_code=code)
            return code
        finally:
            self.workers.close()
            if self.peer is not None:
                self.peer.close()
            self.journal.close()
            self.console.close()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signal = signum

    def _join(self) -> int | None:
        """Connect to the leader, retrying until ``nodes.join_timeout_s``; an exit code if not."""
        address, timeout = self.plan.leader_address, self.plan.config.nodes.join_timeout_s
        self.console.log(f"babysit: node {self.node} joining the leader at {address}")
        if self._join_deadline is None:  # one deadline, however often the leader refuses us
            self._join_deadline = time.monotonic() + timeout
        deadline = self._join_deadline
        refused = False
        last: Exception | None = None
        while self._signal is None:
            try:
                self.peer = connect(address, self.secret,
                                    {"node_rank": self.node, "host": self.host,
                                     "pid": os.getpid()}, timeout_s=10.0)
                self.peer.keep_alive(self.plan.config.nodes.heartbeat_s)
                self._journal("joined", leader=address)
                self.console.log(f"babysit: node {self.node} joined the leader at {address}")
                return None
            except AuthError as exc:
                # Most likely another secret; but a leader that is restarting or swamped hangs
                # up the same way, so say it once and keep trying until the deadline.
                if not refused:
                    self._fail("join_refused", f"the leader at {address} refused us: {exc}")
                refused, last = True, exc
            except OSError as exc:
                last = exc
            if time.monotonic() > deadline:
                return self._fail("join_timeout", f"could not join the leader at {address} "
                                  f"within {timeout:g} s (nodes.join_timeout_s): {last}")
            time.sleep(1.0)
        return 128 + self._signal

    def _fail(self, event: str, why: str) -> int:
        self._journal(event, why=why)
        self.console.log(f"babysit: node {self.node}: {why}")
        return 1

    # -- the loop -------------------------------------------------------------------------------

    def _loop(self) -> int:
        assert self.peer is not None
        lost_after = self.plan.config.nodes.lost_after_s
        while True:
            time.sleep(TICK_S)
            code = self._on_signal_received()
            if code is not None:
                return code
            gone = self.peer.closed  # before draining: the leader's last word comes first
            for message in self.peer.receive():
                code = self._command(message)
                if code is not None:
                    return code
            self._telemetry()
            for line in self.workers.output():
                self.console.log(line)
            self._check_exit()
            if not self._exited and self.workers.group is not None and \
                    forensics.ranks_all_alive(self.workers.rank_pids.values()):
                for finding in self.view.check(time.monotonic()):
                    self._report_hang(finding)
            silent = time.monotonic() - self.peer.last_heard
            if gone or silent > lost_after:
                why = (f"silent for {silent:.0f} s" if not gone
                       else f"connection closed ({self.peer.close_reason or 'eof'})")
                self._stop_workers(f"leader lost: {why}")
                return self._fail("leader_lost", f"the leader is gone ({why}); stopped this "
                                  f"node's workers: nothing can coordinate a relaunch")

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
        self.peer.send({"type": "leaving", "why": f"signal {sig}"})
        return 128 + sig

    def _term_grace(self) -> float:
        c = self.plan.config
        return c.checkpoints.final_grace_s + c.launch.stop_grace_s + 10.0

    def _command(self, message: dict[str, Any]) -> int | None:
        kind = message.get("type")
        if kind == "launch":
            self._launch(message)
        elif kind == "stop":
            self._stop_workers(str(message.get("reason", "the leader said so")))
            assert self.peer is not None
            self.peer.send({"type": "stopped", "attempt": self.attempt})
        elif kind == "control":
            fields = message.get("fields")
            if isinstance(fields, dict):
                self.workers.control.request(**fields)
                self._journal("control", fields=fields)
        elif kind == "refused":
            if message.get("final"):
                return self._fail("join_refused", str(message.get("reason")))
            self._journal("join_refused", why=f"{message.get('reason')}; trying again")
            assert self.peer is not None
            self.peer.close()
            raise _Rejoin
        elif kind == "finish":
            self._stop_workers("the run is over")
            code = message.get("code")
            return code if isinstance(code, int) else 1
        return None

    def _launch(self, message: dict[str, Any]) -> None:
        from babysit.supervisor.contract.directive import Directive

        self._stop_workers("a new attempt starts")
        attempt = int(message["attempt"])
        directive = Directive.from_json(message["directive"])
        self.view.new_attempt(time.monotonic(), directive)
        self.attempt, self._step, self._exited = attempt, 0, False
        command = self.workers.launch(
            attempt, directive, rdzv_endpoint=str(message["rdzv_endpoint"]),
            rdzv_id=str(message["rdzv_id"]), nnodes=str(message["nnodes"]),
            node_rank=int(message["node_rank"]))
        self._journal("launch", command=command, rdzv_endpoint=message["rdzv_endpoint"],
                      directive=directive.to_json())

    def _stop_workers(self, reason: str) -> None:
        if self.workers.group is not None and self.workers.group.processes():
            self._journal("stop_workers", reason=reason, pids=self.workers.pids())
            code = self.workers.stop()
            self._journal("workers_stopped", exit_code=code)
        self._exited = True

    # -- reports --------------------------------------------------------------------------------

    def _telemetry(self) -> None:
        now = time.monotonic()
        for message in self.workers.intake.drain():
            if isinstance(message, RankStep):
                self._step = max(self._step, message.step)
                self._report(*self.view.observe_rank(message, now))
            else:
                self._event(message, now)

    def _event(self, event: WorkerEvent, now: float) -> None:
        self.workers.note(event)
        self.view.observe_event(event, now)
        if event.type in FORWARDED:
            self._send({"type": "event", "rank": event.rank, "event": event.type,
                        "time": event.time, "data": event.data})

    def _report(self, summaries: list[StepSummary], findings: list[Finding]) -> None:
        for summary in summaries:
            self._send({"type": "summary", "summary": summary.to_dict()})
        for finding in findings:
            self._journal("finding", step=finding.step, finding=finding.to_json())
            self._send({"type": "finding", "finding": finding.to_json()})

    def _report_hang(self, finding: Finding) -> None:
        if self.workers.rank_pids:
            # Reading stacks takes seconds: the leader waits for this view rather than settle
            # on another node's, whose ranks only wait in the collective.
            self._send({"type": "hang_suspected"})
            finding, diagnosis, fields = forensics.diagnose_hang(finding, self.workers.rank_pids)
            finding = self.view.name(finding)
            self._journal("hang_diagnosis", **fields)
            folder = forensics.write_incident(
                self.plan.run_dir, self.attempt, finding, "reported to the leader", diagnosis,
                self.workers.tails(self.attempt, 8192))
            finding = dataclasses.replace(
                finding, evidence={**finding.evidence, "incident_dir": str(folder)})
        self._report([], [finding])

    def _check_exit(self) -> None:
        if self._exited:
            return
        code = self.workers.poll()
        if code is None:
            return
        self._exited = True
        self._telemetry()
        self._report(*self.view.flush())
        tails: dict[int, str] = {}
        root = None
        if code != 0:
            if self.workers.teardown_only(code, self.attempt):
                self._journal("teardown_crash", exit_code=code)
                code = 0
            else:
                tails, root = self.workers.crash_evidence(self.attempt)
        self._journal("workers_exited", exit_code=code)
        self._send({"type": "exited", "attempt": self.attempt, "code": code,
                    "tails": {str(r): t for r, t in tails.items()}, "root": root,
                    "step": self._step})

    def _send(self, message: dict[str, Any]) -> None:
        """Send to the leader, saying which attempt it is about: the leader drops what an
        attempt it already replaced still had to say."""
        if self.peer is not None:
            self.peer.send(journal_mod.json_safe({"attempt": self.attempt, **message}))

    def _journal(self, event: str, /, step: int | None = None, **fields: Any) -> None:
        self.journal.write(event, time.time(), max(self.attempt, 0),
                           step if step is not None else (self._step or None), node=self.node,
                           **fields)


class _Rejoin(Exception):
    """The leader refused this connection for now: join again."""
