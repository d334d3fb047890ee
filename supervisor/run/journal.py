"""The journal: ``events.jsonl`` in the run directory, the run's source of truth.

One JSON object per line, appended and flushed as each thing happens: every state change, every
action and the evidence for it. Later tools (status, report, a restarted supervisor) read it back
with ``read()``; nothing else about a run's history is authoritative.

Each entry has ``time`` (Unix seconds), ``event`` (what happened), ``attempt`` and, once the job
has a step, ``step``: the job's step when it was written (``Record.job_step``: the newest row of
``metrics.jsonl``). The rest is the event's own evidence, where any other step has a field of its
own (a checkpoint's: ``checkpoint_step``) and a value babysit does not have is null, never a
number standing for none. docs/running.md ("The journal") is the reference.
"""

from __future__ import annotations

import json
import math
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from babysit.supervisor.run.exit_codes import REQUEUE

Listener = Callable[[dict[str, Any]], None]
"""Hears one journal entry, as written."""


class Journal:
    """Append-only writer. Call ``open()`` before ``write()``; the constructor does no I/O.

    ``write`` may be called from any thread (alert delivery results arrive on sender threads);
    each entry is one whole line. Collaborators that only need to know what happened
    ``listen()``: each written entry is handed to them, in order, on the writer's thread and
    outside the file's lock, so a listener may write entries of its own.
    """

    def __init__(self, path: Path, fsync: bool = False) -> None:
        self.path = path
        self._fsync = fsync
        self._file: IO[str] | None = None
        self._lock = threading.Lock()
        self._listeners: list[tuple[frozenset[str] | None, Listener]] = []
        self._fenced = False

    def listen(self, listener: Listener, events: Iterable[str] | None = None) -> None:
        """Hand ``listener`` every entry written from now on, or only those whose ``event`` is
        in ``events``. A listener that needs the loop's thread names its events: the entries
        written on other threads (``alert_delivery``) are never among them."""
        self._listeners.append((frozenset(events) if events is not None else None, listener))

    def open(self) -> Journal:
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (owned until close)
        return self

    def write(self, event: str, time: float, attempt: int, step: int | None = None, /,
              **evidence: Any) -> dict[str, Any]:
        """Append one entry and flush it, so a crash of babysit loses nothing already decided.

        The leading parameters are positional-only, so evidence may carry any key: one that
        names a field of the entry itself (``time``, ``event``, ``attempt``, ``step``) is kept
        as ``evidence_<key>`` rather than overwriting it.
        """
        entry: dict[str, Any] = {"time": round(time, 6), "event": event, "attempt": attempt}
        if step is not None:
            entry["step"] = step
        for key, value in evidence.items():
            entry[f"evidence_{key}" if key in _RESERVED else key] = value
        line = json.dumps(json_safe(entry), separators=(",", ":")) + "\n"
        with self._lock:
            if self._fenced:
                return entry
            if self._file is None:
                raise RuntimeError("Journal.write() before open()")
            self._file.write(line)
            self._file.flush()
            if self._fsync:
                os.fsync(self._file.fileno())
        for events, listener in self._listeners:
            if events is None or event in events:
                listener(entry)
        return entry

    def fence(self) -> None:
        """Write nothing more, and tell no listener: another writer owns the record now."""
        with self._lock:
            self._fenced = True

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


_RESERVED = frozenset({"time", "event", "attempt", "step"})


def read(path: Path) -> Iterator[dict[str, Any]]:
    """Entries in order. A torn last line (babysit killed mid-write) is skipped, not fatal."""
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    continue
    except FileNotFoundError:
        return




def checkpoint_step(entry: dict[str, Any]) -> int | None:
    """The step of the checkpoint an entry names (its ``checkpoint_step``); None when it names
    none."""
    step = entry.get("checkpoint_step")
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def json_safe(value: Any) -> Any:
    """JSON has no NaN/Inf; keep them readable as strings instead of emitting invalid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


@dataclass(frozen=True)
class PriorRun:
    """What an earlier supervisor of this run directory left behind, read from its journal.

    ``unfinished``: it started and never journaled ``run_finished`` (killed, OOM, reboot), it
    was stopped by a signal (preempted, interrupted), or it ended with a requeue verdict (exit
    75: the run goes on elsewhere, a scheduler's requeue): this supervisor takes over.
    ``directive``: the last directive it launched workers with
    (skips and LR scale decided so far). ``pids``: the processes it launched in its last
    attempt (torchrun and the ranks), which may still run as orphans.
    """

    last_attempt: int
    unfinished: bool
    directive: dict[str, Any] | None
    pids: tuple[int, ...]
    watch_state: dict[str, Any] | None = None
    """The judgement state journaled after its last finding (see ``Watch.state_dict``)."""
    pending: dict[str, Any] | None = None
    """A ``finding`` entry whose rollback or relaunch was decided but never launched: the
    supervisor died in between, and the remedy must not be lost."""
    last_step: int = 0
    """Where its last attempt's timeline began (the step it resumed from): the journal alone
    knows no newer step of it, since its entries' step stamps still carry the attempt before's
    until the attempt's first step. ``takeover.high_water`` makes it the newest step observed
    in that timeline, from ``metrics.jsonl``: workers that trained on after it died did so
    unwatched."""
    streams: tuple[dict[str, Any], ...] = ()
    """Where the data stream was (its ``worker_stream`` entries, oldest first), so an
    inherited rollback's skip still goes out in samples."""


def prior_run(entries: list[dict[str, Any]]) -> PriorRun | None:
    """Pure: the previous supervisor's story, or None for a new run directory."""
    if not entries:
        return None
    last_start = max(i for i, e in enumerate(entries) if e.get("event") == "run_started") \
        if any(e.get("event") == "run_started" for e in entries) else 0
    tail = entries[last_start:]
    last_attempt = max((int(e.get("attempt", 0)) for e in entries), default=0)
    finished = [e for e in tail if e.get("event") == "run_finished"]
    unfinished = not finished or finished[-1].get("state") == "stopped" or \
        finished[-1].get("exit_code") == REQUEUE
    last_launch = max((i for i, e in enumerate(entries) if e.get("event") == "launch"),
                      default=-1)
    launch = entries[last_launch] if last_launch >= 0 else None
    since_launch = entries[last_launch + 1:]
    directive = launch.get("directive") if launch else None
    pids: list[int] = []
    if launch:
        pids.append(int(launch.get("pid", 0)))
        pids += [int(e["data"]["pid"]) for e in tail if e.get("event") == "worker_hello"
                 and e.get("attempt") == launch.get("attempt")
                 and isinstance(e.get("data"), dict) and isinstance(e["data"].get("pid"), int)]
        # A warm standby started after that launch waits for a promotion that will never come
        # (one started before it is that launch).
        pids += [int(e["pid"]) for e in since_launch if e.get("event") == "standby_started"
                 and isinstance(e.get("pid"), int)]
    states = [e["state"] for e in entries if e.get("event") == "watch_state"]
    pending = [e for e in since_launch if e.get("event") == "finding"
               and e.get("remedy", {}).get("action") in ("rollback", "relaunch")]
    resumed = ((directive or {}).get("resume") or {}).get("step")
    last_step = resumed if isinstance(resumed, int) else 0 if launch else \
        max((e["step"] for e in entries if isinstance(e.get("step"), int)), default=0)
    streams = tuple(e["data"] for e in entries if e.get("event") == "worker_stream"
                    and isinstance(e.get("data"), dict))
    return PriorRun(last_attempt, unfinished, directive, tuple(p for p in pids if p > 0),
                    states[-1] if states else None,
                    pending[-1] if pending and unfinished else None, last_step, streams)
