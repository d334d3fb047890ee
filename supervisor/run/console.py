"""What a person watching babysit sees: worker output, decisions, and one live status line.

On a terminal the status line is redrawn in place under the scrolling output. When stdout is not a
terminal (CI logs, ``nohup``, a pipe) there are no control characters: the status is printed as a
plain line at most every ``plain_interval_s`` seconds.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Mapping
from typing import Any, TextIO

from babysit.supervisor.node.standby import CONFIGURED_OFF


class Console:
    def __init__(self, stream: TextIO | None = None, tty: bool | None = None,
                 plain_interval_s: float = 10.0) -> None:
        self._out = stream if stream is not None else sys.stdout
        self._tty = self._out.isatty() if tty is None else tty
        self._plain_interval_s = plain_interval_s
        self._status = ""
        self._last_plain = 0.0
        self._launched = False

    def log(self, text: str) -> None:
        """A permanent line (worker output, a decision)."""
        if self._tty and self._status:
            self._out.write("\r\x1b[K" + text + "\n" + self._fit(self._status))
        else:
            self._out.write(text + "\n")
        self._out.flush()

    def status(self, text: str, force: bool = False) -> None:
        """Replace the live status line (throttled to a plain line when not a terminal)."""
        self._status = text
        if self._tty:
            self._out.write("\r\x1b[K" + self._fit(text))
            self._out.flush()
            return
        now = time.monotonic()
        if force or now - self._last_plain >= self._plain_interval_s:
            self._last_plain = now
            self._out.write(text + "\n")
            self._out.flush()

    HEARS = ("just_in_time", "just_in_time_off", "resume", "launch", "memory_copy_plan",
             "memory_copy_off", "memory_copy_failed", "shared_memory_fallback")
    """Journal entries a person watching should read of (``hear``)."""

    def hear(self, entry: Mapping[str, Any]) -> None:
        """A journal entry of ``HEARS``: its summary, when it has one, as a line; and at the
        first launch, why no relaunch will be warm (the user's own choice needs no word)."""
        summary = entry.get("summary")
        if summary:
            self.log(f"babysit: {summary}")
        if entry.get("event") == "launch" and not self._launched:
            self._launched = True
            off = entry.get("standby_off")
            if off and off != CONFIGURED_OFF:
                self.log(f"babysit: relaunches will start cold: {off}")

    def close(self) -> None:
        """End the status line so the shell prompt starts on a fresh line."""
        if self._tty and self._status:
            self._out.write("\n")
            self._out.flush()
        self._status = ""

    def _fit(self, text: str) -> str:
        width = shutil.get_terminal_size((120, 24)).columns
        return text if len(text) < width else text[: width - 2] + "…"
