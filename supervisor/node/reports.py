"""What of an attempt's error reports reaches the console; the logs keep them whole.

torchrun answers a rank's death with a report of its own: its log lines about stopping the other
ranks, a Python traceback of the launcher (``node/ahead.py``'s frames where it was started
ahead, which reads as if babysit crashed), ``ChildFailedError`` and a table of the failed ranks
with their "Root Cause". babysit's own lines say it better: which rank, how, what it does about
it. So from the first line of such a report on, nothing more of that torchrun's reaches the
console, but one line naming its log (the attempt's ``launcher.log``), which keeps it whole and
from which babysit reads each rank's exit code.

A rank's traceback (its own crash, or a peer's seen from its side: gloo's "Connection closed by
peer") shows as one line: the exception, the innermost frame outside the Python and
site-packages trees, and the rank's log (``torchrun/.../<local rank>/stderr.log``), which keeps
it whole, as the incident folder's tail does.

Pure: fed the lines, it says what to print (``NodeWorkers.output`` prints it).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from babysit.supervisor.node.launcher import OutputLine, newest_state

REPORT_STARTS = re.compile(
    r"closing signal|failed \(exitcode: |^Traceback \(most recent call last\)|ChildFailedError|"
    r"^Root Cause")
"""A line of torchrun's that begins its report of a failed rank: its log line about stopping the
others ("Sending process 4960 closing signal SIGTERM"), the failure it logged ("failed (exitcode:
-11) local_rank: 1"), its own traceback, the error that ends it, the table's root cause."""

_TORCH_PREFIX = re.compile(r"^\[rank\d+\]:\s?")
"""torch's own prefix of what a rank's Python prints to stderr at its end ("[rank0]: ")."""
_TRACEBACK = "Traceback (most recent call last):"
_CHAINED = ("During handling of the above exception", "The above exception was the direct cause")
_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in (.+)$')
_LIBRARY = re.compile(r"[/\\](?:site-packages|dist-packages|lib[/\\]python\d[\d.]*)[/\\]|^<")
"""A frame in Python's own or an installed package's code (``<frozen runpy>`` too)."""
MESSAGE_CHARS = 240
"""An exception's message on the console is cut here (the log has it whole)."""


@dataclass
class _Traceback:
    frames: list[tuple[str, str, str]] = field(default_factory=list)
    """(file, line, function) of each frame, outermost first."""


class Reports:
    """One attempt's output on its way to the console (``NodeWorkers.output``). ``line`` takes
    a line and returns the console's lines in its place (none while it is held or withheld);
    ``flush`` returns what is still held, once the attempt's output ended.

    ``launcher_log``: the attempt's ``launcher.log``; ``rank_log(local_rank)``: that rank's
    stderr log, None when torchrun made none."""

    def __init__(self, launcher_log: Path, rank_log: Callable[[int], Path | None]) -> None:
        self.launcher_log = launcher_log
        self._rank_log = rank_log
        self.withheld = False
        """torchrun's failure report started: the rest of its output stays in its log."""
        self._held: dict[int, _Traceback] = {}
        """Local rank -> the traceback it is printing."""

    def line(self, line: OutputLine) -> list[str]:
        """The console's lines for ``line``: torchrun's with ``[torchrun]`` before it, a
        rank's with ``[r<local rank>]`` (a line redrawn with carriage returns: its newest
        state)."""
        if line.rank is None:
            return self.torchrun(line.text)
        return [f"[r{line.rank}] {newest_state(text)}" for text in self.rank(line.rank, line.text)]

    def torchrun(self, text: str) -> list[str]:
        """A line of torchrun's own: itself, or (at its failure report's first line) the line
        naming the log that keeps the report, or nothing (the rest of the report)."""
        if self.withheld:
            return []
        if REPORT_STARTS.search(text) is None:
            return [f"[torchrun] {text}"]
        self.withheld = True
        return [f"babysit: torchrun's report of the failure, whole: {self.launcher_log}"]

    def rank(self, rank: int, text: str) -> list[str]:
        """A line of local rank ``rank``'s, without its prefix: itself, or nothing while it is
        inside a traceback, or the traceback's one line at its end (the exception's)."""
        bare = _TORCH_PREFIX.sub("", text)
        held = self._held.get(rank)
        if bare.startswith(_TRACEBACK) or bare.startswith(_CHAINED):
            if held is None:  # a chained exception's goes on in the same line
                self._held[rank] = _Traceback()
            return []
        if held is None:
            return [text]
        if not bare.strip() or bare[:1].isspace():  # a frame, its source, the ^^^ under it
            frame = _FRAME.match(bare)
            if frame is not None:
                held.frames.append((frame.group(1), frame.group(2), frame.group(3)))
            return []
        del self._held[rank]  # the first line at the margin: the exception
        return [self._one_line(rank, bare.strip(), held)]

    def flush(self) -> list[str]:
        """The tracebacks still held (a rank that died while printing one), a line each."""
        held, self._held = self._held, {}
        return [f"[r{r}] " + self._one_line(r, "(a traceback cut short)", tb)
                for r, tb in sorted(held.items())]

    def _one_line(self, rank: int, exception: str, tb: _Traceback) -> str:
        if len(exception) > MESSAGE_CHARS:
            exception = exception[:MESSAGE_CHARS - 1] + "…"
        told = []
        own = [f for f in tb.frames if _LIBRARY.search(f[0]) is None] or tb.frames
        if own:
            told.append(f"at {Path(own[-1][0]).name}:{own[-1][1]} in {own[-1][2]}")
        log = self._rank_log(rank)
        if log is not None:
            told.append(f"the traceback, whole: {log}")
        return exception + (f" ({'; '.join(told)})" if told else "")
