"""The loop's background helpers: scheduled jobs, the opt-in Prometheus endpoint and the
dashboards (TensorBoard, W&B: ``babysit.supervisor.services.dashboards``, each on its own thread).

The jobs (health sampling, the periodic digest) run on apscheduler's threads and never touch the
loop's state: the loop *publishes* an immutable snapshot each tick and *drains* their messages
on its own thread, turning each into journal entries, console lines and alerts.

Checkpoint retention is not one of the scheduled jobs: it runs on the loop thread each time a
checkpoint is committed (``babysit.supervisor.run.recovery``), because the catalog's verdict
file has one writer, and retention right after a save keeps the disk bounded without a timer.
"""

from __future__ import annotations

import logging
import queue
import signal
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import Any

from babysit.policies import decide as sm
from babysit.policies.types import Action, Finding, JobStep, Remedy, Severity, StepRecord
from babysit.supervisor.config.plan import RunPlan
from babysit.supervisor.contract.directive import Directive
from babysit.supervisor.services.alerts import Alert, AlertDispatcher
from babysit.supervisor.services.alerts.story import IncidentStory
from babysit.supervisor.services.dashboards import Dashboards, Sink, TensorBoardSink, WandbSink
from babysit.supervisor.services.exporter import Exporter
from babysit.supervisor.services.goodput import Goodput, Ledger
from babysit.supervisor.services.schedule import (
    Digest,
    DigestSnapshot,
    HealthReport,
    JobFailed,
    Jobs,
    Message,
    RetentionDone,
)

Entry = tuple[str, dict[str, Any]]
log = logging.getLogger(__name__)


class Services:
    """Calling rules: ``start()`` once, then from the loop thread only: ``publish()`` every tick,
    ``drain()`` every tick, ``observe_step()`` per merged step, ``notify()`` per alert the run
    decides, ``finished()`` once at the end; ``stop()`` once. ``hear()`` listens to the journal
    (``Journal.listen``, any thread): every entry feeds the goodput ledger, and the run's story
    is told from the entries themselves (``launch``, ``state``, ``finding``,
    ``checkpoint_verdict``), so the loop calls nothing for them. The constructor starts
    nothing."""

    def __init__(self, plan: RunPlan, alerts: AlertDispatcher) -> None:
        self._plan = plan
        self._alerts = alerts
        self._outbox: queue.Queue[Message] = queue.Queue(maxsize=1000)
        self._snapshot = DigestSnapshot(state="starting", attempt=0)
        self._pids: tuple[int, ...] = ()
        config = plan.config
        self._jobs = Jobs(config.schedule, self._outbox, pids=lambda: self._pids,
                          checkpoint_dir=plan.checkpoint_dir, snapshot=lambda: self._snapshot,
                          health=config.health, checkpoint_keep=config.checkpoints.keep)
        self.exporter = Exporter(config.prometheus, run_name=plan.name) \
            if config.prometheus.enabled else None
        self.story = IncidentStory(plan.name, socket.gethostname())
        self._linger_cut = threading.Event()
        self._directive: Directive | None = None
        tb, wb = config.tensorboard, config.wandb
        sinks: list[Sink] = []
        if tb.enabled:
            sinks.append(TensorBoardSink(
                Path(tb.dir).resolve() if tb.dir else plan.run_dir / "tensorboard"))
        if wb.enabled:
            sinks.append(WandbSink(wb, plan.name,
                                   Path(wb.dir).resolve() if wb.dir else plan.run_dir))
        self.dashboards = Dashboards(sinks)
        self.ledger = Ledger()
        """This session's goodput ledger, fed as the loop journals and records."""
        self._ledger_lock = threading.Lock()

    def start(self, log: Callable[[str], None] = lambda line: None) -> list[Entry]:
        """Start the jobs, the dashboards and the exporter; the journal entries to write
        (each also said through ``log``)."""
        self._jobs.start()
        self.dashboards.start()  # each opens on its own thread; drain() says how it went
        if self.exporter is None:
            return []
        url = f"http://{self._plan.config.prometheus.host}:{self.exporter.start()}/metrics"
        log(f"babysit: prometheus started: {{'url': '{url}'}}")
        return [("prometheus_started", {"url": url})]

    def publish(self, snapshot: DigestSnapshot, pids: tuple[int, ...]) -> None:
        ledger = self.goodput()
        # Plain attribute swaps: the job threads read whole immutable objects.
        self._snapshot = replace(snapshot, goodput=ledger.goodput)
        self._pids = pids
        if self.exporter is not None:
            self.exporter.update(state=snapshot.state, attempt=snapshot.attempt,
                                 steps_per_second=snapshot.steps_per_second,
                                 tokens_per_second=snapshot.tokens_per_second,
                                 mfu=snapshot.mfu)
            self.exporter.observe_goodput(ledger.wall_s, ledger.seconds)

    def hear(self, entry: Mapping[str, Any]) -> None:
        """A journal entry was written. Any thread (alert deliveries are journaled on sender
        threads); the entries of the run's story come from the loop's thread only."""
        with self._ledger_lock:
            self.ledger.entry(entry)
        event = entry.get("event")
        if event == "resume":
            self.story.resuming(entry)
        elif event == "launch":
            self._launched(Directive.from_json(entry["directive"]))
        elif event == "state":
            self._transition(str(entry["old"]), str(entry["new"]))
        elif event == "finding":
            finding = Finding.from_json(entry["finding"])
            remedy = Remedy.from_json(entry["remedy"], finding)
            if remedy.action is not Action.IGNORE:
                self._count(finding, remedy)
        elif event == "checkpoint_verdict":
            self._checkpoint_verdict(entry)

    def goodput(self) -> Goodput:
        """This session's goodput ledger up to now."""
        with self._ledger_lock:
            return self.ledger.totals(time.time())

    def observe_step(self, record: JobStep, row: Mapping[str, Any] | None = None) -> None:
        """A merged step; ``row``: its ``metrics.jsonl`` row, for the goodput ledger."""
        if row is not None:
            with self._ledger_lock:
                self.ledger.row(row)
        now = time.time()
        recovered = self.story.step(record.step, now)
        if recovered is not None:
            self._alerts.submit(recovered)
        self.dashboards.step(record)
        if self.exporter is not None:
            # Per-rank step times where the record has them (a multi-node leader has summaries).
            ranks = record.ranks if isinstance(record, StepRecord) else ()
            times = {r.rank: r.step_time for r in ranks if r.step_time is not None}
            self.exporter.observe_step(record.step, record.loss, times,
                                       grad_norm=record.grad_norm, step_s=record.step_time,
                                       at=now)
            if self._directive is not None:  # the scale in force, ramps included
                self.exporter.observe_run(lr_scale=self._directive.scale_at(record.cursor))

    # -- the run's story: alerts a person can act on, and the exporter's short-lived facts ------

    def notify(self, action: sm.Notify, machine: sm.Machine, incident_dir: str | None) -> None:
        """Send the alert for ``decide()``'s Notify (``machine``: the state it led to): an
        incident told in words when it carries a remedy, else its title as a plain alert."""
        if action.remedy is not None:
            alert = self.story.incident(action.remedy, attempt=machine.attempt,
                                        incident_dir=incident_dir, now=time.time(),
                                        ends_run=machine.state is sm.State.FAILED)
        else:
            alert = Alert(title=action.title, severity=action.severity, run=self._plan.name,
                          attempt=machine.attempt, step=machine.step or None)
        self._alerts.submit(alert)

    def _launched(self, directive: Directive) -> None:
        """An attempt started with ``directive`` (what its ranks run with)."""
        self._directive = directive
        applied = self.story.launched(directive, time.time())
        if applied is not None:
            self._alerts.submit(applied)
        if self.exporter is not None:
            self.exporter.observe_run(lr_scale=directive.lr_scale)

    def _transition(self, old: str, new: str) -> None:
        """The supervisor's state changed (counted, so a state shorter than a scrape shows)."""
        if self.exporter is not None:
            self.exporter.observe_transition(old, new)
            self._write_textfile()

    def _checkpoint_verdict(self, fields: Mapping[str, Any]) -> None:
        """A checkpoint passed probation: the exporter's newest good checkpoint."""
        if self.exporter is not None and fields.get("verdict") == "good":
            created = fields.get("created")
            self.exporter.observe_good_checkpoint(
                int(fields["checkpoint_step"]),
                float(created) if isinstance(created, (int, float)) else None)

    def finished(self, machine: sm.Machine, exit_code: int) -> None:
        """The run ended (after its ``run_finished`` entry): the "finished"/"failed" message
        with this session's goodput, and the exporter's final state and ledger."""
        ledger = self.goodput()
        self._alerts.submit(self.story.finished(
            state=machine.state.value, exit_code=exit_code, reason=machine.reason,
            attempt=machine.attempt, step=machine.step or None, now=time.time(),
            goodput=ledger.goodput))
        if self.exporter is not None:
            self.exporter.observe_goodput(ledger.wall_s, ledger.seconds)
            self.exporter.update(state=machine.state.value)
            self.exporter.observe_run(exit_code=exit_code)
            self._write_textfile()

    def _write_textfile(self) -> None:
        assert self.exporter is not None
        try:
            self.exporter.write_textfile()
        except OSError as exc:  # a metrics file must never stop the run; say it once per call
            log.warning("prometheus.textfile %s could not be written: %s",
                        self.exporter.config.textfile, exc.strerror or exc)

    def _count(self, finding: Finding, remedy: Remedy) -> None:
        self.dashboards.incident(finding, remedy, time.time())
        if self.exporter is not None:
            self.exporter.count_intervention(finding.incident.value, remedy.action.value)

    def drain(self, log: Callable[[str], None] = lambda line: None) -> list[Entry]:
        """Messages from the jobs and the dashboards as journal entries, each console line
        said through ``log``; alerts are sent."""
        out = self.dashboards.drain()
        while True:
            try:
                message = self._outbox.get_nowait()
            except queue.Empty:
                break
            out.extend(self._handle(message))
        for _, line in out:
            if line:
                log(line)
        return [entry for entry, _ in out]

    def _handle(self, message: Message) -> list[tuple[Entry, str | None]]:
        run, snap = self._plan.name, self._snapshot
        if isinstance(message, HealthReport):
            if self.exporter is not None:
                self.exporter.observe_health(message.sample)
            for w in message.warnings:
                self._alerts.submit(Alert(title=w.message, severity=Severity.WARNING, run=run,
                                          attempt=snap.attempt, step=snap.step,
                                          dedup_key=f"health:{w.kind}:{w.subject}"))
            return [(("health_warning", w.to_json()), f"babysit: [health] {w.message}")
                    for w in message.warnings]
        if isinstance(message, Digest):
            self._alerts.submit(Alert(title=message.text, severity=Severity.INFO, run=run,
                                      attempt=snap.attempt, step=snap.step))
            return [(("digest", dict(message.fields)), f"babysit: [digest] {message.text}")]
        if isinstance(message, RetentionDone):
            return [(("checkpoint_retention", {"deleted": [str(p) for p in message.deleted]}),
                     None)]
        if isinstance(message, JobFailed):
            return [(("job_failed", {"job": message.job, "error": message.error}),
                     f"babysit: scheduled job {message.job} failed: {message.error}")]
        return []

    def stop(self, say: Callable[[str], None] = print,
             asked: Callable[[], bool] = lambda: False) -> None:
        """Stop the jobs; keep the final metrics up for ``prometheus.linger_s`` (SIGINT or
        SIGTERM ends the wait; so does ``asked()``, true when one came after the run's last
        look at its signals), then stop the endpoint. Call on the main thread."""
        self._jobs.shutdown()
        for line in self.dashboards.stop():
            say(line)
        if self.exporter is None:
            return
        self._write_textfile()
        linger = self.exporter.config.linger_s
        if linger > 0 and self.exporter.port is not None:
            say(f"babysit: serving the final metrics on port {self.exporter.port} for "
                f"{linger:g} s (prometheus.linger_s; Ctrl-C ends it)")
            self._linger(linger, asked)
        self.exporter.stop()

    def _linger(self, seconds: float, asked: Callable[[], bool]) -> None:
        def cut(signum: int, frame: FrameType | None) -> None:
            self._linger_cut.set()

        try:
            previous = {sig: signal.signal(sig, cut) for sig in (signal.SIGINT, signal.SIGTERM)}
        except ValueError:  # not the main thread: no signals to take, wait the time out
            previous = {}
        if asked():  # a Ctrl-C before this handler: the run's own handler kept it
            self._linger_cut.set()
        try:
            self._linger_cut.wait(seconds)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
