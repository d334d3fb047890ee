"""The supervisor's control loop: gather events, ask ``decide()``, perform the actions.

One thread does all of it, a tick at a time::

    sleep one tick (0.1 s)                the ranks' reports queue in their sockets
    telemetry -> steps -> metrics.jsonl   aggregate, and let the watch judge each step
    worker output -> console              tee'd rank lines
    has torchrun exited?                  Exited(code, remedy for a crash)
    periodic checks                       hang, backoff timers
    every event -> decide() -> actions    journaled as "old -> new (reason)"

The side effects live here and in the modules it calls (launcher, intake, journal, console); the
judgement lives in ``policies`` and is pure.
"""

from __future__ import annotations

import dataclasses
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
from babysit.policies.types import Action, Finding, Incident, JobStep, RankStep, Remedy, Severity
from babysit.supervisor.config.plan import RunPlan
from babysit.supervisor.contract import protocol
from babysit.supervisor.contract.directive import Directive, SkipRange
from babysit.supervisor.node import forensics, launcher
from babysit.supervisor.node.aggregate import StepAggregator, metrics_row
from babysit.supervisor.node.workers import NodeWorkers
from babysit.supervisor.run import journal as journal_mod
from babysit.supervisor.run.background import Services
from babysit.supervisor.run.cadence import (
    INTERRUPTING_ACTIONS,
    CadenceAdvisor,
    CadenceKeeper,
    replay_journal,
)
from babysit.supervisor.run.console import Console
from babysit.supervisor.run.progress import RunProgress
from babysit.supervisor.run.recovery import Recovery
from babysit.supervisor.run.watch import Watch
from babysit.supervisor.services.alerts import Alert, AlertDispatcher

TICK_S = 0.1
WATCH_STATE_EVERY = 100
"""Steps between journaled judgement states (a few KB each: the detectors' windows)."""


class Supervisor:
    """Runs one babysat job to its end. ``run()`` returns the process exit code.

    ``clock`` is the monotonic clock used for every timeout (injectable for tests); wall-clock
    times in the journal come from ``time.time()``.
    """

    def __init__(self, plan: RunPlan, console: Console,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.plan = plan
        self.console = console
        self.clock = clock
        self.machine = sm.Machine()
        self.watch = Watch.from_plan(plan)
        self._signal: int | None = None
        self._aggregator = StepAggregator(plan.world_size or 1)
        self._wake_at: float | None = None
        self._metrics: IO[str] | None = None
        self.progress = RunProgress()
        self._newest_step = 0
        """The newest step any rank reported this attempt, read before the loop's own count."""
        self._tick_at: float | None = None
        self._started = 0.0
        self._first_attempt = 0
        self._takeover: journal_mod.PriorRun | None = None
        self._inherited: Remedy | None = None
        self._last_checkpoint = -1
        self.crash_tails: dict[int, str] = {}
        """Log tails of failed ranks on other nodes, for the next incident folder."""
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
        self.workers = NodeWorkers(plan, plan.run_dir)

    # -- lifecycle ------------------------------------------------------------------------------

    def run(self) -> int:
        self._setup()
        try:
            return self._loop()
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
        self.workers.open()
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
            self.watch.lr_scale = float(prior.directive.get("lr_scale", 1.0))
        if prior.pending:
            finding = Finding.from_json(prior.pending["finding"])
            self._inherited = Remedy.from_json(prior.pending["remedy"], finding)
        else:  # the work since the last checkpoint is lost (a pending remedy counted already)
            self.cadence.advisor.on_interruption("supervisor_lost", time.time())
        self._journal("supervisor_takeover", previous_attempt=prior.last_attempt,
                      stopped_pids=stopped,
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
        """SIGTERM is what a scheduler sends before it reclaims the node: ask every rank for a
        checkpoint a few steps ahead (all ranks must save at the same step), and wait for it
        within ``checkpoints.final_grace_s`` while still reading telemetry."""
        grace = self.plan.config.checkpoints.final_grace_s
        if not (self.plan.config.checkpoints.every_steps and grace > 0 and self.workers.group):
            return
        # Ranks of a synchronous job are within a step of each other: 3 ahead of the newest
        # step any rank reported is ahead of all (the loop's own count lags a tick, and on a
        # multi-node leader the other nodes' summaries lag more; a rank already past the target
        # would never save, and the others would wait for it for the whole grace).
        target = max(self.machine.step, self._newest_step) + 3
        self._request(checkpoint_at_step=target)
        self._journal("final_checkpoint_requested", target_step=target, grace_s=grace)
        self.console.log(f"babysit: SIGTERM: asking for a final checkpoint at step {target} "
                         f"(waiting up to {grace:g} s)")
        deadline = self.clock() + grace
        while self.clock() < deadline and self._last_checkpoint < target:
            time.sleep(TICK_S)
            self._take_telemetry(deque())  # findings are moot now: the run is stopping
            self._print_output()
            if self.workers.poll() is not None:
                break
        saved = self._last_checkpoint >= target
        self._journal("final_checkpoint", saved=saved,
                      checkpoint_step=self._last_checkpoint if saved else None)

    def _teardown(self) -> None:
        self.workers.close()
        self.services.stop()
        self.alerts.close()
        if self._metrics is not None:
            self._metrics.close()
        self.journal.close()
        self.console.close()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signal = signum

    # -- the loop -------------------------------------------------------------------------------

    def _loop(self) -> int:
        pending: deque[sm.Event | Finding] = deque()
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

    def _gather(self, pending: deque[sm.Event | Finding]) -> None:
        """Turn everything that happened since the last tick into events, in a fixed order."""
        if self._signal is not None:
            if self._signal == signal.SIGTERM and self.machine.state is sm.State.RUNNING:
                self._final_checkpoint()
            pending.append(sm.StopRequested(self._signal))
            self._signal = None
        self._take_telemetry(pending)
        self._print_output()
        now = self.clock()
        if self.machine.state is sm.State.RUNNING and self._tick_at is not None:
            self.cadence.advisor.on_run_time(now - self._tick_at)
        self._tick_at = now
        if self.machine.state in (sm.State.STARTING, sm.State.RUNNING):
            self._check_workers(now, pending)
        if self._wake_at is not None and now >= self._wake_at:
            self._wake_at = None
            pending.append(sm.BackoffElapsed())
        self.services.publish(self.progress.snapshot(self.machine),
                              tuple(self.workers.rank_pids.values()))
        for (event, fields), line in self.services.drain():
            self._journal(event, **fields)
            if line:
                self.console.log(line)

    def _check_workers(self, now: float, pending: deque[sm.Event | Finding]) -> None:
        """Has torchrun exited? If not, is anything hung?"""
        code = self.workers.poll()
        if code is not None:
            self._take_telemetry(pending)
            if code and self._teardown_crash(code):
                code = 0
            pending.append(sm.Exited(code, self._crash_remedy(code) if code else None))
        elif self.workers.group is not None and \
                forensics.ranks_all_alive(self.workers.rank_pids.values()):
            # A rank whose process died is a crash in progress (torchrun reports it in a
            # moment), not a hang: its peers wait on a connection that is already gone.
            pending.extend(self.watch.check(now))

    def _apply(self, event: sm.Event, pending: deque[sm.Event | Finding]) -> int | None:
        old = self.machine
        new, actions = sm.decide(old, event)
        self.machine = new
        if new.state is not old.state:
            self._journal("state", old=old.state.value, new=new.state.value, reason=new.reason)
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
            self._stop_workers(action.reason)
            if self.machine.state is sm.State.INTERVENING:
                pending.append(sm.WorkersStopped())
        elif isinstance(action, sm.Wait):
            self._wake_at = self.clock() + action.seconds
            self._journal("backoff", seconds=action.seconds)
        elif isinstance(action, sm.Notify):
            self._notify(action)
        elif isinstance(action, sm.Finish):
            advice = self.cadence.advisor.advice()
            if advice is not None:  # the whole run's figures, for status and report
                self._journal("cadence_advice", summary=advice.summary(), final=True,
                              **advice.to_json())
            self._journal("run_finished", state=self.machine.state.value, exit_code=action.code,
                          reason=self.machine.reason)
            return action.code
        return None

    # -- telemetry ------------------------------------------------------------------------------

    def _take_telemetry(self, pending: deque[sm.Event | Finding]) -> None:
        newest = None
        for message in self.workers.intake.drain():
            if isinstance(message, RankStep):
                self._newest_step = max(self._newest_step, message.step)
                self._rank_step(message, pending)
                newest = max(newest or 0, message.step)
            else:
                self.workers.note(message)
                self._local_event(message, pending)
        if newest is not None:
            pending.append(sm.Progress(newest))
            self._journal_all(self.recovery.on_progress(newest))

    def _rank_step(self, sample: RankStep, pending: deque[sm.Event | Finding]) -> None:
        """One of this node's ranks reported a step."""
        self.watch.observe_rank(sample, self.clock())
        for record in self._aggregator.add(sample):
            self._record(record, metrics_row(record, self.machine.attempt), pending)

    def _local_event(self, event: protocol.WorkerEvent,
                     pending: deque[sm.Event | Finding]) -> None:
        """A rare message from one of this node's ranks."""
        self.watch.observe_event(event, self.clock())
        self._worker_event(event, pending)

    def _record(self, record: JobStep, row: dict[str, Any],
                pending: deque[sm.Event | Finding]) -> None:
        """A step of the whole job: its metrics row, progress, and the watch's judgement."""
        assert self._metrics is not None
        self._metrics.write(json.dumps(journal_mod.json_safe(row), separators=(",", ":")) + "\n")
        self._metrics.flush()
        self.progress.observe(record)
        if record.step_time is not None:
            self.cadence.advisor.on_step_time(record.step_time)
        self.services.observe_step(record)
        if self.machine.state not in (sm.State.STARTING, sm.State.RUNNING):
            return  # the workers are being replaced: their last steps judge nothing
        pending.extend(self.watch.observe_record(record))
        if record.step % WATCH_STATE_EVERY == 0:
            # So a supervisor taking over inherits the baselines, not only the last finding's.
            self._journal("watch_state", state=self.watch.state_dict())

    def _worker_event(self, event: protocol.WorkerEvent,
                      pending: deque[sm.Event | Finding]) -> None:
        """What a rank's event means for the run (any node's rank, in a multi-node run)."""
        if event.type == "hello":
            world = event.data.get("world_size")
            if isinstance(world, int) and world > 0:
                self._aggregator.world_size = world
            if event.rank == 0:  # MFU's inputs: the script's own numbers, or none at all
                self._aggregator.flops_per_token = _positive(event.data.get("flops_per_token"))
                self._aggregator.peak_flops = _positive(event.data.get("peak_flops"))
        if event.type in ("hello", "close", "skip"):
            self._journal(f"worker_{event.type}", rank=event.rank, data=event.data)
        elif event.type == "checkpoint":
            step = int(event.data.get("step", 0))
            self._last_checkpoint = max(self._last_checkpoint, step)
            self._journal("checkpoint_saved", step=step, rank=event.rank, data=event.data)
            self._journal_all(self.recovery.on_checkpoint(step))
            self._advise_cadence(event.data.get("blocking_s"), step)
        elif event.type == "cadence":
            self._journal("cadence_applied", rank=event.rank, data=event.data)
        elif event.type == "fingerprint":
            check = self.watch.observe_fingerprint(event, self._aggregator.world_size)
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
        """Ask the running ranks for something through the attempt's control file."""
        self.workers.control.request(**fields)

    def _diagnose(self, finding: Finding) -> tuple[Finding, forensics.Diagnosis | None]:
        """Dump this node's stacks for a hang, naming the rank stuck outside the collective."""
        if finding.incident is not Incident.HANG or not self.workers.rank_pids:
            return finding, None
        finding, diagnosis, fields = forensics.diagnose_hang(finding, self.workers.rank_pids)
        self._journal("hang_diagnosis", **fields)
        return finding, diagnosis

    def _judge(self, finding: Finding) -> Remedy:
        finding, diagnosis = self._diagnose(finding)
        crash_tails, self.crash_tails = self.crash_tails, {}
        # Wall-clock time: the rules' cooldowns and budget windows span hours and must survive
        # a supervisor restart, even across a reboot (the monotonic clock restarts at boot).
        remedy = self.watch.rules.on_finding(finding, time.time())
        self._incident_dir = None
        if remedy.action in (Action.ROLLBACK, Action.RELAUNCH, Action.STOP):
            # The alert's title says what babysit does; this line says what it saw.
            self.console.log(f"babysit: {finding.message}")
            tails = {**self.workers.tails(self.machine.attempt, 8192), **crash_tails}
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
        self._journal_all(self.recovery.on_finding(finding))
        return remedy

    def _teardown_crash(self, code: int) -> bool:
        """Only the process teardown crashed after every rank finished (``forensics.
        teardown_only``): relaunching would redo nothing; say so and succeed."""
        if not self.workers.teardown_only(code, self.machine.attempt):
            return False
        self._journal("teardown_crash", exit_code=code,
                      closed_ranks=sorted(self.workers.closed_ranks))
        self._notify(sm.Notify(Severity.WARNING, f"every rank finished and closed, then the "
                               f"process teardown crashed (torchrun exit {code}); counted as "
                               f"finished"))
        return True

    def _crash_remedy(self, code: int) -> Remedy:
        tails, root = self.workers.crash_evidence(self.machine.attempt)
        return self._judge(self.watch.classify_crash(code, tails, self.machine.step, root))

    # -- actions --------------------------------------------------------------------------------

    def _attempt_dir(self, attempt: int) -> Path:
        return self.workers.attempt_dir(attempt)

    def _launch(self, attempt: int, remedy: Remedy | None) -> None:
        if self._takeover is not None and attempt == self._first_attempt and remedy is None:
            resume, entries = self.recovery.resume_latest()
        else:
            resume, entries = self.recovery.resume_for(remedy)
        self._journal_all(entries)
        directive = self.watch.directive_for(attempt, remedy, resume)
        self._aggregator.reset()
        self._newest_step = 0
        self.watch.new_attempt(self.clock(), directive)
        fields = self._start_workers(attempt, directive)
        assert self.workers.group is not None
        self._journal("launch", pid=self.workers.group.pid, directive=directive.to_json(),
                      **fields)

    def _start_workers(self, attempt: int, directive: Directive) -> dict[str, Any]:
        """Start this attempt's torchrun; returns the launch entry's fields."""
        launch = self.plan.config.launch
        endpoint = launch.rdzv_endpoint or f"127.0.0.1:{launcher.free_port()}"
        command = self.workers.launch(attempt, directive, rdzv_endpoint=endpoint,
                                      rdzv_id=launch.rdzv_id or f"{self.plan.name}-{attempt}")
        return {"command": command, "rdzv_endpoint": endpoint}

    def _stop_workers(self, reason: str) -> None:
        if self.workers.group is None:
            return
        self._journal("stop_workers", reason=reason, pids=self.workers.pids())
        code = self.workers.stop()
        self._print_output()
        self._journal("workers_stopped", exit_code=code)

    def _notify(self, action: sm.Notify) -> None:
        self.console.log(f"babysit: [{action.severity.name.lower()}] {action.title}")
        self._journal("alert", severity=action.severity.name.lower(), title=action.title)
        m, remedy = self.machine, action.remedy
        if remedy is not None:
            folder = str(self._incident_dir) if self._incident_dir else None
            alert = Alert.from_finding(remedy.finding, run=self.plan.name, attempt=m.attempt,
                                       action=f"{remedy.action.value}: {remedy.reason}",
                                       incident_dir=folder)
            where = remedy.finding.evidence.get("host")
            title = action.title
            if where and str(where) not in title:  # a multi-node run: say which machine
                title += f" [node {remedy.finding.evidence.get('node')}, host {where}]"
            alert = dataclasses.replace(alert, title=title)
        else:
            alert = Alert(title=action.title, severity=action.severity, run=self.plan.name,
                          attempt=m.attempt, step=m.step or None)
        self.alerts.submit(alert)

    def _alert_result(self, record: dict[str, Any]) -> None:
        # Runs on an alert sender thread; the journal is thread-safe and records carry no URL.
        self._journal("alert_delivery", result=record)

    # -- console --------------------------------------------------------------------------------

    def _print_output(self) -> None:
        for line in self.workers.output():
            self.console.log(line)

    def _show_status(self) -> None:
        self.console.status(self.progress.status_line(self.machine))

    def _summary(self, code: int) -> None:
        m = self.machine
        line = self.progress.summary(m, self.clock() - self._started,
                                     m.attempt - self._first_attempt + 1)
        self.console.close()
        self.console.log(f"{line} Journal: {self.plan.run_dir / 'events.jsonl'}; exit code "
                         f"{code}.")

    def _journal_all(self, entries: list[tuple[str, dict[str, Any]]]) -> None:
        for event, fields in entries:
            self._journal(event, **fields)

    def _journal(self, event: str, /, step: int | None = None, **evidence: Any) -> None:
        self.journal.write(event, time.time(), self.machine.attempt,
                           step if step is not None else (self.machine.step or None), **evidence)


def _positive(value: Any) -> float | None:
    """A positive finite number from a rank's event, else None (never a guess, never a crash)."""
    number = journal_mod.finite(value)
    return number if number is not None and number > 0 else None
