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
(``StepLog.listen``). A SIGTERM's wait for a final checkpoint is ``preemption.FinalWait``; taking
over a dead supervisor's run is ``takeover.take_over``.
"""

from __future__ import annotations

import os
import signal
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from babysit.checkpoints import Catalog
from babysit.policies import decide as sm
from babysit.policies.types import Action, Finding, Incident, Remedy, Severity
from babysit.supervisor.config.plan import RunPlan
from babysit.supervisor.node import incident, launcher, standby
from babysit.supervisor.run import journal as journal_mod
from babysit.supervisor.run import preemption, run_dir, takeover
from babysit.supervisor.run.background import Services
from babysit.supervisor.run.cadence_live import LiveCadence
from babysit.supervisor.run.console import Console
from babysit.supervisor.run.members import (
    Gathered,
    JobEnd,
    LocalMembers,
    Members,
    MembersMissing,
    Voice,
)
from babysit.supervisor.run.progress import RunProgress
from babysit.supervisor.run.record import Record
from babysit.supervisor.run.recovery import Recovery
from babysit.supervisor.run.watch import Watch
from babysit.supervisor.services.alerts import AlertDispatcher

TICK_S = 0.1
WATCH_STATE_EVERY = 100
"""Steps between journaled judgement states (a few KB each: the detectors' windows)."""
DISRUPTIVE = (Action.ROLLBACK, Action.RELAUNCH, Action.STOP)
"""Remedies that end the workers: each gets an incident folder."""
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
                 members: Members | None = None) -> None:
        self.plan, self.console, self.clock = plan, console, clock
        self.machine = sm.Machine()
        self.watch = Watch.from_plan(plan, scope=members.scope if members else "all")
        self.members = members if members is not None else LocalMembers(plan, self.watch)
        c = plan.config.checkpoints
        self.recovery = Recovery(Catalog(plan.checkpoint_dir), c.probation_steps, c.keep,
                                 sdc_checks=plan.config.sdc.every_steps > 0)
        self.record = Record(plan.run_dir, self.watch, self.recovery, plan.world_size or 1,
                             where=lambda: self.machine,
                             warn=lambda title: self._alert(Severity.WARNING, title))
        self._journal, self._journal_all = self.record.write, self.record.write_all
        self.cadence = LiveCadence(c, journal=self._journal, log=console.log,
                                   request=self.members.request, newest_step=self._newest)
        self.alerts = AlertDispatcher.from_config(plan.config.alerts,
                                                  on_result=self._alert_result)
        self.services = Services(plan, self.alerts)
        self.progress = RunProgress()
        self._signal: int | None = None
        self.preemption = preemption.Preemption(
            c, self.recovery.catalog, journal=self._journal, log=console.log,
            warn=lambda title: self._alert(Severity.WARNING, title),
            request=self.members.request, newest_step=self._newest)
        self._launched = False
        self._exit_code: int | None = None
        self._wake_at: float | None = None
        self._started = 0.0
        self._first_attempt = 0
        self._takeover: takeover.Takeover | None = None
        self._incident_dir: Path | None = None

    # -- lifecycle ------------------------------------------------------------------------------

    def run(self) -> int:
        self._setup()
        try:
            self._exit_code = self._loop()
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
        self.machine = sm.Machine(attempt=self._first_attempt)
        restored = self.cadence.restore(previous)
        self._listen()
        self.record.open()
        self.members.open()
        self.alerts.start()
        launcher.become_subreaper()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        self._started = self.clock()
        self._journal("run_started", name=self.plan.name, run_dir=str(self.plan.run_dir),
                      source=self.plan.source, pid=os.getpid(), resumed_journal=bool(previous))
        self._journal_all(restored)
        self.console.log(f"babysit: run '{self.plan.name}' in {self.plan.run_dir}")
        prior = journal_mod.prior_run(previous)
        if prior is not None and prior.unfinished:
            self._takeover = takeover.take_over(prior, self.plan.run_dir,
                                                self.plan.config.launch.stop_grace_s, self.watch)
            self._journal("supervisor_takeover", **self._takeover.fields)
            self.console.log(self._takeover.describe())
        for event, fields in self.services.start():
            self._journal(event, **fields)
            self.console.log(f"babysit: {event.replace('_', ' ')}: {fields}")

    def _listen(self) -> None:
        """Who hears what happened, in the order they hear it."""
        journal, steps = self.record.journal, self.record.steps
        journal.listen(self.services.hear)
        journal.listen(self._recovery_hears, ("checkpoint_saved", "finding", "sdc_check"))
        journal.listen(self.cadence.hear, LiveCadence.EVENTS)
        journal.listen(self.progress.hear, ("finding",))
        journal.listen(self.preemption.hear, preemption.Preemption.EVENTS)
        steps.listen(lambda record, row: self.progress.observe(record))
        steps.listen(lambda record, row: self.cadence.observe_step(record))
        steps.listen(self.services.observe_step)

    def _teardown(self) -> None:
        for event, fields in self.members.close(self._exit_code):
            self._journal(event, **fields)
        self.services.stop(self.console.log)
        self.alerts.close()
        self.record.close()
        self.console.close()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signal = signum

    # -- the loop -------------------------------------------------------------------------------

    def _loop(self) -> int:
        self.members.ready(Voice(journal=self._journal, log=self.console.log,
                                 status=self.console.status, alert=self._alert,
                                 stopping=lambda: self._signal is not None))
        if self._takeover is not None and self._takeover.finished_unwatched is not None:
            return self._finish_unwatched(self._takeover.finished_unwatched)
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
        now, signum, self._signal = self.clock(), self._signal, None
        if signum is not None:  # SIGTERM: a final checkpoint first, when there can be one
            signum = self.preemption.signal(signum, now, self._launched and
                                            self.machine.state is sm.State.RUNNING)
        waiting = self.preemption.waiting
        watching = not waiting and self.machine.state in (sm.State.STARTING, sm.State.RUNNING)
        got = self._take(self.members.gather(now, watching))
        if waiting:  # findings and exits are moot now: the run is stopping
            got, signum = [], self.preemption.tick(now, self.members.running())
        items: list[Item] = [sm.StopRequested(signum)] if signum is not None else []
        items += got
        if self._wake_at is not None and now >= self._wake_at:
            self._wake_at = None
            items.append(sm.BackoffElapsed())
        self.services.publish(self.progress.snapshot(self.machine), self.members.rank_pids())
        for (event, fields), line in self.services.drain():
            self._journal(event, **fields)
            if line:
                self.console.log(line)
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
                    self._journal("finding_set_aside", step=item.step, finding=item.to_json(),
                                  state=self.machine.state.value)
                    continue
                item = sm.Remedied(self._judge(item))
            old = self.machine
            self.machine, actions = sm.decide(old, item)
            if self.machine.state is not old.state:
                new = self.machine
                self._journal("state", old=old.state.value, new=new.state.value,
                              reason=new.reason)
                self.console.log(f"babysit: {old.state.value} -> {new.state.value} "
                                 f"({new.reason})")
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

    # -- judging -------------------------------------------------------------------------------

    def _take(self, got: Gathered) -> list[Item]:
        """Record what the members saw (``Record.take``), print the ranks' output, and judge
        the attempt's end; what is left to decide, in order."""
        judging = self.machine.state in (sm.State.STARTING, sm.State.RUNNING)
        items: list[Item] = [*self.record.take(got, judging)]
        self._print_output()
        if got.end is not None:
            items.append(self._ended(got.end))
        return items

    def _ended(self, end: JobEnd) -> sm.Exited:
        """The attempt's workers ended: a crash is classified (most specific verdict first),
        located and judged."""
        if end.code == 0:
            return sm.Exited(0)
        finding = self.watch.classify_crash(end.code, end.tails, self.machine.step, end.root,
                                            end.exits)
        return sm.Exited(end.code, self._judge(self.members.locate(finding)))

    def _judge(self, finding: Finding) -> Remedy:
        """The policy's remedy for ``finding``; evidence for a disruptive one. Journaled as a
        ``finding`` entry, which the services, cadence, recovery and progress hear."""
        # Wall-clock time: the rules' cooldowns and budget windows span hours and must survive
        # a supervisor restart, even across a reboot (the monotonic clock restarts at boot).
        can = self.members.can_roll_back(finding, self.recovery.can_roll_back(finding))
        remedy = self.members.shape_remedy(self.watch.remedy(finding, time.time(), can))
        self._incident_dir = None
        if remedy.action in DISRUPTIVE:
            # The alert's title says what babysit does; this line says what it saw.
            self.console.log(f"babysit: {finding.message}")
            diagnosis = self.members.diagnosis(finding) \
                if finding.incident is Incident.HANG else None
            self._incident_dir = incident.write_incident(
                self.plan.run_dir, self.machine.attempt, finding, remedy, diagnosis,
                self.members.tails(self.machine.attempt))
            self._journal("incident", step=finding.step, dir=str(self._incident_dir),
                          incident=finding.incident.value, ranks=list(finding.ranks))
        self._journal("finding", step=finding.step, finding=finding.to_json(),
                      remedy=remedy.to_json())
        self._journal("watch_state", state=self.watch.state_dict())
        return remedy

    # -- actions --------------------------------------------------------------------------------

    def _launch(self, attempt: int, remedy: Remedy | None) -> None:
        if self._takeover is not None and attempt == self._first_attempt and remedy is None:
            resume, entries = self.recovery.resume_latest(self._takeover.prior.last_step)
        else:
            resume, entries = self.recovery.resume_for(remedy)
        self._journal_all(entries)
        self._journal_all(self.members.prepare(remedy, attempt))
        self.watch.checkpoint_every = self.cadence.every_steps
        directive = self.watch.directive_for(attempt, remedy, resume)
        if self.watch.lr_change is not None:  # every change of the LR scale is on the record
            self._journal("lr_scale", **self.watch.lr_change)
            self.console.log(f"babysit: {self.watch.lr_change['summary']}")
        self.record.newest_step = 0
        self.watch.new_attempt(self.clock(), directive)
        fields = self.members.launch(attempt, directive, self.clock())
        first, self._launched = not self._launched, True
        self._journal("launch", directive=directive.to_json(), **fields)
        off = fields.get("standby_off")
        if first and off and off != standby.CONFIGURED_OFF:  # the user's own choice needs no word
            self.console.log(f"babysit: relaunches will start cold: {off}")

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
        folder = str(self._incident_dir) if self._incident_dir else None
        self.services.notify(action, self.machine, folder)

    def _alert(self, severity: Severity, title: str) -> None:
        self._notify(sm.Notify(severity, title))

    def _finish(self, code: int) -> int:
        self._journal_all(self.cadence.closing())  # the whole run's figures: status, report
        # Nothing of the run outlives it: a warm standby waiting for an attempt that will never
        # come is stopped now, and said so before run_finished.
        self._journal_all(self.members.close(code))
        # This session's ledger, for status on a run too big to read it back (just before
        # run_finished, which stays the journal's last word).
        self._journal("goodput", **self.services.goodput().to_json())
        self._journal("run_finished", state=self.machine.state.value, exit_code=code,
                      reason=self.machine.reason)
        self.services.finished(self.machine, code)
        return code

    # -- ends without a decision ------------------------------------------------------------------

    def _finish_unwatched(self, step: int) -> int:
        """The job finished while no supervisor watched (``takeover.finished_unwatched``)."""
        reason = (f"every rank of attempt {self.machine.attempt - 1} closed its run at step "
                  f"{step} while no supervisor watched; nothing left to train")
        self._journal("run_finished", step=step, state="succeeded", exit_code=0, reason=reason)
        self.console.log(f"babysit: {reason}")
        return 0

    def _members_missing(self, exc: MembersMissing) -> int:
        """Too few members for the run to go on (nodes that never joined or did not come
        back): it ends here, stopped if a signal asked for that, else failed."""
        if self._signal is not None:  # asked to stop while waiting for them
            code, state, reason = 128 + self._signal, "stopped", f"signal {self._signal}"
        else:
            code, state, reason = 1, "failed", str(exc)
            self._notify(sm.Notify(Severity.CRITICAL, f"run failed: {exc}"))
        self._journal("run_finished", state=state, exit_code=code, reason=reason)
        return code

    # -- the record ------------------------------------------------------------------------------

    def _recovery_hears(self, entry: dict[str, Any]) -> None:
        event = entry["event"]
        if event == "checkpoint_saved":
            self._journal_all(self.recovery.on_checkpoint(int(entry["step"])))
        elif event == "finding":
            finding = Finding.from_json(entry["finding"])
            self._journal_all(self.recovery.on_finding(
                finding, Remedy.from_json(entry["remedy"], finding)))
        elif event == "sdc_check":
            self.recovery.vouch(entry.get("last_agreeing_step"))

    def _newest(self) -> int:
        return max(self.machine.step, self.record.newest_step)

    def _print_output(self) -> None:
        for line in self.members.output():
            self.console.log(line)

    def _summary(self, code: int) -> None:
        m = self.machine
        line = self.progress.summary(m, self.clock() - self._started,
                                     m.attempt - self._first_attempt + 1)
        self.console.close()
        goodput = self.services.goodput().summary()
        self.console.log(f"{line} {goodput[:1].upper()}{goodput[1:]}. Journal: "
                         f"{self.plan.run_dir / 'events.jsonl'}; exit code {code}.")

    def _alert_result(self, record: dict[str, Any]) -> None:
        # Runs on an alert sender thread; the journal is thread-safe and records carry no URL.
        self._journal("alert_delivery", result=record)
