"""Delivers alerts to every sink on background threads: the supervisor's loop never waits on HTTP.

One thread and one bounded queue per sink, not one for all: a sink that is down spends minutes in
retries and backoff, and must not hold up the sinks that work. The path of one alert::

    submit(alert)                      caller's thread: route by severity, enqueue, return (µs)
      -> sink queue (bounded)          full -> dropped, counted, reported later as "dropped"
      -> SinkGate.admit(key, t)        sink thread: duplicate -> "suppressed"; over limit ->
                                       "rate_limited"  (t is the clock at submit time)
      -> payload -> transport.post()   retries, backoff -> "delivered" | "failed"
      -> on_result(record)             one dict per outcome, for the journal

Every record has ``event="alert"``, ``outcome``, ``sink`` and ``kind``; per-alert records add
``title``, ``severity``, ``incident``, ``step``, ``dedup_key``; ``delivered``/``failed`` add
``attempts``, ``status``, ``error``, ``detail``, ``elapsed_s``; ``suppressed``/``rate_limited``/
``dropped`` add ``count`` (``dropped`` also ``reason``: ``queue_full`` or ``shutdown``). No record,
log line or exception carries a sink's URL.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any

import requests

from babysit.policies.types import Severity
from babysit.supervisor.services.alerts import transport
from babysit.supervisor.services.alerts.config import AlertsConfig, ResolvedSink, resolve_sinks
from babysit.supervisor.services.alerts.gate import GateVerdict, SinkGate
from babysit.supervisor.services.alerts.payloads import (
    Alert,
    jsonable,
    slack_payload,
    webhook_payload,
)

log = logging.getLogger(__name__)

OnResult = Callable[[dict[str, Any]], None]
Clock = Callable[[], float]
_JOIN_SLACK_S = 0.25  # a request in flight at the deadline ends within this (its timeout was cut)


class AlertDispatcher:
    """Sends alerts to the configured sinks, without ever blocking or raising into the caller.

    Calling rules: build it (no I/O), ``start()`` once, ``submit()`` from any thread as often as
    you like, ``close()`` once at shutdown. Alerts submitted before ``start()`` wait in the queues.
    ``on_result`` is called from the sink threads, one call at a time (the dispatcher serialises
    them), so it needs no locking of its own; it should be quick, and its exceptions are logged and
    ignored. ``clock`` (seconds, monotonic) timestamps alerts for de-duplication and rate limiting
    only; retries and ``close`` deadlines use real time.
    """

    def __init__(
        self,
        sinks: Sequence[ResolvedSink],
        *,
        on_result: OnResult | None = None,
        queue_size: int = 100,
        close_timeout_s: float = 10.0,
        clock: Clock = time.monotonic,
    ) -> None:
        self._report_lock = threading.Lock()
        self._on_result = on_result
        self._clock = clock
        self._close_timeout_s = close_timeout_s
        self._sinks = list(sinks)
        self._workers = [_SinkWorker(s, queue_size, self._report) for s in self._sinks]
        self._started = False

    @classmethod
    def from_config(
        cls,
        config: AlertsConfig,
        *,
        on_result: OnResult | None = None,
        environ: Mapping[str, str] | None = None,
        clock: Clock = time.monotonic,
    ) -> AlertDispatcher:
        """Resolve every sink's URL from ``environ`` (default ``os.environ``) and build.

        Raises ``AlertConfigError`` naming the sink and variable if a URL is missing: call this at
        startup, before launching workers, so a typo stops the run instead of silencing alerts.
        """
        return cls(
            resolve_sinks(config, environ),
            on_result=on_result,
            queue_size=config.queue_size,
            close_timeout_s=config.close_timeout_s,
            clock=clock,
        )

    def __repr__(self) -> str:
        return f"AlertDispatcher(sinks={[s.name for s in self._sinks]})"

    def start(self) -> None:
        """Start one sender thread per sink. Idempotent."""
        if self._started:
            return
        self._started = True
        transport.protect(s.url for s in self._sinks)
        for worker in self._workers:
            worker.start()

    def submit(self, alert: Alert) -> None:
        """Queue ``alert`` for every sink whose ``min_severity`` it reaches, and return at once.

        Never blocks on the network and never raises: a full queue drops the alert for that sink
        (counted, and reported as ``dropped``); after ``close()`` alerts are counted and dropped.
        """
        try:
            at = self._clock()
            for worker in self._workers:
                if alert.severity >= worker.min_severity:
                    worker.offer(alert, at)
        except Exception as exc:  # the caller is the supervisor loop: it must survive anything
            log.warning("alert %r could not be queued (%s)", alert.title, type(exc).__name__)

    def close(self, timeout_s: float | None = None) -> bool:
        """Stop taking alerts, keep delivering queued ones until ``timeout_s`` (default: the
        config's ``close_timeout_s``) has passed, then drop the rest (reported as ``dropped``).

        Returns True if every sink thread finished in time. Returns within ``timeout_s`` plus a
        fraction of a second: a request in flight at the deadline has its timeout cut to fit.
        """
        timeout = self._close_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + max(0.0, timeout)
        for worker in self._workers:
            worker.close(deadline)
        for worker in self._workers:
            worker.join(deadline + _JOIN_SLACK_S)
        return not any(worker.alive for worker in self._workers)

    def test_all(self, *, run: str = "alert-test") -> list[tuple[str, bool, str]]:
        """Send one INFO test alert to every sink, synchronously, one attempt each; ignores
        ``min_severity``, de-duplication and rate limits. For ``babysit alert-test``.

        Returns ``(sink name, ok, detail)`` per sink, in config order; ``detail`` is redacted
        (e.g. ``"HTTP 404: no_service (not retried)"``). Blocks up to each sink's ``timeout_s``.
        """
        transport.protect(s.url for s in self._sinks)
        alert = Alert(
            title="babysit alert test: this sink works",
            severity=Severity.INFO,
            run=run,
            incident="test",
            action="none (test)",
            evidence={"purpose": "checking alert delivery"},
            dedup_key="babysit-alert-test",
        )
        results = []
        with requests.Session() as session:
            for sink in self._sinks:
                delivery = transport.post(session, sink, _body(sink, alert, 0, 0), max_attempts=1)
                results.append((sink.name, delivery.ok, delivery.detail))
        return results

    def stats(self) -> dict[str, dict[str, int]]:
        """Counts per sink name: delivered, failed, suppressed, rate_limited, dropped."""
        return {w.sink.name: w.counts() for w in self._workers}

    def __enter__(self) -> AlertDispatcher:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _report(self, record: dict[str, Any]) -> None:
        callback = self._on_result
        if callback is None:
            return
        with self._report_lock:
            try:
                callback(record)
            except Exception as exc:  # a broken journal must not stop alert delivery
                log.warning("alerts on_result callback raised %s; ignored", type(exc).__name__)


class _SinkWorker:
    """One sink's queue, gate and sender thread. Everything but the queue is owned by the thread."""

    def __init__(self, sink: ResolvedSink, queue_size: int, report: OnResult) -> None:
        self.sink = sink
        self.min_severity = sink.config.severity
        self._max_queue = queue_size
        self._report_fn = report
        self._gate = SinkGate(
            dedup_window_s=sink.config.dedup_window_s,
            max_alerts=sink.config.rate_limit.max_alerts,
            window_s=sink.config.rate_limit.window_s,
        )
        self._cond = threading.Condition()
        self._items: deque[tuple[Alert, float]] = deque()
        self._closing = threading.Event()
        self._deadline: float | None = None
        self._queue_full = 0  # dropped since last reported; guarded by _cond
        self._counts = dict.fromkeys(
            ("delivered", "failed", "suppressed", "rate_limited", "dropped"), 0
        )
        self._thread: threading.Thread | None = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._run, name=f"babysit-alerts-{self.sink.name}", daemon=True
        )
        self._thread.start()

    def offer(self, alert: Alert, at: float) -> None:
        with self._cond:
            if self._closing.is_set() or len(self._items) >= self._max_queue:
                self._queue_full += 1
                self._counts["dropped"] += 1
                return
            self._items.append((alert, at))
            self._cond.notify()

    def close(self, deadline: float) -> None:
        with self._cond:
            self._deadline = deadline
            self._closing.set()
            self._cond.notify_all()
        if self._thread is None:  # never started: nothing will drain the queue
            self._drop_rest()

    def join(self, until: float) -> None:
        if self._thread is not None:
            self._thread.join(max(0.0, until - time.monotonic()))

    def counts(self) -> dict[str, int]:
        with self._cond:
            return dict(self._counts)

    def _run(self) -> None:
        with requests.Session() as session:
            while True:
                with self._cond:
                    while not self._items and not self._closing.is_set():
                        self._cond.wait()
                    if not self._items:
                        break
                    alert, at = self._items.popleft()
                self._flush_queue_full()
                left = self._time_left()
                if left is not None and left <= 0:
                    with self._cond:
                        self._items.appendleft((alert, at))
                    break
                try:
                    self._handle(session, alert, at)
                except Exception as exc:  # keep the thread alive for the next alert
                    log.warning(
                        "alert sink %s: unexpected %s; alert dropped",
                        self.sink.name,
                        type(exc).__name__,
                    )
        self._drop_rest()

    def _handle(self, session: requests.Session, alert: Alert, at: float) -> None:
        decision = self._gate.admit(alert.key, at)
        if decision.verdict is GateVerdict.DUPLICATE:
            self._record(alert, "suppressed", count=decision.duplicates)
            return
        if decision.verdict is GateVerdict.RATE_LIMITED:
            self._record(alert, "rate_limited", count=decision.rate_limited)
            return
        limited = decision.rate_limited if self.sink.config.rate_limit.summary else 0
        body = _body(self.sink, alert, decision.duplicates, limited)
        d = transport.post(
            session,
            self.sink,
            body,
            max_attempts=1 + self.sink.config.max_retries,
            pause=self._pause,
            time_left=self._time_left,
        )
        outcome = "delivered" if d.ok else "failed"
        if not d.ok:
            log.warning("alert %r to sink %s failed: %s", alert.title, self.sink.name, d.detail)
        self._record(
            alert,
            outcome,
            attempts=d.attempts,
            status=d.status,
            error=d.error,
            detail=d.detail,
            elapsed_s=round(d.elapsed_s, 3),
        )

    def _record(self, alert: Alert, outcome: str, **extra: Any) -> None:
        with self._cond:
            self._counts[outcome] += 1
        self._report_fn(
            {
                "event": "alert",
                "outcome": outcome,
                "sink": self.sink.name,
                "kind": self.sink.config.kind,
                "title": alert.title,
                "severity": alert.severity.name.lower(),
                "incident": jsonable(alert.incident),
                "step": alert.step,
                "dedup_key": alert.key,
                **extra,
            }
        )

    def _flush_queue_full(self) -> None:
        with self._cond:
            count, self._queue_full = self._queue_full, 0
        if count:
            log.warning("alert sink %s: queue full, %d alert(s) dropped", self.sink.name, count)
            self._report_dropped("queue_full", count)

    def _drop_rest(self) -> None:
        self._flush_queue_full()
        with self._cond:
            count = len(self._items)
            self._items.clear()
            self._counts["dropped"] += count
        if count:
            log.warning(
                "alert sink %s: shutting down, %d queued alert(s) not sent", self.sink.name, count
            )
            self._report_dropped("shutdown", count)

    def _report_dropped(self, reason: str, count: int) -> None:
        self._report_fn(
            {
                "event": "alert",
                "outcome": "dropped",
                "sink": self.sink.name,
                "kind": self.sink.config.kind,
                "reason": reason,
                "count": count,
            }
        )

    def _time_left(self) -> float | None:
        deadline = self._deadline
        return None if deadline is None else deadline - time.monotonic()

    def _pause(self, seconds: float) -> bool:
        """Wait ``seconds`` between attempts; False (at once) if that would pass the deadline."""
        end = time.monotonic() + seconds
        while True:
            deadline = self._deadline
            if deadline is not None and end > deadline:
                return False
            remaining = end - time.monotonic()
            if remaining <= 0:
                return True
            if deadline is None:
                self._closing.wait(remaining)  # close() wakes us to re-check against its deadline
            else:
                time.sleep(remaining)


def _body(sink: ResolvedSink, alert: Alert, duplicates: int, rate_limited: int) -> bytes:
    build = slack_payload if sink.config.kind == "slack" else webhook_payload
    payload = build(alert, duplicates=duplicates, rate_limited=rate_limited)
    # jsonable() already made the evidence strict JSON; default=str catches anything in the other
    # fields that a caller typed loosely, instead of failing the alert.
    return json.dumps(payload, default=str, allow_nan=False).encode()
