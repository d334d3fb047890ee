"""The supervisor's control loop: one gather per tick, decide, perform.

It reads top-down, like torch elastic's ``_invoke_run``::

    launch the first attempt             (with the remedy a dead supervisor decided, if any)
    every tick (0.1 s):
        gather    members.gather()       the job's steps, rank events, findings only a node
                                         can make (a hang named from its stacks), the end
        record    each step              metrics.jsonl; the watch judges it
        judge     each finding           the policy's remedy; an incident folder if disruptive
        decide    each event             decide(machine, event) -> (machine, actions), pure
        perform   each action            launch, stop, wait (backoff), notify, finish

Who trains is the ``members`` (``run.members``): this node's workers, or on a multi-node leader
every node's (``cluster.leader.ClusterMembers``); the loop is the same. What only needs to know
what happened listens instead of being called: to the journal (``Journal.listen``: the services,
the checkpoint cadence, the recovery's probation, the progress line) and to the steps
(``StepLog.listen``). The stop signals are caught, and a SIGTERM's wait for a final checkpoint
kept, by ``preemption.Preemption``; taking over a dead supervisor's run is ``takeover.begin``.
"""

from __future__ import annotations

import functools
import os
import time
from collections import deque
from collections.abc import Callable

from babysit.checkpoints import Catalog
from babysit.checkpoints.memory import Place
from babysit.policies import decide as sm
from babysit.policies.types import Finding, Remedy, Severity
from babysit.supervisor.config.plan import RunPlan
from babysit.supervisor.node import ahead, launcher
from babysit.supervisor.node.shm import NodeMemory
from babysit.supervisor.run import exit_codes, preemption, run_dir, slurm_job, takeover
from babysit.supervisor.run import journal as journal_mod
from babysit.supervisor.run.background import Services
from babysit.supervisor.run.cadence_live import LiveCadence
from babysit.supervisor.run.console import Console
from babysit.supervisor.run.judge import Judge
from babysit.supervisor.run.members import (
    HEARS,
    Fenced,
    Gathered,
    LocalMembers,
    Members,
    MembersMissing,
    Voice,
)
from babysit.supervisor.run.progress import RunProgress
from babysit.supervisor.run.record import Record
from babysit.supervisor.run.recovery import Recovery
from babysit.supervisor.run.resuming import resuming
from babysit.supervisor.run.watch import Watch
from babysit.supervisor.services.alerts import AlertDispatcher

TICK_S = 0.1
WATCH_STATE_EVERY = 100
"""Steps between journaled judgement states (a few KB each: the detectors' windows)."""
Item = sm.Event | Finding
"""What one tick hands to the decision: events, and findings still to be judged."""


class Supervisor:
    """Runs one babysat job to its end. ``run()`` returns the process exit code.

    ``clock`` is the monotonic clock used for every timeout (injectable for tests); wall-clock
    times in the journal come from ``time.time()``. ``members``: who trains; this node's workers
    (``LocalMembers``) when None.
    """

    def __init__(self, plan: RunPlan, console: Console,
                 clock: Callable[[], float] = time.monotonic,
                 members: Members | None = None, early: ahead.Early | None = None) -> None:
        self.plan, self.console, self.clock = plan, console, clock
        self.machine = sm.Machine()
        self.watch = Watch.from_plan(plan, scope=members.scope if members else "all")
        self.members = members if members is not None else LocalMembers(plan, self.watch,
                                                                                  early)
        c = plan.config.checkpoints
        here = NodeMemory.of(plan.shared_dir, plan.node_rank)
        self.recovery = Recovery(
            Catalog(plan.checkpoint_dir, memory=Place(plan.node_rank, here.root,
                                                      self.members.live_nodes)),
            c.probation_steps, c.keep, sdc_checks=plan.config.sdc.every_steps > 0)
        self.record = Record(plan.run_dir, self.watch, self.recovery, plan.world_size or 1,
                             where=lambda: self.machine,
                             warn=lambda title: self._alert(Severity.WARNING, title))
        self._journal, self._journal_all = self.record.write, self.record.write_all
        self.judge = Judge(plan.run_dir, self.watch, self.recovery, self.members, self.record,
                           console.log)
        self.cadence = LiveCadence(c, journal=self._journal, log=console.log,
                                   request=self.members.request, newest_step=self._newest)
        # Results come on an alert sender thread; the journal is thread-safe, records hold no URL.
        self.alerts = AlertDispatcher.from_config(plan.config.alerts, on_result=lambda record:
                                                  self._journal("alert_delivery", result=record))
        self.services = Services(plan, self.alerts)
        self.progress = RunProgress()
        self.preemption = preemption.Preemption(
            c, self.recovery.catalog, journal=self._journal, log=console.log,
            warn=lambda title: self._alert(Severity.WARNING, title),
            request=self.members.request, newest_step=self._newest,
            grace=slurm_job.sigterm_grace(plan), keep=self.members.keep_last_step)
        self._launched = False
        self._exit_code: int | None = None
        self._wake_at: float | None = None
        self._started = 0.0
        self._first_attempt = 0
        self._takeover: takeover.Takeover | None = None
        self._requeued: list[int] = []
        """Steps at which earlier sessions of this run directory ended in a requeue."""

    # -- lifecycle ------------------------------------------------------------------------------

    def run(self) -> int:
        self._setup()
        try:
            self._exit_code = self._loop()
        except Fenced as exc:  # another node leads now: not a word more in the run's record
            self.record.journal.fence()
            self.console.log(f"babysit: fenced: {exc}; stopped this node's workers")
            self._exit_code = exit_codes.REQUEUE
        except MembersMissing as exc:
            self._exit_code = self._members_missing(exc)
        except BaseException as exc:
            # A bug in babysit itself: leave a trace in the journal; teardown stops the workers.
            self._journal("supervisor_error", error=f"{type(exc).__name__}: {exc}")
            raise
        finally:
            self._teardown()
        return self._exit_code

    def _setup(self) -> None:
        previous = run_dir.prepare(self.plan)
        self._first_attempt = run_dir.next_attempt(previous)
        self._requeued = exit_codes.requeued_steps(previous)
        self.machine = sm.Machine(attempt=self._first_attempt)
        restored = self.cadence.restore(previous)
        self._listen()
        self.record.open()
        self.members.open()
        self.alerts.start()
        launcher.become_subreaper()
        self.preemption.catch()
        self._started = self.clock()
        self._journal("run_started", name=self.plan.name, run_dir=str(self.plan.run_dir),
                      source=self.plan.source, pid=os.getpid(), resumed_journal=bool(previous))
        self._journal_all(restored)
        self.console.log(f"babysit: run '{self.plan.name}' in {self.plan.run_dir}")
        self.console.log(self.plan.config.checkpoints.said())
        self._takeover = takeover.begin(journal_mod.prior_run(previous), self.plan, self.watch,
                                        self._journal, self.console.log)
        self._journal_all(self.services.start(self.console.log))

    def _listen(self) -> None:
        """Who hears what happened, in the order they hear it."""
        journal, steps = self.record.journal, self.record.steps
        journal.listen(self.services.hear)
        journal.listen(self.watch.hear, Watch.EVENTS)
        journal.listen(lambda entry: self._journal_all(self.recovery.hear(entry)),
                       Recovery.EVENTS)
        journal.listen(self.cadence.hear, LiveCadence.EVENTS)
        journal.listen(self.progress.hear, ("finding",))
        journal.listen(self.preemption.hear, preemption.Preemption.EVENTS)
        journal.listen(self.members.hear, HEARS)
        journal.listen(self.console.hear, Console.HEARS)
        steps.listen(lambda record, row: self.progress.observe(record))
        steps.listen(lambda record, row: self.cadence.observe_step(record))
        steps.listen(self.services.observe_step)

    def _teardown(self) -> None:
        self._journal_all(self.members.close(self._exit_code))
        self.services.stop(self.console.log, asked=lambda: self.preemption.caught is not None)
        self.alerts.close()
        self.record.close()
        self.console.close()

    # -- the loop -------------------------------------------------------------------------------

    def _loop(self) -> int:
        self.members.ready(Voice(journal=self._journal, log=self.console.log,
                                 status=self.console.status, alert=self._alert,
                                 stopping=lambda: self.preemption.caught is not None))
        ended = self._takeover.ended() if self._takeover is not None else None
        if ended is not None:  # the job finished while no supervisor watched: nothing to do
            self._journal("run_finished", **ended)
            self.console.log(f"babysit: {ended['reason']}")
            return 0
        pending: deque[Item] = deque()
        inherited = self._takeover.inherited if self._takeover is not None else None
        code = self._perform(sm.Launch(self.machine.attempt, inherited), pending)
        while code is None:
            # Sleep, never wait on the telemetry socket: a waiting reader makes every rank's
            # report pay for waking it (see babysit.supervisor.node.intake).
            time.sleep(TICK_S)
            pending.extend(self._gather())
            code = self._settle(pending)
            self.console.status(self.progress.status_line(self.machine))
        self._summary(code)
        return code

    def _gather(self) -> list[Item]:
        """Everything since the last tick, as events and findings in a fixed order."""
        now, state = self.clock(), self.machine.state  # SIGTERM: a final checkpoint first
        signum = self.preemption.take(now, self._launched and state is sm.State.RUNNING)
        waiting = self.preemption.waiting
        watching = not waiting and state in (sm.State.STARTING, sm.State.RUNNING)
        got = self._take(self.members.gather(now, watching))
        if waiting:  # findings and exits are moot now: the run is stopping
            got, signum = [], self.preemption.tick(now, self.members.running())
        items: list[Item] = [sm.StopRequested(signum)] if signum is not None else []
        items += got
        if self._wake_at is not None and now >= self._wake_at:
            self._wake_at = None
            items.append(sm.BackoffElapsed())
        self.services.publish(self.progress.snapshot(self.machine), self.members.rank_pids())
        self._journal_all(self.services.drain(self.console.log))
        return items

    def _settle(self, pending: deque[Item]) -> int | None:
        """Judge each finding and decide each event, in order; the exit code once one ends the
        run."""
        while pending:
            item = pending.popleft()
            if isinstance(item, Finding):
                # Judged only now: once an earlier finding of this tick started a remedy,
                # later ones are about workers being replaced and must not use up the ladder.
                if self.machine.state not in (sm.State.STARTING, sm.State.RUNNING):
                    self._journal("finding_set_aside", finding=item.to_json(),
                                  state=self.machine.state.value)
                    continue
                item = sm.Remedied(self.judge.finding(item, self.machine.attempt))
            old = self.machine
            self.machine, actions = sm.decide(old, item)
            if self.machine.state is not old.state:
                old_s, new_s, why = old.state.value, self.machine.state.value, self.machine.reason
                self._journal("state", old=old_s, new=new_s, reason=why)
                self.console.log(f"babysit: {old_s} -> {new_s} ({why})")
            for action in actions:
                code = self._perform(action, pending)
                if code is not None:
                    return code
        return None

    def _perform(self, action: sm.ActionT, pending: deque[Item]) -> int | None:
        if isinstance(action, sm.Launch):
            self._launch(action.attempt, action.remedy)
        elif isinstance(action, sm.StopWorkers):
            # INTERVENING: stopped to be replaced (a remedy), not because the run ends.
            replacing = self.machine.state is sm.State.INTERVENING
            self._stop_workers(action.reason, replacing)
            if replacing:
                # What the stopped ranks sent last (a checkpoint they finished) counts before
                # the relaunch, in this tick, chooses where to resume.
                pending.extend(self._take(self.members.gather(self.clock(), False)))
                pending.append(sm.WorkersStopped())
        elif isinstance(action, sm.Wait):
            self._journal("backoff", seconds=action.seconds)
            if action.seconds > 0:
                self._wake_at = self.clock() + action.seconds
            else:  # no wait: relaunch in this tick, not the next
                pending.append(sm.BackoffElapsed())
        elif isinstance(action, sm.Notify):
            self._notify(action)
        elif isinstance(action, sm.Finish):
            return self._finish(action.code)
        return None

    def _take(self, got: Gathered) -> list[Item]:
        """Record what the members saw (``Record.take``), print the ranks' output, and judge
        the attempt's end; what is left to decide, in order."""
        judging = self.machine.state in (sm.State.STARTING, sm.State.RUNNING)
        items: list[Item] = [*self.record.take(got, judging)]
        self._print_output()
        if got.end is not None:
            items.append(self.judge.end(got.end, self.machine.attempt, self.machine.step))
        return items

    # -- actions --------------------------------------------------------------------------------

    def _launch(self, attempt: int, remedy: Remedy | None) -> None:
        takeover = self._takeover if attempt == self._first_attempt and remedy is None else None
        found = resuming(self.recovery, self.members, self.watch, remedy, attempt,
                         takeover.prior.last_step if takeover is not None else None, self._newest())
        self._journal_all(found.entries)
        restored = found.restored  # the script's own checkpoint put back (stdout mode)
        directive, changes = self.watch.launch(attempt, remedy, found.resume,
                                               self.cadence.every_steps, self.cadence.memory_every,
                                               found.chain)
        for event, fields in changes:  # every change of the LR scale is on the record
            self._journal(event, **fields)
            self.console.log(f"babysit: {fields['summary']}")
        self.record.newest_step = 0
        self.watch.new_attempt(self.clock(), directive, restored)
        # A rerun replays the same batches: on the same nodes (a node that joined meanwhile
        # is taken at the first checkpoint after its verdict, ``incidents.node_joined``).
        fields = self.members.launch(attempt, directive, self.clock(),
                                     keep_nodes=self.watch.rerun is not None)
        self._launched = True
        if restored is not None:  # where the attempt really resumes: the script restores itself
            fields["script_resume"] = {"checkpoint_step": restored}
        self._journal("launch", directive=directive.to_json(), **fields)

    def _stop_workers(self, reason: str, replacing: bool = False) -> None:
        if not self._launched:
            return
        self._journal("stop_workers", reason=reason, pids=self.members.pids())
        code = self.members.stop(reason, replacing=replacing)
        self._print_output()
        self._journal("workers_stopped", exit_code=code)

    def _notify(self, action: sm.Notify) -> None:
        self.console.log(f"babysit: [{action.severity.name.lower()}] {action.title}")
        self._journal("alert", severity=action.severity.name.lower(), title=action.title)
        folder = str(self.judge.incident_dir) if self.judge.incident_dir else None
        self.services.notify(action, self.machine, folder)

    def _alert(self, severity: Severity, title: str) -> None:
        self._notify(sm.Notify(severity, title))

    def _finish(self, code: int) -> int:
        # Requeue or stop: what the scheduler that started this run acts on.
        code, verdict = exit_codes.on_finish(
            code, self.machine.state is sm.State.FAILED, self.machine.pending, self._newest(),
            self._requeued, functools.partial(run_dir.exclude_hosts, self.plan.run_dir))
        self._journal_all(self.cadence.closing())  # the whole run's figures: status, report
        # Nothing of the run outlives it: a warm standby waiting for an attempt that will never
        # come is stopped now, and said so before run_finished.
        self._journal_all(self.members.close(code))
        # This session's ledger, for status on a run too big to read it back (just before
        # run_finished, which stays the journal's last word).
        self._journal("goodput", **self.services.goodput().to_json())
        self._journal("run_finished", state=self.machine.state.value, exit_code=code,
                      reason=self.machine.reason, **verdict)
        self.services.finished(self.machine, code)
        return code

    def _members_missing(self, exc: MembersMissing) -> int:
        """Too few members for the run to go on (nodes that never joined or did not come
        back): it ends here, stopped if a signal asked for that, else failed."""
        ended = exc.ending(self.preemption.caught)  # asked to stop while waiting, or failed
        if self.preemption.caught is None:
            self._notify(sm.Notify(Severity.CRITICAL, f"run failed: {exc}"))
        self._journal("run_finished", **ended)
        return int(ended["exit_code"])

    # -- the record ------------------------------------------------------------------------------

    def _newest(self) -> int:
        return max(self.machine.step, self.record.newest_step)

    def _print_output(self) -> None:
        for line in self.members.output():
            self.console.log(line)

    def _summary(self, code: int) -> None:
        self.console.close()  # the status line gives way to the last line
        self.console.log(self.progress.summary(
            self.machine, self.clock() - self._started,
            self.machine.attempt - self._first_attempt + 1, self.services.goodput().summary(),
            str(self.record.journal.path), code))

