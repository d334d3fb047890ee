"""Crash classification: what killed a worker, and is it going to happen again?

``classify`` is pure: it reads the exit status and the rank's log tail (the supervisor reads the
file) and returns a ``CrashVerdict``. Patterns are checked most specific first, because a log
tail often holds several: an OOM inside a NCCL call is an OOM; an illegal memory access that
surfaces as a NCCL error is a hardware-ish fault.

The signature is the last exception line (type and first line of the message) with everything
that varies between otherwise identical crashes normalised away: addresses, numbers, paths'
temp parts, PIDs. Two crashes with the same signature at the same step are *deterministic*: a
relaunch from the same checkpoint will reproduce it, so the policy stops instead of looping.
"""

from __future__ import annotations

import enum
import re
import signal as _signal
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from babysit.policies.types import Finding, Incident, Severity


class CrashClass(str, enum.Enum):
    OOM = "oom"
    NETWORK = "network"
    NUMERICAL = "numerical"
    HARDWARE = "hardware"
    USER_CODE = "user_code"
    DATA = "data"
    """A Python exception raised by the data loader as ``run.batches()`` drew a batch (a
    corrupt sample, an unreadable file): relaunched to see whether it comes back at the same
    batch (then that batch is skipped, ``policies.cause``)."""
    KILLED = "signal"
    """Killed by a signal with nothing in the log to say why (preemption, the OOM killer, a
    person)."""
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class CrashSignature:
    """What ``deterministic`` compares: the normalised signature and the step it crashed at."""

    signature: str
    step: int | None


@dataclass(frozen=True, slots=True)
class CrashVerdict:
    crash_class: CrashClass
    signature: str
    deterministic: bool
    reason: str
    """Which pattern matched, in words."""
    exit_code: int | None = None
    signal: int | None = None
    step: int | None = None
    said: str = ""
    """What the crash said, as it said it (the signature masks its numbers and temporary
    paths so that two crashes compare); empty when it is the signature itself."""

    def key(self) -> CrashSignature:
        return CrashSignature(self.signature, self.step)

    def to_finding(self, step: int | None = None, ranks: tuple[int, ...] = ()) -> Finding:
        at = self.step if step is None else step
        who = f" of rank {', '.join(map(str, ranks))}" if ranks else ""
        # A signal says nothing more in its signature; the reason carries the hint (the OOM
        # killer for a silent SIGKILL, native code for a SIGSEGV).
        why = f" ({self.reason})" if self.crash_class is CrashClass.KILLED else ""
        return Finding(
            incident=Incident.CRASH,
            detector="crash",
            severity=Severity.CRITICAL,
            step=at if at is not None else 0,
            onset_step=at if at is not None else 0,
            ranks=ranks,
            message=f"{self.crash_class.value} crash{who}"
            + (f" at step {at}" if at is not None else "")
            + f": {self.said or self.signature}{why}"
            + (" (same as a previous crash: deterministic)"
                                       if self.deterministic else ""),
            evidence=self.to_json(),
        )

    def to_json(self) -> dict[str, Any]:
        return {"class": self.crash_class.value, "signature": self.signature,
                "deterministic": self.deterministic, "reason": self.reason,
                "exit_code": self.exit_code, "signal": self.signal, "step": self.step,
                "said": self.said}


# (class, compiled pattern, reason). Order matters: first match wins.
_PATTERNS: list[tuple[CrashClass, re.Pattern[str], str]] = [
    (CrashClass.OOM, re.compile(
        r"CUDA out of memory|OutOfMemoryError|\bMemoryError\b|Cannot allocate memory|"
        r"out of memory|\boom[- ]?kill", re.I), "out-of-memory message in the log"),
    (CrashClass.HARDWARE, re.compile(
        r"\bXid\b|\bECC\b|uncorrectable|illegal memory access|unspecified launch failure|"
        r"GPU has fallen off the bus|device-side assert|hardware error", re.I),
     "GPU/driver fault in the log"),
    (CrashClass.NETWORK, re.compile(
        r"NCCL (?:error|WARN)|ncclInternalError|ncclSystemError|ncclRemoteError|"
        r"DistNetworkError|DistBackendError|\bc10d\b.*(?:error|fail)|gloo.*(?:connection|closed|"
        r"timed out|timeout)|Connection closed by peer|Connection reset|Connection refused|"
        r"Broken pipe|\bTimed out\b|timed out|Socket Timeout|ProcessGroup\w* .*(?:timeout|abort)",
        re.I), "collective/network error in the log"),
    (CrashClass.NUMERICAL, re.compile(
        r"FloatingPointError|\bnan\b|\binf\b.*loss|loss.*\binf\b|non-?finite", re.I),
     "non-finite numbers in the log"),
]

_TRACEBACK = re.compile(r"Traceback \(most recent call last\)")
_LOADER_FRAME = re.compile(r"supervisor[/\\]rank[/\\]api\.py\", line \d+, in _draw_batch\b")
"""The frame ``run.batches()`` draws each batch in (``rank.api._draw_batch``): an exception
whose traceback passes through it was raised by the data loader."""
# The exception line that ends a traceback: "pkg.mod.SomeError: message" or a bare "SomeError".
_EXC_LINE = re.compile(r"^(?:\[rank\d+\]:?\s*)?([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit|"
                       r"Warning|Failure|Timeout))\b:?\s*(.*)$")
_NORMALISE = [
    (re.compile(r"0x[0-9a-fA-F]+"), "0x?"),
    (re.compile(r"(/tmp|/var/tmp|/dev/shm)/\S+"), r"\1/?"),
    (re.compile(r"\d+(?:\.\d+)?(?:e[-+]?\d+)?"), "N"),
    (re.compile(r"\s+"), " "),
]


def _as_said(text: str) -> str:
    """A message as the script printed it, on one line and at most 200 characters."""
    return " ".join(text.split())[:200]


def _normalise(text: str) -> str:
    for pattern, repl in _NORMALISE:
        text = pattern.sub(repl, text)
    return text.strip()[:200]


_CHILD_HEADER = re.compile(r"^(?:\[rank\d+\]:?\s*)?Process [\w.-]+(?::\d+)*:$")
"""What ``multiprocessing`` prints before a child process's traceback ("Process
SpawnProcess-1:"): DCP's async checkpoint writer, a DataLoader worker."""


_CHAINED = re.compile(r"^(?:\[rank\d+\]:?\s*)?(?:During handling of the above exception|"
                      r"The above exception was the direct cause)")


@dataclass(frozen=True)
class _Raised:
    """What a log tail says was raised: by the process itself, and by children it started."""

    own: str | None
    """The last exception line that is not a child's (traceback or not)."""
    own_traceback: bool
    """The process printed a traceback of its own."""
    child: str | None
    """The last exception of a child's traceback (``_CHILD_HEADER``)."""
    own_text: str
    """The tail without its children's tracebacks: what the patterns read first."""
    child_text: str
    """The children's tracebacks alone."""


def _raised(log_tail: str) -> _Raised:
    """Tell the process's own exceptions from its children's. DCP's async checkpoint process
    prints EOFError when its parent dies, after the parent's own error or its SIGKILL."""
    own = child = None
    own_traceback = in_child = pending_child = last_was_child = False
    own_lines: list[str] = []
    child_lines: list[str] = []
    for line in log_tail.splitlines():
        text = line.strip()
        if not text:
            continue
        if _CHILD_HEADER.match(text) or (_CHAINED.match(text) and last_was_child):
            pending_child = True  # a chained exception stays in the process that raised it
            child_lines.append(line)
            continue
        if _TRACEBACK.search(text):
            in_child, pending_child = pending_child, False
            own_traceback = own_traceback or not in_child
        (child_lines if in_child else own_lines).append(line)
        if _TRACEBACK.search(text):
            continue
        pending_child = False
        m = _EXC_LINE.match(text)
        if m:
            message = m.group(2).strip()
            exc = f"{m.group(1)}: {message}" if message else m.group(1)
            if in_child:
                child = exc
            else:
                own = exc
            last_was_child, in_child = in_child, False
    return _Raised(own, own_traceback, child, "\n".join(own_lines), "\n".join(child_lines))


def _last_traceback(text: str) -> str:
    """The last traceback of ``text`` and what follows it (a chained exception's own)."""
    starts = [m.start() for m in _TRACEBACK.finditer(text)]
    return text[starts[-1]:] if starts else ""


def classify(
    exit_code: int | None,
    signal: int | None,
    log_tail: str,
    step: int | None,
    previous: Sequence[CrashSignature] = (),
) -> CrashVerdict:
    """Classify one worker's death.

    ``exit_code`` as the launcher saw it (``None`` if killed); ``signal`` the killing signal if
    any (a negative ``exit_code`` from ``subprocess`` means the same: -9 is SIGKILL); ``log_tail``
    the last few KB of the rank's output; ``step`` the last step it reported; ``previous`` the
    ``key()`` of earlier crashes of this run.
    """
    if signal is None and exit_code is not None and exit_code < 0:
        signal, exit_code = -exit_code, None
    if signal is None and exit_code is not None and exit_code > 128 and not log_tail.strip():
        signal = exit_code - 128
    raised = _raised(log_tail)
    cls, reason = CrashClass.UNKNOWN, "no recognisable error in the log"
    said_in = raised.own_text  # where the line that names the class is
    matched = _matching(raised.own_text)
    if matched is not None:
        cls, reason = matched
    elif raised.own_traceback and _LOADER_FRAME.search(_last_traceback(raised.own_text)):
        cls, reason = CrashClass.DATA, "Python exception in the data loader (run.batches())"
    elif raised.own is not None or raised.own_traceback:
        cls, reason = CrashClass.USER_CODE, "Python exception in the training script"
    elif signal is not None:
        # Only a child's traceback (say the EOFError or ConnectionResetError of DCP's async
        # checkpoint process whose parent was SIGKILLed): the signal is what ended this
        # process, and what the orphan said about its pipe is no network fault. An OOM kill
        # must not read as user code, which the default policy never relaunches.
        name = _signal_name(signal)
        hint = _SIGNAL_HINTS.get(signal, "")
        cls, reason = CrashClass.KILLED, f"killed by {name}{hint}"
    elif (matched := _matching(raised.child_text)) is not None:
        (cls, reason), said_in = matched, raised.child_text
    elif raised.child is not None:
        cls, reason = CrashClass.USER_CODE, "Python exception in a process the script started"
    exc = raised.own if raised.own is not None or signal is not None else raised.child
    said = ""
    if exc is not None:
        signature, said = _normalise(exc), _as_said(exc)
    elif signal is not None:
        signature = f"signal {_signal_name(signal)}"
    elif cls is not CrashClass.UNKNOWN:
        line = _first_match_line(said_in, cls)
        signature, said = _normalise(line), _as_said(line)
    else:
        signature = f"exit code {exit_code}"
    deterministic = step is not None and any(
        p.signature == signature and p.step == step for p in previous
    )
    return CrashVerdict(cls, signature, deterministic, reason, exit_code, signal, step,
                        said if said != signature else "")


_SIGNAL_HINTS: dict[int, str] = {
    _signal.SIGKILL: "; a silent SIGKILL is often the kernel OOM killer: check dmesg",
    _signal.SIGSEGV: "; a segmentation fault in native code (an extension, a driver, a bad "
                     "pointer); PYTHONFAULTHANDLER=1 prints the Python stack at the fault",
    _signal.SIGBUS: "; a bus error: often a full /dev/shm or a truncated memory-mapped file",
    _signal.SIGABRT: "; native code aborted (a failed C++ check or an uncaught C++ exception)",
}

STOP_SIGNALS: frozenset[int] = frozenset({_signal.SIGTERM, _signal.SIGINT, _signal.SIGHUP})
"""Signals a launcher or a person sends to stop a process: a rank dying of one was stopped,
it did not fail (torchrun sends SIGTERM to the survivors of a failure)."""


def _matching(text: str) -> tuple[CrashClass, str] | None:
    """The first pattern (most specific first) that ``text`` holds, with its reason."""
    for candidate, pattern, why in _PATTERNS:
        if pattern.search(text):
            return candidate, why
    return None


def _first_match_line(text: str, cls: CrashClass) -> str:
    pattern = next(p for c, p, _ in _PATTERNS if c is cls)
    for line in reversed(text.splitlines()):
        if pattern.search(line):
            return line
    return cls.value


def _signal_name(sig: int) -> str:
    try:
        return _signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"
