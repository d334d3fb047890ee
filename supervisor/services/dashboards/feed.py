"""Every dashboard on a thread of its own, so that none can cost the run.

::

    loop thread                                 one thread per sink
    step(record)         -> StepValues   --.
    incident(finding)    -> IncidentNote --+--> queue --> sink.open() once, step(), incident()
    drain() <-- <name>_started / _failed <----------------' (exceptions end that sink only)
    stop()  --> close, waits CLOSE_WAIT_S at most

The loop never waits on a dashboard's library: W&B's ``init`` can wait 90 s for a server that
does not answer, its ``finish`` for an upload. A sink that raises is journaled once and dropped;
one that falls ``CAPACITY`` writes behind is dropped too, so a stuck library costs no memory.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

from babysit.policies.types import Finding, JobStep, Remedy
from babysit.supervisor.services.dashboards.writes import (
    IncidentNote,
    Sink,
    StepValues,
    incident_note,
    step_values,
)

Entry = tuple[str, dict[str, Any]]
CAPACITY = 10_000
"""Writes one sink may fall behind before it is dropped (a step is one write)."""
CLOSE_WAIT_S = 30.0
"""How long ``stop()`` waits for each sink to close (a W&B upload may take longer: it is left
behind, and ``wandb sync`` can finish it)."""

_CLOSE = object()


class _Feed:
    def __init__(self, sink: Sink, outbox: queue.Queue[tuple[Entry, str | None]]) -> None:
        self.sink = sink
        self._outbox = outbox
        self._queue: queue.Queue[object] = queue.Queue(maxsize=CAPACITY)
        self._thread = threading.Thread(target=self._run, name=f"babysit-{sink.name}",
                                        daemon=True)
        self.dropped = False

    def start(self) -> None:
        self._thread.start()

    def put(self, item: StepValues | IncidentNote) -> None:
        if self.dropped:
            return
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self._fail(f"fell {CAPACITY} writes behind (its library is stuck)")

    def close(self) -> None:
        with contextlib.suppress(queue.Full):  # full: dropped for being stuck, nothing to close
            self._queue.put_nowait(_CLOSE)

    def wait(self, seconds: float) -> bool:
        """True when the sink's thread ended within ``seconds`` (or never started: the run
        stopped before ``start()``)."""
        if self._thread.ident is None:
            return True
        self._thread.join(max(0.0, seconds))
        return not self._thread.is_alive()

    def _fail(self, error: str) -> None:
        if self.dropped:  # said once
            return
        self.dropped = True
        self._outbox.put(((f"{self.sink.name}_failed", {"error": error}),
                          f"babysit: {self.sink.label} dropped: {error}"))

    def _run(self) -> None:
        sink = self.sink
        try:
            where = sink.open()
            self._outbox.put(((f"{sink.name}_started", where),
                              f"babysit: {sink.label} writing to "
                              f"{where.get('url') or where.get('dir')}"))
            while (item := self._queue.get()) is not _CLOSE and not self.dropped:
                if isinstance(item, StepValues):
                    sink.step(item)
                elif isinstance(item, IncidentNote):
                    sink.incident(item)
        except Exception as exc:  # a dashboard must never cost the run
            self._fail(f"{type(exc).__name__}: {exc}")
        try:
            sink.close()
        except Exception as exc:
            self._fail(f"closing: {type(exc).__name__}: {exc}")


class Dashboards:
    """The run's dashboards. Calling rules: ``start()`` once, then from the loop thread
    ``step()`` per merged step, ``incident()`` per acted-on finding and ``drain()`` every tick
    (what to journal and print: each sink's start or failure); ``stop()`` once. None of them
    waits on a sink but ``stop()``. The constructor starts nothing."""

    def __init__(self, sinks: Sequence[Sink]) -> None:
        self._outbox: queue.Queue[tuple[Entry, str | None]] = queue.Queue()
        self._feeds = [_Feed(sink, self._outbox) for sink in sinks]
        self._interventions = 0

    def start(self) -> None:
        for feed in self._feeds:
            feed.start()

    def step(self, record: JobStep) -> None:
        if self._feeds:
            values = step_values(record, self._interventions)
            for feed in self._feeds:
                feed.put(values)

    def incident(self, finding: Finding, remedy: Remedy, walltime: float) -> None:
        self._interventions += 1
        note = incident_note(finding, remedy, walltime)
        for feed in self._feeds:
            feed.put(note)

    def drain(self) -> list[tuple[Entry, str | None]]:
        out = []
        while True:
            try:
                out.append(self._outbox.get_nowait())
            except queue.Empty:
                return out

    def stop(self) -> list[str]:
        """Close every sink, waiting ``CLOSE_WAIT_S`` at most in all; the console lines of
        what happened since the last ``drain()``, and of each sink still closing."""
        for feed in self._feeds:  # every close starts before any wait
            feed.close()
        deadline = time.monotonic() + CLOSE_WAIT_S
        late = [feed.sink.label for feed in self._feeds
                if not feed.wait(deadline - time.monotonic())]
        return [line for _, line in self.drain() if line] + [
            f"babysit: {label} still closing after {CLOSE_WAIT_S:g} s; left behind"
            for label in late]
