"""Periodic background jobs: health sampling, a progress digest, checkpoint retention.

They run on apscheduler's threads, never on the control loop's, so they must not touch the
loop's state. Each job either does self-contained work (sampling the host, deleting old
checkpoints through the catalog) or reads an immutable snapshot the loop hands out, and puts a
small message on ``outbox``, a ``queue.Queue`` the loop drains once per tick::

    scheduler thread(s)                           control loop (one thread)
    health    sample -> HealthWatch -> HealthReport  --.
    digest    snapshot() -> digest() -> Digest       --+--> outbox --> journal, alerts, exporter
    retention retain() -> RetentionDone              --'
    any job   exception -> JobFailed (never kills the scheduler)

Job state (the health history, the previous digest) belongs to its job; the only thing two jobs
share, the active health warnings the digest mentions, is behind a lock.
"""

from __future__ import annotations

import math
import queue
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field

from babysit.policies.section import Section
from babysit.supervisor.services.health import (
    HealthConfig,
    HealthSample,
    HealthSampler,
    HealthWarning,
    HealthWatch,
)

if TYPE_CHECKING:
    from apscheduler.events import JobSubmissionEvent
    from apscheduler.schedulers.background import BackgroundScheduler


class ScheduleConfig(Section):
    """How often babysit's background jobs run (seconds; null turns a job off)."""

    health_every_s: float | None = Field(10.0, gt=0)
    """Sample host memory, disk, worker processes and GPUs every this many seconds (the first
    sample is taken at start)."""
    digest_every_s: float | None = Field(1800.0, gt=0)
    """Send a progress digest (step, loss, speed, interventions, health) every this many
    seconds."""
    retention_every_s: float | None = Field(600.0, gt=0)
    """Delete checkpoints beyond ``checkpoints.keep`` every this many seconds."""


# -- messages on the outbox -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HealthReport:
    """One health sample and the warnings that are *new* with it (each condition warns once
    until it clears; see ``HealthWatch``)."""

    sample: HealthSample
    warnings: tuple[HealthWarning, ...]


@dataclass(frozen=True, slots=True)
class Digest:
    """A periodic summary: ``text`` for people (one line), ``fields`` for the journal."""

    text: str
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RetentionDone:
    """Retention deleted these step directories (sent only when it deleted something)."""

    deleted: tuple[Path, ...]


@dataclass(frozen=True, slots=True)
class JobFailed:
    """A job raised (or could not start because its previous run is still going). A job that
    keeps failing the same way is reported once, and again only after it succeeded."""

    job: str
    error: str
    """One line: the exception's type and message."""
    traceback: str = ""


Message = HealthReport | Digest | RetentionDone | JobFailed


@dataclass(frozen=True, slots=True)
class DigestSnapshot:
    """What the loop knows, frozen at one moment, for the digest job to read from its thread."""

    state: str
    attempt: int
    step: int | None = None
    loss: float | None = None
    steps_per_second: float | None = None
    tokens_per_second: float | None = None
    mfu: float | None = None
    """Model FLOPs utilisation, 0..1 (only when the script gave FLOPs per token and peak)."""
    interventions: int = 0
    """Remedies taken since babysit started (cumulative; the digest reports the difference)."""
    last_incident: str | None = None
    """e.g. ``"loss_spike@1100"``."""
    goodput: float | None = None
    """This supervisor's goodput so far, 0..1 (``services.goodput``): productive step time
    over wall time."""


# -- the digest (pure) -----------------------------------------------------------------------------


def digest(now: DigestSnapshot, before: DigestSnapshot | None, period_s: float,
           health: Sequence[HealthWarning] = ()) -> Digest:
    """Summarise ``now`` against the previous digest's snapshot (None for the first digest).

    ``period_s``: seconds since the previous digest (or since start); ``health``: the active
    health warnings.
    """
    steps_since = (now.step - before.step
                   if before is not None and now.step is not None and before.step is not None
                   and before.attempt == now.attempt else None)
    interventions_since = now.interventions - (before.interventions if before else 0)
    parts = [f"{now.state}", f"attempt {now.attempt}"]
    if now.step is not None:
        parts.append(f"step {now.step:,}" + (f" (+{steps_since:,})" if steps_since else ""))
    if now.loss is not None:
        parts.append(f"loss {now.loss:.4g}" if math.isfinite(now.loss) else f"loss {now.loss}")
    if now.steps_per_second is not None:
        parts.append(f"{now.steps_per_second:.2f} steps/s")
    if now.tokens_per_second is not None:
        parts.append(f"{now.tokens_per_second:,.0f} tokens/s")
    if now.mfu is not None:
        parts.append(f"MFU {100 * now.mfu:.1f}%")
    interventions = f"{interventions_since} intervention(s)"
    if interventions_since and now.last_incident:
        interventions += f" (last: {now.last_incident})"
    parts.append(interventions)
    if now.goodput is not None:
        parts.append(f"goodput {100 * now.goodput:.1f}%")
    kinds = sorted({w.kind.value for w in health})
    parts.append("health: " + (", ".join(kinds) if kinds else "ok"))
    text = f"babysit digest, last {_duration(period_s)}: " + ", ".join(parts)
    fields = {
        "period_s": round(period_s, 1), "state": now.state, "attempt": now.attempt,
        "step": now.step, "steps_since": steps_since, "loss": now.loss,
        "steps_per_second": now.steps_per_second, "tokens_per_second": now.tokens_per_second,
        "mfu": now.mfu,
        "interventions_since": interventions_since, "interventions_total": now.interventions,
        "last_incident": now.last_incident, "health_warnings": kinds,
        "goodput": now.goodput,
    }
    return Digest(text, fields)


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


# -- the jobs --------------------------------------------------------------------------------------


class Jobs:
    """The background jobs of one run, on an apscheduler ``BackgroundScheduler``.

    ``outbox``: where messages go (``Message``); put without blocking, so a full queue drops the
    message and counts it in ``dropped``. ``pids``: the job's process ids, called on a
    scheduler thread, so it must only read something the loop replaces atomically (e.g. return
    a tuple attribute the loop reassigns). ``snapshot``: returns the loop's latest
    ``DigestSnapshot``, same rule. ``retain``: deletes old checkpoints and returns the deleted
    directories (e.g. ``lambda: catalog.retain(keep)``); None turns retention off.
    ``checkpoint_keep``: ``checkpoints.keep``, for the disk-space rule.

    Calling rules: ``start()`` once, ``shutdown()`` once (idempotent; waits for running jobs
    and leaves no thread behind). The constructor starts nothing.
    """

    def __init__(
        self,
        config: ScheduleConfig,
        outbox: queue.Queue[Message],
        *,
        pids: Callable[[], Sequence[int]],
        checkpoint_dir: Path,
        snapshot: Callable[[], DigestSnapshot],
        retain: Callable[[], Sequence[Path]] | None = None,
        health: HealthConfig | None = None,
        checkpoint_keep: int = 1,
        sampler: HealthSampler | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.outbox = outbox
        self.dropped = 0
        self._pids = pids
        self._checkpoint_dir = checkpoint_dir
        self._snapshot = snapshot
        self._retain = retain
        self._sampler = sampler if sampler is not None else HealthSampler()
        self._watch = HealthWatch(health or HealthConfig(), checkpoint_keep)
        self._clock = clock
        self._started = 0.0
        self._lock = threading.Lock()
        self._active_health: tuple[HealthWarning, ...] = ()
        self._last_digest: tuple[float, DigestSnapshot] | None = None
        self._last_error: dict[str, str] = {}
        self._scheduler: BackgroundScheduler | None = None

    def start(self) -> None:
        # Imported here, not at the top: the config schema imports this module, and `babysit
        # validate` / `schema` should not pay apscheduler's import (~0.2 s on a busy VM).
        from apscheduler.events import EVENT_JOB_MAX_INSTANCES
        from apscheduler.executors.pool import ThreadPoolExecutor
        from apscheduler.schedulers.background import BackgroundScheduler

        # One worker per job: a job stuck in the kernel (a hung network file system under the
        # checkpoints) stalls only itself, and max_instances=1 keeps it from piling up.
        scheduler = BackgroundScheduler(
            executors={"default": ThreadPoolExecutor(max_workers=3)},
            job_defaults={"coalesce": True, "max_instances": 1, "misfire_grace_time": None},
            timezone=timezone.utc,
        )
        scheduler.add_listener(self._on_overrun, EVENT_JOB_MAX_INSTANCES)
        now = datetime.now(timezone.utc)
        self._started = self._clock()
        jobs: list[tuple[str, float | None, Callable[[], None], datetime | None]] = [
            ("health", self.config.health_every_s, self._health, now),
            ("digest", self.config.digest_every_s, self._digest, None),
            ("retention", self.config.retention_every_s if self._retain else None,
             self._retention, None),
        ]
        for name, every_s, body, first in jobs:
            if every_s is None:
                continue
            extra = {"next_run_time": first} if first is not None else {}
            scheduler.add_job(self._guarded(name, body), "interval", seconds=every_s, id=name,
                              name=name, **extra)
        scheduler.start()
        self._scheduler = scheduler

    def shutdown(self) -> None:
        scheduler, self._scheduler = self._scheduler, None
        if scheduler is not None:
            scheduler.shutdown(wait=True)
        self._sampler.close()

    # -- job bodies (scheduler threads) ---------------------------------------------------------

    def _health(self) -> None:
        sample = self._sampler.sample(list(self._pids()), self._checkpoint_dir)
        new = self._watch.observe(sample)
        with self._lock:
            self._active_health = tuple(self._watch.active)
        self._send(HealthReport(sample, tuple(new)))

    def _digest(self) -> None:
        snap = self._snapshot()
        now = self._clock()
        before = self._last_digest
        with self._lock:
            health = self._active_health
        period = now - (before[0] if before else self._started)
        self._send(digest(snap, before[1] if before else None, period, health))
        self._last_digest = (now, snap)

    def _retention(self) -> None:
        if self._retain is None:  # not scheduled without one; kept for direct calls
            return
        deleted = tuple(self._retain())
        if deleted:
            self._send(RetentionDone(deleted))

    # -- plumbing -------------------------------------------------------------------------------

    def _guarded(self, name: str, body: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                body()
            except Exception as exc:  # a job's failure is a message, never the scheduler's end
                self._failed(name, f"{type(exc).__name__}: {exc}", traceback.format_exc())
            else:
                with self._lock:
                    self._last_error.pop(name, None)

        return run

    def _on_overrun(self, event: JobSubmissionEvent) -> None:
        self._failed(event.job_id, "skipped: its previous run is still going", "")

    def _failed(self, job: str, error: str, trace: str) -> None:
        with self._lock:
            if self._last_error.get(job) == error:
                return
            self._last_error[job] = error
        self._send(JobFailed(job, error, trace))

    def _send(self, message: Message) -> None:
        try:
            self.outbox.put_nowait(message)
        except queue.Full:
            # Never block a scheduler thread on a loop that is behind: the next report comes.
            with self._lock:
                self.dropped += 1
