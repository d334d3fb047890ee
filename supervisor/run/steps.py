"""``metrics.jsonl``: the job's steps as the loop records them, one row per merged step.

The loop writes each step here once; what follows steps (the progress line, the cadence's step
times, the services: dashboards, Prometheus, the goodput ledger) ``listen()`` instead of being
called from the loop one by one. The journal (``run.journal``) does the same for everything
else that happens.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from babysit.policies.types import JobStep
from babysit.supervisor.run.journal import json_safe

StepListener = Callable[[JobStep, dict[str, Any]], None]
"""Hears one merged step and its ``metrics.jsonl`` row."""


class StepLog:
    """Call ``open()`` before ``write()``, from the loop's thread; the constructor does no I/O."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: IO[str] | None = None
        self._listeners: list[StepListener] = []

    def listen(self, listener: StepListener) -> None:
        self._listeners.append(listener)

    def open(self) -> None:
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (owned until close)

    def write(self, record: JobStep, row: dict[str, Any]) -> None:
        """Append the step's row (flushed: ``babysit status`` reads it live), then tell every
        listener."""
        if self._file is None:
            raise RuntimeError("StepLog.write() before open()")
        self._file.write(json.dumps(json_safe(row), separators=(",", ":")) + "\n")
        self._file.flush()
        for listener in self._listeners:
            listener(record, row)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
