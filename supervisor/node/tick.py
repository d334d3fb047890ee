"""This node's workers, one tick at a time: the tick every babysitter runs over its own ranks.

The single-node supervisor, a multi-node leader (for its own node) and every follower do the same
things with the ranks on their machine each tick, and this is the one place that does them::

    drain the telemetry socket    each report to the node's judge, each event noted
    has torchrun exited?          the exit code; 0 if only the teardown crashed after every
                                  rank closed; else every rank's log tail and torchrun's root
                                  (a rank died and torchrun printed its failure summary: as
                                  good as exited, so it is stopped rather than waited for)
    every rank closed, still up?  a teardown with no CPU progress for
                                  ``launch.teardown_idle_s`` is stopped, counted as finished;
                                  so is torchrun lingering after its ranks exited, once no
                                  other node can still come to its exit barrier
    is anything hung?             the judge's hang timers, confirmed from the ranks' process
                                  state, CPU and stacks, and named (or cleared: working); half-way
                                  to a suspicion, the slow native stacks are read ahead
    did a GPU fail?               every ``schedule.health_every_s``, NVML's uncorrectable ECC
                                  errors and machine Xids (``gpu_watch``), named with the ranks

What a report *means* is the judge's business: ``run.members.LocalJudge`` turns this node's
reports into the job's steps (a single-node run: this node is the job),
``cluster.node_view.NodeView`` into per-node findings and the summaries a leader merges.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from babysit.policies.types import Finding, RankStep
from babysit.supervisor.contract.directive import Directive
from babysit.supervisor.contract.protocol import WorkerEvent
from babysit.supervisor.node import hang, stall, teardown
from babysit.supervisor.node.gpu_watch import GpuWatch
from babysit.supervisor.node.stacks import Diagnosis
from babysit.supervisor.node.workers import NodeWorkers

Out = TypeVar("Out")
Out_co = TypeVar("Out_co", covariant=True)


class NodeJudge(Protocol[Out_co]):
    """What a node's tick asks about its ranks. ``Out`` is what completed steps become."""

    def new_attempt(self, now: float, directive: Directive) -> None: ...
    def observe_event(self, event: WorkerEvent, now: float) -> None: ...
    def observe_rank(self, sample: RankStep, now: float) -> Out_co: ...
    def flush(self) -> Out_co: ...
    def check(self, now: float) -> list[Finding]: ...
    def looming(self, now: float) -> bool: ...
    def defer_hang(self, finding: Finding, now: float) -> None: ...
    def name(self, finding: Finding) -> Finding: ...


@dataclass(frozen=True, slots=True)
class NodeExit:
    """torchrun ended on this node."""

    code: int
    """Its exit code, or 0 when only the teardown crashed after every rank closed its run."""
    tails: dict[int, str]
    """A failed attempt's log tails by global rank (empty for code 0)."""
    root: int | None
    """The rank torchrun names as its first observed failure, if any."""
    teardown_code: int | None = None
    """torchrun's own code when only its teardown failed (``code`` is then 0)."""
    teardown_hung: dict[str, Any] | None = None
    """When the teardown hung after every rank closed and babysit stopped torchrun: ``idle_s``,
    the ranks' ``processes`` as last seen (``stall.RankProcess.to_json``) and
    ``ranks_exited_s`` (set when it was judged by torchrun outliving its exited ranks that
    long, None when by the ranks' idle CPU); else None."""
    exits: dict[int, int] = field(default_factory=dict)
    """Each failed rank's own exit code by global rank (``NodeWorkers.rank_exits``)."""

    def teardown(self, closed_ranks: set[int]) -> tuple[str, dict[str, Any], str] | None:
        """The journal entry (event, fields) and console warning of an attempt counted as
        finished although its teardown failed; None for any other exit."""
        closed = sorted(closed_ranks)
        if self.teardown_hung is not None:
            idle, exited = self.teardown_hung["idle_s"], self.teardown_hung["ranks_exited_s"]
            how = (f"torchrun still up {exited:g} s after every rank's process exited: its exit "
                   f"barrier waits for a node that will not come" if exited is not None else
                   f"no CPU progress for {idle:g} s")
            return ("teardown_hang", {"exit_code": self.teardown_code, "closed_ranks": closed,
                                      **self.teardown_hung},
                    f"every rank finished and closed, then the process teardown hung ({how}); "
                    f"torchrun stopped, counted as finished")
        if self.teardown_code is not None:
            return ("teardown_crash", {"exit_code": self.teardown_code, "closed_ranks": closed},
                    f"every rank finished and closed, then the process teardown crashed "
                    f"(torchrun exit {self.teardown_code}); counted as finished")
        return None


@dataclass(frozen=True, slots=True)
class Hang:
    """A hang this node's timers found, after its ranks' stacks were read."""

    finding: Finding
    diagnosis: Diagnosis | None
    fields: dict[str, Any]
    """The ``hang_diagnosis`` journal entry's fields (empty when no rank had said hello)."""


@dataclass
class NodeTick(Generic[Out]):
    """What one tick saw on this node, in the order it happened."""

    outputs: list[Out] = field(default_factory=list)
    """The judge's answer to each report (and its flush at the attempt's end)."""
    events: list[WorkerEvent] = field(default_factory=list)
    newest: int | None = None
    """The newest step any of this node's ranks reported in this tick."""
    hangs: list[Hang] = field(default_factory=list)
    rank_died: bool = False
    """A rank's process of this node is gone while torchrun still runs: a crash in progress
    (said once per attempt; torchrun's exit follows when it has torn the rest down)."""
    cleared: list[dict[str, Any]] = field(default_factory=list)
    """The ``hang_cleared`` entries' fields: suspected hangs the ranks' processes refuted."""
    faults: list[Finding] = field(default_factory=list)
    """Machine faults this node's own devices reported (``gpu_watch``), named."""
    exit: NodeExit | None = None


class OwnNode(Generic[Out]):
    """One node's workers and its judge; ``tick()`` once per loop tick."""

    def __init__(self, workers: NodeWorkers, judge: NodeJudge[Out], *, flush_on_exit: bool,
                 on_suspect: Callable[[Finding], None] | None = None,
                 gpus: GpuWatch | None = None,
                 on_ending: Callable[[str], None] | None = None,
                 others_up: Callable[[], bool] | None = None) -> None:
        """``flush_on_exit``: at torchrun's exit, the steps some rank never finished still go
        out (a node of a cluster: the leader merges what each node has); a single-node run
        drops them instead. ``on_suspect`` hears of a hang before the stacks are read, which
        takes seconds (a follower tells the leader to wait for its view). ``gpus``: this
        node's GPUs, looked at while an attempt runs (None: never). ``on_ending`` hears, at
        once, that ranks are ending on their own: one died while torchrun runs, or one is holding
        on at its end after an uncaught exception (``"crash"``), or after a SIGTERM
        (``"SIGTERM"``); the others still hold the last completed step
        (``node.just_in_time``). ``others_up``: a leader's node, whose torchrun hosts the
        rendezvous store: whether other nodes' torchruns of the attempt still run (a torchrun
        lingering here after its ranks exited is waited out while they do:
        ``teardown.Teardown``)."""
        self.workers = workers
        self.on_ending = on_ending
        self.gpus = gpus
        self.others_up = others_up
        self._ranks: set[int] = set()
        """This attempt's ranks on this node, from their hellos."""
        self._step = 0
        self.judge = judge
        self.flush_on_exit = flush_on_exit
        self.on_suspect = on_suspect
        self.attempt = -1
        self.running = False
        """An attempt was launched here and neither exited nor was stopped."""
        self.hang: Hang | None = None
        """The newest hang found here (its stacks go into the incident folder)."""
        self._death_told = False
        self._teardown: teardown.Teardown | None = None
        self._confirmer = hang.Confirmer()
        self.looming = False
        """This tick saw a stall half-way to a hang suspicion (every rank alive)."""

    def launch(self, attempt: int, directive: Directive, now: float,
               start: Callable[[], list[str]]) -> list[str]:
        """A new attempt: reset the judge, then ``start`` the workers (``NodeWorkers.launch``
        with this attempt's rendezvous); returns the torchrun command."""
        self.judge.new_attempt(now, directive)
        self.attempt, self.running, self.hang, self._death_told = attempt, True, None, False
        self._ranks = set()
        self._teardown, self._confirmer = None, hang.Confirmer()
        return start()

    def stop(self, replacing: bool = False) -> int | None:
        """Stop the attempt's processes; torchrun's exit code (None if none was started).
        ``replacing``: as ``NodeWorkers.stop``'s."""
        self.running = False
        return self.workers.stop(replacing)

    def tick(self, now: float, watching: bool = True) -> NodeTick[Out]:
        """Everything since the last tick. ``watching``: also notice torchrun's exit and hangs
        (off while the caller is replacing the workers: what they do then judges nothing)."""
        out: NodeTick[Out] = NodeTick()
        self.looming = False
        holding = self._drain(now, out)
        if not (watching and self.running):
            return out
        if holding is not None and self.on_ending is not None:
            # A rank holds on at its end: after a crash when a rank here died (torchrun's SIGTERM
            # to the survivors is the crash's, not a scheduler's), else for what it said.
            dead = not stall.all_alive(self.workers.rank_pids.values())
            self.on_ending("crash" if dead else holding)
        if self.gpus is not None and self._ranks:
            out.faults += [self.judge.name(f)
                           for f in self.gpus.look(now, self._step, self._ranks)]
        if out.newest is not None:  # stepping: its own start-up no longer needs the CPU
            self.workers.keep_ahead(self.attempt + 1)
        if self.others_up is not None and not self.others_up():
            self.workers.release_store()  # nobody else's torchrun needs it now
        code = self.workers.poll()
        if code is not None:
            self._end(now, out, self._exit(code))
        elif self.workers.all_closed:
            # The training is over: only the processes' teardown is left, which no hang timer
            # watches. One that sits with no CPU progress is stuck: torchrun would wait forever.
            launch = self.workers.plan.config.launch
            idle_s = launch.teardown_idle_s
            if self._teardown is None:
                # A follower's torchrun waits in its exit barrier for the other nodes, whose
                # teardowns their own babysitters give idle_s; the leader's, while they run.
                several = launch.multinode and self.others_up is None
                group = self.workers.group
                self._teardown = teardown.Teardown(
                    self.workers.rank_pids, now, idle_s,
                    idle_s + teardown.Teardown.EXITED_S if several else teardown.Teardown.EXITED_S,
                    launcher=group.pid if group is not None else None)
            elif self._teardown.stuck(now, self.others_up is not None and self.others_up()):
                seen = {str(r): p.to_json() for r, p in self._teardown.seen.items()}
                stopped = self.workers.end_now()  # nothing in it is left to wait for
                self._end(now, out, NodeExit(0, {}, None, teardown_code=stopped, teardown_hung={
                    "idle_s": idle_s, "processes": seen,
                    "ranks_exited_s": self._teardown.linger_s
                    if self._teardown.exited else None}))
        elif self.workers.group is not None:
            if stall.all_alive(self.workers.rank_pids.values()):
                self.looming = self.judge.looming(now)
                self.workers.hold_standby(self.looming)  # the look needs the CPU (NodeWorkers)
                self._confirmer.ahead(self.workers.rank_pids, self.looming)
                for finding in self.judge.check(now):
                    self.workers.hold_standby(True)
                    self._confirm(finding, now, out)
            else:
                # A rank whose process died is a crash in progress (torchrun reports it in a
                # moment), not a hang: its peers wait on a connection that is already gone.
                out.rank_died = not self._death_told
                self._death_told = True
                if out.rank_died and self.on_ending is not None:
                    self.on_ending("crash")
                if self.workers.failure_summarized(self.attempt):
                    # torchrun stopped every rank and said who failed and how; its own exit
                    # (its interpreter's teardown, about 0.5 s) tells nothing more.
                    self.workers.end_now()
                    self._end(now, out, self._exit(1))
        return out

    def _drain(self, now: float, out: NodeTick[Out]) -> str | None:
        """Everything the ranks sent; whether one says it is holding on at its end, and why
        (``"crash"``: an uncaught exception; ``"SIGTERM"``)."""
        holding: str | None = None
        for message in self.workers.telemetry():  # the socket, then printed progress
            if isinstance(message, RankStep):
                out.newest = max(out.newest or 0, message.step)
                self._step = max(self._step, message.step)
                out.outputs.append(self.judge.observe_rank(message, now))
            else:
                if message.type == "hello":
                    self._ranks.add(message.rank)
                self.workers.note(message)
                self.judge.observe_event(message, now)
                out.events.append(message)
                if message.type == "holding" and holding is None:
                    holding = "SIGTERM" if message.data.get("why") == "SIGTERM" else "crash"
        return holding

    def _end(self, now: float, out: NodeTick[Out], end: NodeExit) -> None:
        self.running = False
        self._drain(now, out)  # the last reports before the exit
        if self.flush_on_exit:
            out.outputs.append(self.judge.flush())
        out.exit = end

    def _exit(self, code: int) -> NodeExit:
        if code and self.workers.teardown_only(code, self.attempt):
            return NodeExit(0, {}, None, teardown_code=code)
        if not code:
            return NodeExit(0, {}, None)
        tails, root = self.workers.crash_evidence(self.attempt)
        return NodeExit(code, tails, root, exits=self.workers.rank_exits(self.attempt))

    def _confirm(self, finding: Finding, now: float, out: NodeTick[Out]) -> None:
        """Look at every rank before calling a stall a hang (``hang.confirm``): a confirmed one
        is named from its process state, CPU and stack; one the processes refute (the ranks are
        working) defers the judge's hang timer instead."""
        if not self.workers.rank_pids:
            self.hang = Hang(finding, None, {})
            out.hangs.append(self.hang)
            return
        if self.on_suspect is not None:
            self.on_suspect(finding)
        seen = self._confirmer.confirm(finding, self.workers.rank_pids)
        if seen.finding is None:
            self.judge.defer_hang(finding, now)
            out.cleared.append(seen.fields)
            return
        self.hang = Hang(self.judge.name(seen.finding), seen.diagnosis, seen.fields)
        out.hangs.append(self.hang)
