"""The supervisor's control loop: gather events, ask ``decide()``, perform the actions.

One thread does all of it, a tick at a time::

    sleep one tick (0.1 s)                the ranks' reports queue in their sockets
    members.gather()                      the job's steps, rank events, findings only a node
                                          can make (a hang named from its stacks), the end
    steps -> metrics.jsonl                and the watch judges each step
    worker output -> console              tee'd rank lines
    timers                                backoff
    every event -> decide() -> actions    journaled as "old -> new (reason)"

Who trains is the ``members`` (``run.members``): this node's workers, or on a multi-node leader
every node's (``cluster.leader.ClusterMembers``); the loop is the same. The side effects live
here and in the members; the judgement lives in ``Watch`` and ``policies``, and is pure.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import IO, Any

import yaml

from babysit.checkpoints import Catalog
from babysit.policies import decide as sm
from babysit.policies.types import Action, Finding, Incident, JobStep, Remedy, Severity
from babysit.supervisor.config.plan import RunPlan
from babysit.supervisor.contract.directive import SkipRange
from babysit.supervisor.contract.protocol import WorkerEvent
from babysit.supervisor.node import forensics, launcher, standby
from babysit.supervisor.run import journal as journal_mod
from babysit.supervisor.run import preemption, stdout_mode, takeover
from babysit.supervisor.run.background import Services
from babysit.supervisor.run.cadence import (
    INTERRUPTING_ACTIONS,
    CadenceAdvisor,
    CadenceKeeper,
    replay_journal,
)
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
from babysit.supervisor.run.recovery import Recovery
from babysit.supervisor.run.watch import Watch
from babysit.supervisor.services.alerts import AlertDispatcher

TICK_S = 0.1
WATCH_STATE_EVERY = 100
"""Steps between journaled judgement states (a few KB each: the detectors' windows)."""


class Supervisor:
    """Runs one babysat job to its end. ``run()`` returns the process exit code.

    ``clock`` is the monotonic clock used for every timeout (injectable for tests); wall-clock
    times in the journal come from ``time.time()``.
    """

    def __init__(self, plan: RunPlan, console: Console,
                 clock: Callable[[], float] = time.monotonic,
                 members: Members | None = None) -> None:
        """``members``: who trains; this node's workers (``LocalMembers``) when None."""
        self.plan = plan
        self.console = console
        self.clock = clock
        self.machine = sm.Machine()
        if members is None:
            self.watch = Watch.from_plan(plan)
            members = LocalMembers(plan, self.watch)
        else:
            self.watch = Watch.from_plan(plan, scope=members.scope)
        self.members = members
        self._signal: int | None = None
        self._world = plan.world_size or 1
        """The job's ranks, from the hellos (an SDC check waits for every rank's digests)."""
        self._launched = False
        self._exit_code: int | None = None
        self._wake_at: float | None = None
        self._metrics: IO[str] | None = None
        self.progress = RunProgress()
        self._newest_step = 0
        """The newest step any rank reported this attempt, read before the loop's own count."""
        self._tick_at: float | None = None
        self._started = 0.0
        self._first_attempt = 0
        self._takeover: journal_mod.PriorRun | None = None
        self._finished_unwatched: int | None = None
        """The step the job finished at while no supervisor watched (found on a takeover)."""
        self._inherited: Remedy | None = None
        self._last_checkpoint = -1
        self._final_saved: int | None = None
        self._incident_dir: Path | None = None
        c = plan.config.checkpoints
        self.recovery = Recovery(Catalog(plan.checkpoint_dir), c.probation_steps, c.keep,
                                 sdc_checks=plan.config.sdc.every_steps > 0)
        self.cadence = CadenceKeeper(CadenceAdvisor(c.every_steps, c.cadence.mtbf_prior_s),
                                     c.cadence.auto, c.cadence.min_steps, c.cadence.max_steps)
        self.journal = journal_mod.Journal(plan.run_dir / "events.jsonl")
        self.alerts = AlertDispatcher.from_config(plan.config.alerts,
                                                  on_result=self._alert_result)
        self.services = Services(plan, self.alerts)

    # -- lifecycle ------------------------------------------------------------------------------

    def run(self) -> int:
        self._setup()
        try:
            self._exit_code = self._loop()
            return self._exit_code
        except MembersMissing as exc:
            self._exit_code = self._members_missing(exc)
            return self._exit_code
        except BaseException as exc:
            # A bug in babysit itself: leave a trace in the journal; teardown stops the workers.
            self._journal("supervisor_error", error=f"{type(exc).__name__}: {exc}")
            raise
        finally:
            self._teardown()

    def _setup(self) -> None:
        run_dir = self.plan.run_dir
        previous = list(journal_mod.read(run_dir / "events.jsonl"))
        run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(run_dir, 0o700)  # the telemetry socket's first line of defence
        (run_dir / "attempts").mkdir(exist_ok=True)
        (run_dir / "config.yaml").write_text(
            yaml.safe_dump(self.plan.config.model_dump(mode="json", exclude={"nodes": {"secret"}}),
                           sort_keys=False))
        self._first_attempt = 1 + max((e.get("attempt", -1) for e in previous), default=-1)
        self._restore_cadence(previous)
        prior = journal_mod.prior_run(previous)
        self._takeover = prior if prior is not None and prior.unfinished else None
        self.machine = sm.Machine(attempt=self._first_attempt)
        self.journal.open()
        self.members.open()
        self._metrics = open(run_dir / "metrics.jsonl", "a", encoding="utf-8")  # noqa: SIM115
        self.alerts.start()
        launcher.become_subreaper()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        self._started = self.clock()
        self._journal("run_started", name=self.plan.name, run_dir=str(run_dir),
                      source=self.plan.source, pid=os.getpid(),
                      resumed_journal=bool(previous))
        self.console.log(f"babysit: run '{self.plan.name}' in {run_dir}")
        if self._takeover is not None:
            self._take_over(self._takeover)
        for event, fields in self.services.start():
            self._journal(event, **fields)
            self.console.log(f"babysit: {event.replace('_', ' ')}: {fields}")

    def _take_over(self, prior: journal_mod.PriorRun) -> None:
        """The previous supervisor of this run died without finishing it: stop what it left
        running, keep what it had decided (skips, LR scale), resume from its checkpoints."""
        stopped = launcher.stop_leftovers(prior.pids, self.plan.run_dir,
                                          self.plan.config.launch.stop_grace_s)
        if prior.watch_state:
            self.watch.load_state_dict(prior.watch_state)
        if prior.directive:  # the skips and LR scale the last attempt actually ran with
            self.watch.skips = [SkipRange(int(r["start"]), int(r["end"]))
                                for r in prior.directive.get("skip", ())]
            self.watch.adopt_lr(prior.directive)
        if prior.pending:
            finding = Finding.from_json(prior.pending["finding"])
            self._inherited = Remedy.from_json(prior.pending["remedy"], finding)
        else:  # the work since the last checkpoint is lost (a pending remedy counted already)
            self.cadence.advisor.on_interruption("supervisor_lost", time.time())
        self._finished_unwatched = takeover.finished_unwatched(
            self.plan.run_dir / "attempts" / str(prior.last_attempt))
        self._journal("supervisor_takeover", previous_attempt=prior.last_attempt,
                      stopped_pids=stopped, watched_until_step=prior.last_step,
                      finished_unwatched=self._finished_unwatched,
                      inherited_remedy=self._inherited.to_json() if self._inherited else None,
                      skip=[{"start": r.start, "end": r.end} for r in self.watch.skips],
                      lr_scale=self.watch.lr_scale)
        self.console.log(f"babysit: taking over an unfinished run (attempt {prior.last_attempt}"
                         f"); stopped {len(stopped)} leftover process(es)")

    def _restore_cadence(self, previous: list[dict[str, Any]]) -> None:
        """Earlier runs in this directory: their interruptions, checkpoint costs and running
        time count, and an interval auto-adoption chose stays in force."""
        if not previous:
            return
        replay_journal(self.cadence.advisor, previous)
        c = self.plan.config.checkpoints
        adopted = [e for e in previous if e.get("event") == "cadence_adopted"]
        # Only when the config still says what the adoptions started from: a changed
        # every_steps (0 in particular: the script saves itself) is the user's word.
        if not (adopted and c.cadence.auto and c.every_steps > 0
                and adopted[0].get("old_every") == c.every_steps):
            return
        every = adopted[-1].get("new_every")
        if isinstance(every, int) and every > 0:
            every = min(max(every, c.cadence.min_steps), c.cadence.max_steps)
            self.cadence.advisor.every_steps = self.watch.checkpoint_every = every
            self._journal("cadence_restored", every_steps=every,
                          reason="checkpoints.cadence.auto adopted it before babysit restarted")

    def _final_checkpoint(self) -> None:
        """SIGTERM is what a scheduler sends before it reclaims the node: ask the ranks for a
        checkpoint at the next step boundary they can all reach (they agree on the step among
        themselves: ``rank.saving``; the loop's own count lags them), and wait for it within
        ``checkpoints.final_grace_s`` while still reading telemetry. Without one, say so
        everywhere, naming the checkpoint the next run resumes from (``preemption``)."""
        c = self.plan.config.checkpoints
        if not self._launched:
            return
        if not (c.every_steps and c.final_grace_s > 0):
            self._no_final_checkpoint("checkpoints.every_steps is 0: babysit does not save "
                                      "this run" if not c.every_steps
                                      else "checkpoints.final_grace_s is 0")
            return
        grace = c.final_grace_s
        self._final_saved = None
        self._request(final_checkpoint=preemption.request_id())
        self._journal("final_checkpoint_requested", grace_s=grace,
                      newest_step=max(self.machine.step, self._newest_step))
        self.console.log(f"babysit: SIGTERM: asking for a final checkpoint at the next step "
                         f"every rank reaches (waiting up to {grace:g} s)")
        deadline = self.clock() + grace
        while self.clock() < deadline and self._final_saved is None:
            time.sleep(TICK_S)
            # Findings and exits are moot now: the run is stopping.
            self._take(self.members.gather(self.clock(), watching=False), deque())
            self._print_output()
            if not self.members.running():
                break
        saved = self._final_saved
        self._journal("final_checkpoint", saved=saved is not None, checkpoint_step=saved)
        if saved is not None:
            self.console.log(f"babysit: final checkpoint saved at step {saved}")
        else:
            self._no_final_checkpoint(
                f"none arrived within checkpoints.final_grace_s = {grace:g} s"
                if self.members.running() else "the workers exited first")

    def _no_final_checkpoint(self, why: str) -> None:
        resume = preemption.fallback(self.recovery.catalog)
        self._journal("final_checkpoint_missing", reason=why, resume_step=resume.step,
                      resume_path=resume.path)
        self._notify(sm.Notify(Severity.WARNING, preemption.missing_message(why, resume)))

    def _teardown(self) -> None:
        for event, fields in self.members.close(self._exit_code):
            self._journal(event, **fields)
        self.services.stop(self.console.log)
        self.alerts.close()
        if self._metrics is not None:
            self._metrics.close()
        self.journal.close()
        self.console.close()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signal = signum

    # -- the loop -------------------------------------------------------------------------------

    def _loop(self) -> int:
        self.members.ready(Voice(journal=self._journal, log=self.console.log,
                                 status=self.console.status, alert=self._alert,
                                 stopping=lambda: self._signal is not None))
        pending: deque[sm.Event | Finding] = deque()
        if self._finished_unwatched is not None:  # nothing to retrain: say so and end
            return self._finish_unwatched(self._finished_unwatched)
        # A remedy the previous supervisor decided but died before launching is applied now.
        exit_code = self._perform(sm.Launch(self.machine.attempt, self._inherited), pending)
        while exit_code is None:
            # Sleep, never wait on the telemetry socket: a waiting reader makes every rank's
            # report pay for waking it (see babysit.supervisor.node.intake).
            time.sleep(TICK_S)
            self._gather(pending)
            while pending and exit_code is None:
                item = pending.popleft()
                if isinstance(item, Finding):
                    # Judged only now: once an earlier finding of this tick started a remedy,
                    # later ones are about workers being replaced and must not use up the ladder.
                    if self.machine.state not in (sm.State.STARTING, sm.State.RUNNING):
                        self._journal("finding_set_aside", step=item.step,
                                      finding=item.to_json(), state=self.machine.state.value)
                        continue
                    item = sm.Remedied(self._judge(item))
                exit_code = self._apply(item, pending)
            self._show_status()
        self._summary(exit_code)
        return exit_code

    def _finish_unwatched(self, step: int) -> int:
        """The job finished while no supervisor watched (``takeover.finished_unwatched``)."""
        reason = (f"every rank of attempt {self.machine.attempt - 1} closed its run at step "
                  f"{step} while no supervisor watched; nothing left to train")
        self._journal("run_finished", step=step, state="succeeded", exit_code=0, reason=reason)
        self.console.log(f"babysit: {reason}")
        return 0

    def _gather(self, pending: deque[sm.Event | Finding]) -> None:
        """Turn everything that happened since the last tick into events, in a fixed order."""
        if self._signal is not None:
            if self._signal == signal.SIGTERM and self.machine.state is sm.State.RUNNING:
                self._final_checkpoint()
            pending.append(sm.StopRequested(self._signal))
            self._signal = None
        now = self.clock()
        watching = self.machine.state in (sm.State.STARTING, sm.State.RUNNING)
        self._take(self.members.gather(now, watching), pending)
        self._print_output()
        if self.machine.state is sm.State.RUNNING and self._tick_at is not None:
            self.cadence.advisor.on_run_time(now - self._tick_at)
        self._tick_at = now
        if self._wake_at is not None and now >= self._wake_at:
            self._wake_at = None
            pending.append(sm.BackoffElapsed())
        self.services.publish(self.progress.snapshot(self.machine), self.members.rank_pids())
        for (event, fields), line in self.services.drain():
            self._journal(event, **fields)
            if line:
                self.console.log(line)

    def _apply(self, event: sm.Event, pending: deque[sm.Event | Finding]) -> int | None:
        old = self.machine
        new, actions = sm.decide(old, event)
        self.machine = new
        if new.state is not old.state:
            self._journal("state", old=old.state.value, new=new.state.value, reason=new.reason)
            self.services.transition(old.state, new.state)
            self.console.log(f"babysit: {old.state.value} -> {new.state.value} ({new.reason})")
        for action in actions:
            code = self._perform(action, pending)
            if code is not None:
                return code
        return None

    def _perform(self, action: sm.ActionT, pending: deque[sm.Event | Finding]) -> int | None:
        if isinstance(action, sm.Launch):
            self._launch(action.attempt, action.remedy)
        elif isinstance(action, sm.StopWorkers):
            # INTERVENING: stopped to be replaced (a remedy), not because the run ends.
            replacing = self.machine.state is sm.State.INTERVENING
            self._stop_workers(action.reason, replacing)
            if replacing:
                # What the stopped ranks sent last (a checkpoint they finished) counts before
                # the relaunch, in this tick, chooses where to resume.
                self._take(self.members.gather(self.clock(), watching=False), pending)
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
            advice = self.cadence.advisor.advice()
            if advice is not None:  # the whole run's figures, for status and report
                self._journal("cadence_advice", summary=advice.summary(), final=True,
                              **advice.to_json())
            # Nothing of the run outlives it: a warm standby waiting for an attempt that will
            # never come is stopped now, and said so before run_finished.
            for event, fields in self.members.close(action.code):
                self._journal(event, **fields)
            # This session's ledger, for status on a run too big to read it back (just before
            # run_finished, which stays the journal's last word).
            self._journal("goodput", **self.services.goodput().to_json())
            self._journal("run_finished", state=self.machine.state.value, exit_code=action.code,
                          reason=self.machine.reason)
            self.services.finished(self.machine, action.code)
            return action.code
        return None

    # -- telemetry ------------------------------------------------------------------------------

    def _take(self, got: Gathered, pending: deque[sm.Event | Finding]) -> None:
        """What the members saw this tick, in a fixed order: their own journal entries, the
        job's steps (each judged), the ranks' events, progress, node findings, the end."""
        self._journal_all(got.entries)
        for title in got.warnings:
            self._notify(sm.Notify(Severity.WARNING, title))
        if got.newest is not None:
            self._newest_step = max(self._newest_step, got.newest)
        for record, row in got.steps:
            self._record(record, row, pending)
        for event in got.events:
            self._worker_event(event, pending)
        if got.steps:
            newest = got.steps[-1][0].step
            pending.append(sm.Progress(newest))
            self._journal_all(self.recovery.on_progress(newest))
        pending.extend(got.findings)
        if got.end is not None:
            pending.append(self._ended(got.end))

    def _record(self, record: JobStep, row: dict[str, Any],
                pending: deque[sm.Event | Finding]) -> None:
        """A step of the whole job: its metrics row, progress, and the watch's judgement."""
        assert self._metrics is not None
        self._metrics.write(json.dumps(journal_mod.json_safe(row), separators=(",", ":")) + "\n")
        self._metrics.flush()
        self.progress.observe(record)
        if record.step_time is not None:
            self.cadence.advisor.on_step_time(record.step_time)
        self.services.observe_step(record, row)
        if self.machine.state not in (sm.State.STARTING, sm.State.RUNNING):
            return  # the workers are being replaced: their last steps judge nothing
        pending.extend(self.watch.observe_record(record))
        if record.step % WATCH_STATE_EVERY == 0:
            # So a supervisor taking over inherits the baselines, not only the last finding's.
            self._journal("watch_state", state=self.watch.state_dict())

    def _worker_event(self, event: WorkerEvent, pending: deque[sm.Event | Finding]) -> None:
        """What a rank's event means for the run (any node's rank, in a multi-node run)."""
        if event.type == "hello":
            world = event.data.get("world_size")
            if isinstance(world, int) and world > 0:
                self._world = world
        if event.type in ("hello", "close", "skip", "scalars"):
            self._journal(f"worker_{event.type}", rank=event.rank, data=event.data)
        elif event.type == "checkpoint":
            step = int(event.data.get("step", 0))
            self._last_checkpoint = max(self._last_checkpoint, step)
            if event.data.get("final"):
                self._final_saved = step
            self._journal("checkpoint_saved", step=step, rank=event.rank, data=event.data)
            self._journal_all(self.recovery.on_checkpoint(step))
            self._advise_cadence(event.data.get("blocking_s"), step)
        elif event.type == "cadence":
            self._journal("cadence_applied", rank=event.rank, data=event.data)
        elif event.type == "fingerprint":
            check = self.watch.observe_fingerprint(event, self._world)
            if check is not None:
                self.recovery.vouch(check.last_agreeing_step)
                self._journal("sdc_check", step=check.step, agree=check.agree, ranks=check.ranks,
                              repeat=not check.agree and check.finding is None,
                              last_agreeing_step=check.last_agreeing_step,
                              disagreeing=list(check.finding.ranks) if check.finding else [],
                              digests=check.finding.evidence.get("digests")
                              if check.finding else None)
                if check.finding is not None:
                    pending.append(check.finding)
        elif event.type == "checkpoint_failed":
            step = int(event.data.get("step", 0))
            error = str(event.data.get("error", ""))
            self._journal("checkpoint_failed", step=step, error=error)
            self._notify(sm.Notify(Severity.WARNING, f"checkpoint at step {step} failed to "
                                   f"save; training goes on from the last good one: {error}"))

    def _advise_cadence(self, blocking_s: Any, step: int) -> None:
        """A checkpoint was saved at ``step``: update the cadence advice, and adopt it when
        ``auto``. A switch must start ahead of every rank, so it counts from the newest step
        seen anywhere (the loop's own count lags a tick behind the reports)."""
        self.cadence.advisor.on_checkpoint(blocking_s)  # it ignores anything but a cost
        newest = max(self.machine.step, step, self._newest_step)
        advice, adoption = self.cadence.after_checkpoint(newest)
        if advice is not None:
            self._journal("cadence_advice", summary=advice.summary(), **advice.to_json())
            self.console.log(f"babysit: cadence: {advice.summary()}")
        if adoption is not None:
            old = self.watch.checkpoint_every
            self.watch.checkpoint_every = adoption.every_steps  # and for the next attempts
            self._request(checkpoint_every=adoption.every_steps, from_step=adoption.from_step)
            self._journal("cadence_adopted", old_every=old, new_every=adoption.every_steps,
                          from_step=adoption.from_step,
                          reason="checkpoints.cadence.auto: the advised interval is outside "
                                 "the 20% band around the one in force")
            self.console.log(f"babysit: cadence: checkpointing every {adoption.every_steps} "
                             f"steps from step {adoption.from_step} (was {old})")

    def _request(self, **fields: Any) -> None:
        """Ask the running ranks for something through the attempt's control file(s)."""
        self.members.request(**fields)

    def _judge(self, finding: Finding) -> Remedy:
        diagnosis = self.members.diagnosis(finding) if finding.incident is Incident.HANG \
            else None
        # Wall-clock time: the rules' cooldowns and budget windows span hours and must survive
        # a supervisor restart, even across a reboot (the monotonic clock restarts at boot).
        can = stdout_mode.can_roll_back(self.members, finding,
                                        self.recovery.can_roll_back(finding))
        remedy = stdout_mode.remedy(self.members, self.watch.remedy(finding, time.time(), can))
        self._incident_dir = None
        if remedy.action in (Action.ROLLBACK, Action.RELAUNCH, Action.STOP):
            # The alert's title says what babysit does; this line says what it saw.
            self.console.log(f"babysit: {finding.message}")
            tails = self.members.tails(self.machine.attempt)
            self._incident_dir = forensics.write_incident(
                self.plan.run_dir, self.machine.attempt, finding, remedy, diagnosis, tails)
            self._journal("incident", step=finding.step, dir=str(self._incident_dir),
                          incident=finding.incident.value, ranks=list(finding.ranks))
        if remedy.action is not Action.IGNORE:
            self.progress.intervened(finding)
            self.services.count(finding, remedy)
        if remedy.action.value in INTERRUPTING_ACTIONS:
            self.cadence.advisor.on_interruption(finding.incident.value, time.time())
        self._journal("finding", step=finding.step, finding=finding.to_json(),
                      remedy=remedy.to_json())
        self._journal("watch_state", state=self.watch.state_dict())
        self._journal_all(self.recovery.on_finding(finding, remedy))
        return remedy

    def _ended(self, end: JobEnd) -> sm.Exited:
        """The attempt's workers ended: a crash is classified (most specific verdict first),
        located and judged."""
        if end.code == 0:
            return sm.Exited(0)
        finding = self.watch.classify_crash(end.code, end.tails, self.machine.step, end.root,
                                            end.exits)
        return sm.Exited(end.code, self._judge(self.members.locate(finding)))

    # -- actions --------------------------------------------------------------------------------

    def _launch(self, attempt: int, remedy: Remedy | None) -> None:
        if self._takeover is not None and attempt == self._first_attempt and remedy is None:
            resume, entries = self.recovery.resume_latest(self._takeover.last_step)
        else:
            resume, entries = self.recovery.resume_for(remedy)
        self._journal_all(entries)
        self._journal_all(stdout_mode.restore(self.members, remedy, attempt))
        directive = self.watch.directive_for(attempt, remedy, resume)
        if self.watch.lr_change is not None:  # every change of the LR scale is on the record
            self._journal("lr_scale", **self.watch.lr_change)
            self.console.log(f"babysit: {self.watch.lr_change['summary']}")
        self.services.launched(directive)
        self._newest_step = 0
        self.watch.new_attempt(self.clock(), directive)
        fields = self.members.launch(attempt, directive, self.clock())
        first = not self._launched
        self._launched = True
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

    def _alert_result(self, record: dict[str, Any]) -> None:
        # Runs on an alert sender thread; the journal is thread-safe and records carry no URL.
        self._journal("alert_delivery", result=record)

    # -- console --------------------------------------------------------------------------------

    def _print_output(self) -> None:
        for line in self.members.output():
            self.console.log(line)

    def _show_status(self) -> None:
        self.console.status(self.progress.status_line(self.machine))

    def _summary(self, code: int) -> None:
        m = self.machine
        line = self.progress.summary(m, self.clock() - self._started,
                                     m.attempt - self._first_attempt + 1)
        self.console.close()
        goodput = self.services.goodput().summary()
        self.console.log(f"{line} {goodput[:1].upper()}{goodput[1:]}. Journal: "
                         f"{self.plan.run_dir / 'events.jsonl'}; exit code {code}.")

    def _journal_all(self, entries: list[tuple[str, dict[str, Any]]]) -> None:
        self.services.entries(entries)
        for event, fields in entries:
            self._journal(event, **fields)

    def _journal(self, event: str, /, step: int | None = None, **evidence: Any) -> None:
        self.services.journaled(self.journal.write(
            event, time.time(), self.machine.attempt,
            step if step is not None else (self.machine.step or None), **evidence))

