"""Who runs an attempt's ranks, as the control loop sees them: ``Members``.

The loop (``run.loop.Supervisor``) decides; its members launch, stop, steer and report. A
single-node run's members are this node's workers (``LocalMembers``); a multi-node leader's are
every node's (``cluster.leader.ClusterMembers``). Both hand the loop the same things each tick
(``Gathered``): the job's completed steps with their metrics rows, the ranks' events, findings
that need a node's view (per-rank detectors, a hang named from the stacks, a lost node), and
the attempt's end. So one loop serves both, and a test can drive it with members of its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from babysit.policies.rollback import Shelf
from babysit.policies.types import Finding, JobStep, RankStep, Remedy, Severity, StepRecord
from babysit.supervisor.config.plan import RunPlan
from babysit.supervisor.config.slurm import Taken
from babysit.supervisor.contract.directive import Directive
from babysit.supervisor.contract.protocol import WorkerEvent, mfu_inputs
from babysit.supervisor.node import ahead, launcher, standby
from babysit.supervisor.node.aggregate import StepAggregator, metrics_row
from babysit.supervisor.node.gpu_watch import GpuWatch
from babysit.supervisor.node.last_step import Outcome
from babysit.supervisor.node.printed import SOURCE
from babysit.supervisor.node.stacks import Diagnosis
from babysit.supervisor.node.tick import NodeTick, OwnNode
from babysit.supervisor.node.workers import NodeWorkers
from babysit.supervisor.run import exit_codes
from babysit.supervisor.run.watch import Watch

Entry = tuple[str, dict[str, Any]]


@dataclass(frozen=True, slots=True)
class JobEnd:
    """Every member's workers of the attempt ended (or the first failure has settled)."""

    code: int
    """0, or the first failure's exit code."""
    tails: dict[int, str] = field(default_factory=dict)
    """Failed ranks' log tails by global rank, for the crash classifier."""
    root: int | None = None
    """The rank torchrun named as the first observed failure."""
    exits: dict[int, int] = field(default_factory=dict)
    """Each failed rank's own exit code by global rank (negative: the signal that killed
    it), from torchrun's failure summary: the evidence of who failed and how."""


@dataclass
class Gathered:
    """What the members saw since the last tick, for the loop to record and judge."""

    steps: list[tuple[JobStep, dict[str, Any]]] = field(default_factory=list)
    """The job's completed steps, in order, each with its ``metrics.jsonl`` row."""
    events: list[WorkerEvent] = field(default_factory=list)
    """Rare events from every rank (hello, checkpoint, fingerprint, ...)."""
    findings: list[Finding] = field(default_factory=list)
    """What only a node could see: per-rank detectors on a multi-node run, a hang named from
    the stacks, a lost node. The loop judges them like its own."""
    entries: list[Entry] = field(default_factory=list)
    """Journal entries of the members' own (a hang's diagnosis, nodes joining, ...)."""
    warnings: list[str] = field(default_factory=list)
    """Alerts to send at warning severity."""
    newest: int | None = None
    """The newest step any rank reported (ahead of the merged steps by up to a tick)."""
    end: JobEnd | None = None


@dataclass(frozen=True, slots=True)
class Voice:
    """How members speak through the loop while they wait (for nodes to join, say)."""

    journal: Callable[..., None]
    """``journal(event, **fields)``"""
    log: Callable[[str], None]
    status: Callable[[str], None]
    alert: Callable[[Severity, str], None]
    stopping: Callable[[], bool]
    """A signal asked the run to stop: stop waiting."""


class MembersMissing(Exception):
    """Too few members joined, or came back, for the run to go on; the message says why.
    ``lost``: members the run had were lost and did not come back (a requeue on other hosts
    may go on), rather than members that never came (a setup to fix: the secret, an address)."""

    def __init__(self, message: str, lost: bool = False) -> None:
        super().__init__(message)
        self.lost = lost

    def ending(self, signum: int | None) -> dict[str, Any]:
        """The ``run_finished`` entry's fields: stopped when ``signum`` asked for that while
        the run waited for its members, else failed."""
        if signum is not None:
            return {"state": "stopped", "exit_code": 128 + signum, "reason": f"signal {signum}"}
        code = exit_codes.REQUEUE if self.lost else exit_codes.STOP
        return {"state": "failed", "exit_code": code, "reason": str(self)}


class Fenced(MembersMissing):
    """Another babysitter leads the run now (``cluster.leadership``): this one stops its ranks,
    commands nobody, writes nothing more to the run's record, and exits to be restarted as a
    follower (``exit_codes.REQUEUE``)."""


HEARS = ("rerun",)
"""The journal entries the members hear (``Members.hear``): a rerun's verdict, whose ranks a
multi-node leader places on their nodes."""


class Members(Protocol):
    """The loop's view of the processes that train. Calls come from the loop's one thread."""

    scope: str
    """Which step detectors the loop's own ``Watch`` runs (``policies.pipeline.SCOPES``): the
    rest run where the ranks' reports are."""

    def open(self) -> None:
        """Bind what the ranks report to. Called once, before anything else."""

    def ready(self, voice: Voice) -> None:
        """Wait until the run can launch; raises ``MembersMissing``."""

    def launch(self, attempt: int, directive: Directive, now: float,
               keep_nodes: bool = False) -> dict[str, Any]:
        """Start ``attempt``; returns the ``launch`` journal entry's fields. May raise
        ``MembersMissing`` (a lost node that does not come back). ``keep_nodes``: on the
        previous attempt's nodes if they are all still there (a rerun), none added."""

    def stop(self, reason: str, *, replacing: bool = False) -> int | None:
        """Stop every worker of the attempt; this node's torchrun exit code, or None.
        ``replacing``: a new attempt follows (a remedy), so torchrun's own shutdown is not
        waited for once its ranks are gone (``WorkerGroup.stop``)."""

    def keep_last_step(self, fault: str) -> Outcome | None:
        """The live ranks write the last completed step now, every node's (``fault``: what
        left the run without a checkpoint of it, a preemption whose final checkpoint never
        came); what came of it, or None when the run keeps none."""

    def request(self, **fields: Any) -> None:
        """Ask the running ranks for something through the attempt's control file(s)."""

    def gather(self, now: float, watching: bool) -> Gathered:
        """Everything since the last tick. ``watching``: the loop is ready to act on exits and
        hangs (not while it replaces the workers)."""

    def diagnosis(self, finding: Finding) -> Diagnosis | None:
        """The stacks behind a hang finding gathered here, for its incident folder."""

    def shelf(self, finding: Finding, catalog: Shelf) -> Shelf | None:
        """The checkpoints a rollback for ``finding`` could go back to: ``catalog`` (babysit's
        own, ``Recovery.shelf``), or in stdout mode None when a copy of the script's own from
        before the onset vouches for one (an empty shelf when none does)."""

    def shape_remedy(self, remedy: Remedy) -> Remedy:
        """``remedy`` as these members can carry it out: in stdout mode, a rollback with no
        copy of the script's checkpoints becomes an alert saying what would enable it."""

    def prepare(self, remedy: Remedy | None, attempt: int) -> list[Entry]:
        """Before launching ``attempt`` for ``remedy``: put back what it resumes from that is
        not babysit's own (stdout mode's copy of the script's checkpoint); journal entries."""

    def tails(self, attempt: int) -> dict[int, str]:
        """Every rank's log tail of ``attempt`` that this machine has, by global rank."""

    def locate(self, finding: Finding) -> Finding:
        """``finding``, saying which node and host its rank is on where that matters."""

    def hear(self, entry: Mapping[str, Any]) -> None:
        """A journal entry of one of the kinds in ``HEARS`` (the loop's journal listener)."""

    def pids(self) -> list[int]:
        """This node's processes of the attempt (torchrun and its ranks)."""

    def rank_pids(self) -> tuple[int, ...]:
        """This node's ranks' pids (for health sampling)."""

    def live_nodes(self) -> list[int]:
        """The nodes alive now (``cluster`` numbering; a single node is node 0): whose shared
        memory still holds its memory copies (``checkpoints.memory``)."""

    def running(self) -> bool:
        """This node's workers of the current attempt are still up."""

    def output(self) -> Iterator[str]:
        """Rank output printed since the last call, prefixed with its rank."""

    def close(self, code: int | None) -> list[Entry]:
        """The run is over (``code``: its exit code, None if it failed before one); stop what
        is left. Returns journal entries for what it stopped (a warm standby). Idempotent: the
        loop closes at the run's end and again in its teardown (which an error may reach)."""


class OnThisNode:
    """What every member set does with the workers on this machine (``self.workers``, and their
    tick ``self.node``): the part of ``Members`` a single node and a leader share. Scripts that
    print their progress instead of attaching (stdout mode) are a single node's business:
    here a rollback is babysit's own and nothing else is restored."""

    workers: NodeWorkers
    node: OwnNode[Any]

    def open(self) -> None:
        self.workers.open()

    def close_workers(self) -> list[Entry]:
        """Stop this node's workers and its standby; the standby's journal entries."""
        self.workers.close()
        return self.workers.take_standby_entries()

    def shelf(self, finding: Finding, catalog: Shelf) -> Shelf | None:
        return catalog

    def shape_remedy(self, remedy: Remedy) -> Remedy:
        return remedy

    def prepare(self, remedy: Remedy | None, attempt: int) -> list[Entry]:
        return []

    def diagnosis(self, finding: Finding) -> Diagnosis | None:
        # Each node reads its own ranks' stacks when its timers fire; this node's go into the
        # incident folder when its view was chosen (other nodes' are in their own folders).
        hang = self.node.hang
        return hang.diagnosis if hang is not None and hang.finding == finding else None

    def pids(self) -> list[int]:
        return self.workers.pids()

    def hear(self, entry: Mapping[str, Any]) -> None:
        pass  # one node: nothing to place the journal's verdicts on

    def rank_pids(self) -> tuple[int, ...]:
        return tuple(self.workers.rank_pids.values())

    def live_nodes(self) -> list[int]:
        return [self.workers.plan.node_rank]

    def running(self) -> bool:
        return self.workers.running

    def output(self) -> Iterator[str]:
        return self.workers.output()

    def record_tick(self, tick: NodeTick[Any], out: Gathered) -> None:
        """The journal entries and warnings of this node's tick, whoever judges its findings:
        hangs the processes cleared, hangs diagnosed from the stacks, and an exit where only
        the processes' teardown crashed or hung after every rank closed its run (counted as
        finished: a relaunch would redo nothing)."""
        out.entries += [("hang_cleared", fields) for fields in tick.cleared]
        out.entries += [("hang_diagnosis", hang.fields) for hang in tick.hangs if hang.fields]
        teardown = tick.exit.teardown(self.workers.closed_ranks) if tick.exit else None
        if teardown is not None:
            event, fields, warning = teardown
            out.entries.append((event, fields))
            out.warnings.append(warning)


class LocalMembers(OnThisNode):
    """A single-node run: this node's workers are the whole job."""

    scope = "all"

    def __init__(self, plan: RunPlan, watch: Watch, early: ahead.Early | None = None) -> None:
        self.plan = plan
        self.watch = watch
        self.workers = NodeWorkers(plan, plan.run_dir, early)
        self.judge = LocalJudge(watch, plan.world_size or 1)
        self.node: OwnNode[list[StepRecord]] = OwnNode(
            self.workers, self.judge, flush_on_exit=False,
            gpus=GpuWatch(plan.config.schedule.health_every_s), on_ending=self._keep_last_step)
        self._entries: list[Entry] = []
        """Journal entries made between gathers (a just-in-time save at a stop)."""
        launch = plan.config.launch
        gpus = standby.gpus_visible(launch)
        self.standby = standby.Trigger(standby.off_reason(launch, gpus),
                                       at_stall=standby.spare_cores(plan.world_size or 1))
        """When to start the next attempt's warm standby (``node.standby``)."""
        self.standby_kind = standby.kind(launch, gpus)

    def ready(self, voice: Voice) -> None:
        return None

    def launch(self, attempt: int, directive: Directive, now: float,
               keep_nodes: bool = False) -> dict[str, Any]:
        fields: dict[str, Any] = {}

        def start() -> list[str]:
            promoted = self.workers.promote(attempt, directive)
            if promoted is not None:  # warm: its ranks wait in attach() for this directive
                fields.update(promoted.launch_fields(time.time()))
                return promoted.group.command
            endpoint = self._endpoint()
            fields.update(standby=False, rdzv_endpoint=endpoint)
            if self.standby.off is not None:  # why no relaunch of this run is warm
                fields["standby_off"] = self.standby.off
            command = self.workers.launch(attempt, directive, rdzv_endpoint=endpoint,
                                          rdzv_id=self._rdzv_id(attempt))
            fields["torchrun_ahead"] = self.workers.launched_ahead
            return command

        command = self.node.launch(attempt, directive, now, start)
        # A rerun that reproduces ends in the skip's relaunch within seconds: warm it too.
        self.standby.new_attempt(attempt, soon=self.watch.rerun is not None)
        assert self.workers.group is not None
        return {"pid": self.workers.group.pid, "command": command, **fields,
                **Taken.fields(self.plan.slurm)}

    def _endpoint(self) -> str:
        return self.plan.config.launch.rdzv_endpoint or f"127.0.0.1:{launcher.free_port()}"

    def _rdzv_id(self, attempt: int) -> str:
        return self.plan.config.launch.rdzv_id or f"{self.plan.name}-{attempt}"

    def _keep_standby(self, tick: NodeTick[Any], now: float, watching: bool) -> list[Entry]:
        """Start the next attempt's standby when due; journal one that ended on its own; stop
        it once every rank closed its run (no attempt follows one that finished, even if its
        teardown crashes), while the ranks are still exiting rather than after."""
        self.workers.standby_exit()
        if self.workers.all_closed:
            self.workers.drop_standby("every rank closed its run", at_once=True)
        # A hello of stdout mode's own (the script never attaches) would start no waiter.
        self.standby.observe(now, hello=any(e.type == "hello" and e.data.get("source") != SOURCE
                                            for e in tick.events), stepped=any(tick.outputs),
                             closed=self.workers.all_closed)
        have = self.workers.standby.attempt if self.workers.standby is not None else None
        looming = self.node.looming
        target = self.standby.due(now, watching and self.node.running, have, looming)
        if target is not None:
            self.workers.drop_standby(f"attempt {target} needs one")
            self.workers.start_standby(target, self.standby_kind,
                                       rdzv_endpoint=self._endpoint(),
                                       rdzv_id=self._rdzv_id(target), at_stall=looming)
        waiting = self.workers.standby
        # Its start-up (interpreters, import torch) competes with the training ranks for the
        # CPU: a slowdown babysit causes is not the run's.
        self.judge.own_load(waiting is not None and waiting.warming(time.time()))
        return self.workers.take_standby_entries()

    def stop(self, reason: str, *, replacing: bool = False) -> int | None:
        if replacing and self.node.hang is not None:  # a relaunch after a hang: keep its step
            self._keep_last_step("hang")
        return self.node.stop(replacing)

    def keep_last_step(self, fault: str) -> Outcome | None:
        return self.workers.keep_last_step(fault)

    def _keep_last_step(self, fault: str) -> None:
        """Ranks are ending (``fault``: a crash, a SIGTERM) or about to be stopped after a hang:
        the live ones write the last completed step now (``NodeWorkers.keep_last_step``)."""
        outcome = self.keep_last_step(fault)
        if outcome is not None:
            self._entries.append(outcome.entry())

    # -- stdout mode (``node.printed``): the script's own checkpoints ---------------------------

    def shelf(self, finding: Finding, catalog: Shelf) -> Shelf | None:
        printed = self.workers.printed
        if not printed.active:
            return catalog
        return None if printed.can_roll_back(finding) else Shelf()

    def shape_remedy(self, remedy: Remedy) -> Remedy:
        return self.workers.printed.remedy(remedy)

    def prepare(self, remedy: Remedy | None, attempt: int) -> list[Entry]:
        return self.workers.restore_script_checkpoint(remedy, attempt)

    def request(self, **fields: Any) -> None:
        self.workers.control.request(**fields)

    def gather(self, now: float, watching: bool) -> Gathered:
        tick = self.node.tick(now, watching)
        out = Gathered(events=tick.events, newest=tick.newest)
        attempt = self.node.attempt
        out.steps = [(record, metrics_row(record, attempt))
                     for records in tick.outputs for record in records]
        out.entries, self._entries = self._entries, []
        self.record_tick(tick, out)
        out.entries += self._keep_standby(tick, now, watching)
        out.findings += [hang.finding for hang in tick.hangs] + tick.faults
        if tick.exit is not None:
            out.end = JobEnd(tick.exit.code, tick.exit.tails, tick.exit.root, tick.exit.exits)
        return out

    def tails(self, attempt: int) -> dict[int, str]:
        return self.workers.tails(attempt, 8192)

    def locate(self, finding: Finding) -> Finding:
        return finding

    def close(self, code: int | None) -> list[Entry]:
        return self.close_workers()


class LocalJudge:
    """A single-node run's judge: this node's reports merged into the job's steps (every rank is
    here), and the watch's hang timers. The steps are judged by the run's own ``Watch``."""

    def __init__(self, watch: Watch, world_size: int) -> None:
        self.watch = watch
        self.aggregator = StepAggregator(world_size)

    def new_attempt(self, now: float, directive: Directive) -> None:
        # The watch is the run's own: the loop starts its attempt (hang timers included).
        self.aggregator.reset()

    def observe_event(self, event: WorkerEvent, now: float) -> None:
        self.watch.observe_event(event, now)
        if event.type != "hello":
            return
        world = event.data.get("world_size")
        if isinstance(world, int) and world > 0:
            self.aggregator.world_size = world
        if event.rank == 0:
            self.aggregator.flops_per_token, self.aggregator.peak_flops = mfu_inputs(event.data)

    def observe_rank(self, sample: RankStep, now: float) -> list[StepRecord]:
        self.watch.observe_rank(sample, now)
        return self.aggregator.add(sample)

    def flush(self) -> list[StepRecord]:
        return self.aggregator.flush()

    def check(self, now: float) -> list[Finding]:
        return self.watch.check(now)

    def looming(self, now: float) -> bool:
        return self.watch.hang_looming(now)

    def defer_hang(self, finding: Finding, now: float) -> None:
        self.watch.defer_hang(finding, now)

    def name(self, finding: Finding) -> Finding:
        return finding

    def own_load(self, busy: bool) -> None:
        """babysit's own work (a warm standby starting up) competes with the ranks for the CPU
        now: a slowdown it causes is not the run's."""
        self.watch.own_load = busy
