"""The loop's background helpers: scheduled jobs and the opt-in Prometheus endpoint.

The jobs (health sampling, the periodic digest) run on apscheduler's threads and never touch the
loop's state: the loop *publishes* an immutable snapshot each tick and *drains* their messages
on its own thread, turning each into journal entries, console lines and alerts.

Checkpoint retention is not one of the scheduled jobs: it runs on the loop thread each time a
checkpoint is committed (``babysit.supervisor.run.recovery``), because the catalog's verdict
file has one writer, and retention right after a save keeps the disk bounded without a timer.
"""

from __future__ import annotations

import queue
from typing import Any

from babysit.policies.types import Finding, JobStep, Remedy, Severity, StepRecord
from babysit.supervisor.config.plan import RunPlan
from babysit.supervisor.services.alerts import Alert, AlertDispatcher
from babysit.supervisor.services.exporter import Exporter
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


class Services:
    """Calling rules: ``start()`` once, then from the loop thread only: ``publish()`` every tick,
    ``drain()`` every tick, ``observe_step()`` per merged step, ``count()`` per remedy;
    ``stop()`` once. The constructor starts nothing."""

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

    def start(self) -> list[Entry]:
        self._jobs.start()
        if self.exporter is None:
            return []
        port = self.exporter.start()
        return [("prometheus_started", {"url": f"http://{self._plan.config.prometheus.host}:"
                                               f"{port}/metrics"})]

    def publish(self, snapshot: DigestSnapshot, pids: tuple[int, ...]) -> None:
        # Plain attribute swaps: the job threads read whole immutable objects.
        self._snapshot = snapshot
        self._pids = pids
        if self.exporter is not None:
            self.exporter.update(state=snapshot.state, attempt=snapshot.attempt,
                                 steps_per_second=snapshot.steps_per_second,
                                 tokens_per_second=snapshot.tokens_per_second,
                                 mfu=snapshot.mfu)

    def observe_step(self, record: JobStep) -> None:
        if self.exporter is not None:
            # Per-rank step times where the record has them (a multi-node leader has summaries).
            ranks = record.ranks if isinstance(record, StepRecord) else ()
            times = {r.rank: r.step_time for r in ranks if r.step_time is not None}
            self.exporter.observe_step(record.step, record.loss, times)

    def count(self, finding: Finding, remedy: Remedy) -> None:
        if self.exporter is not None:
            self.exporter.count_intervention(finding.incident.value, remedy.action.value)

    def drain(self) -> list[tuple[Entry, str | None]]:
        """Messages from the jobs as (journal entry, console line or None); alerts are sent."""
        out: list[tuple[Entry, str | None]] = []
        while True:
            try:
                message = self._outbox.get_nowait()
            except queue.Empty:
                return out
            out.extend(self._handle(message))

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

    def stop(self) -> None:
        self._jobs.shutdown()
        if self.exporter is not None:
            self.exporter.stop()
