"""Requests to the running attempt: the control file beside its directive.

The directive is fixed for an attempt; the control file (``directive.CONTROL_FILE``, its contract
is documented there) carries what changes while it runs: a final checkpoint before preemption,
a new checkpoint cadence. Ranks ``stat`` it between steps. Writes are whole and atomic, and keep
every key set earlier in the attempt, so one request never erases another.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from babysit.supervisor.contract.directive import CONTROL_FILE


class ControlFile:
    def __init__(self) -> None:
        self.path: Path | None = None
        self._keys: dict[str, Any] = {}

    def new_attempt(self, attempt_dir: Path) -> None:
        """A new attempt starts from its directive alone: forget earlier requests."""
        self.path = attempt_dir / CONTROL_FILE
        self._keys = {}

    def request(self, **keys: Any) -> None:
        """Add ``keys`` to the attempt's requests and write them all (temp file + rename, so a
        rank never reads half a file)."""
        if self.path is None:
            raise RuntimeError("no attempt launched yet")
        self._keys.update(keys)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self._keys))
        os.replace(tmp, self.path)
