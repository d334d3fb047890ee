"""torch's NCCL flight recorder, pointed at the attempt's folder and collected on a hang.

The flight recorder is a ring buffer, in every rank, of the last collectives each process group
issued (which op, sizes, state: scheduled, started, completed). After a hang it answers the
question stacks cannot: which collective each rank is in, and which rank never entered it.
torch writes it to ``<prefix><rank>`` when the NCCL watchdog times out, or when something
writes to the rank's named pipe ``<pipe prefix><rank>.pipe``.

babysit sets, in the ranks' environment, unless the user (or ``launch.env``) already set any
name of the same setting (the names changed in torch 2.6; both are set, so any torch >= 2.4
reads one):

    TORCH_FR_BUFFER_SIZE / TORCH_NCCL_TRACE_BUFFER_SIZE     entries kept (torch 2.13: 2000
                                                            by default; older torch: 0, off)
    TORCH_FR_DUMP_TEMP_FILE / TORCH_NCCL_DEBUG_INFO_TEMP_FILE   attempts/<n>/flight_recorder/rank_
    TORCH_NCCL_DEBUG_INFO_PIPE_FILE                         attempts/<n>/flight_recorder/rank_
    TORCH_NCCL_DUMP_ON_TIMEOUT                              1

On a hang babysit acts before NCCL's own timeout (docs/gpu.md says how to keep it so), so it
asks for the dump itself: ``collect`` writes to every rank's pipe, waits a moment for the
files, and copies them into the incident folder. Other incidents (a crash after NCCL's
watchdog fired, a rollback) only copy the dumps already written: nothing is waited for. With
gloo (no NCCL) there are no pipes and ``collect`` costs one directory listing.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import time
from collections.abc import Mapping
from pathlib import Path

FOLDER = "flight_recorder"
"""The folder under each attempt's directory that torch writes its dumps into."""
PREFIX = "rank_"
"""File name prefix: torch appends the global rank (``rank_3``, ``rank_3.pipe``)."""

BUFFER_SIZE = 2000
"""Entries per rank: torch 2.13's own default, a few KB per entry, enough for minutes of a
typical job's collectives."""

# Each setting: its names (newest first) and babysit's value, or None for "the prefix".
_SETTINGS: tuple[tuple[tuple[str, ...], str | None], ...] = (
    (("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"), str(BUFFER_SIZE)),
    (("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"), None),
    (("TORCH_NCCL_DEBUG_INFO_PIPE_FILE",), None),
    (("TORCH_NCCL_DUMP_ON_TIMEOUT",), "1"),
)


def environment(attempt_dir: Path, env: Mapping[str, str]) -> dict[str, str]:
    """The variables to add to the ranks' environment ``env`` so that torch's flight recorder
    records and dumps into ``attempt_dir/flight_recorder``. Pure: creates nothing (``prepare``
    makes the folder). A setting any of whose names is already in ``env`` is left to the user:
    none of its names is returned."""
    prefix = str(attempt_dir / FOLDER / PREFIX)
    added: dict[str, str] = {}
    for names, value in _SETTINGS:
        if not any(name in env for name in names):
            added.update({name: prefix if value is None else value for name in names})
    return added


def prepare(attempt_dir: Path) -> None:
    """Create the folder torch writes into (torch does not create it)."""
    (attempt_dir / FOLDER).mkdir(parents=True, exist_ok=True)


def request_dumps(attempt_dir: Path) -> int:
    """Ask every rank of the attempt that opened a dump pipe to write its flight recorder now;
    returns how many were asked. Never blocks: a pipe with no reader (the rank is gone, or its
    torch does not watch it) is skipped."""
    asked = 0
    for pipe in sorted((attempt_dir / FOLDER).glob(f"{PREFIX}*.pipe")):
        try:
            fd = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno in (errno.ENXIO, errno.ENOENT, errno.EACCES):
                continue
            raise
        try:
            with contextlib.suppress(BlockingIOError, BrokenPipeError):
                os.write(fd, b"1\n")
                asked += 1
        finally:
            os.close(fd)
    return asked


def dumps(attempt_dir: Path) -> list[Path]:
    """The dump files the attempt's ranks wrote (not their pipes), by name."""
    return sorted(p for p in (attempt_dir / FOLDER).glob(f"{PREFIX}*")
                  if p.suffix != ".pipe" and p.is_file())


def _settled(paths: list[Path], quiet_s: float = 0.2, max_s: float = 2.0) -> list[Path]:
    """``paths`` once no size changed for ``quiet_s`` (torch writes a dump in place, not by
    rename, so a file may still be growing when it first appears)."""
    def sizes() -> list[int]:
        return [p.stat().st_size if p.exists() else -1 for p in paths]

    deadline = time.monotonic() + max_s
    before = sizes()
    while paths and time.monotonic() < deadline:
        time.sleep(quiet_s)
        now = sizes()
        if now == before:
            break
        before = now
    return [p for p in paths if p.exists()]


def collect(attempt_dir: Path, into: Path, ask: bool = True, wait_s: float = 5.0) -> list[Path]:
    """Copy the attempt's flight recorder dumps into ``into/flight_recorder``; returns the copies.

    With ``ask`` (a hang: the ranks are alive and stuck), ranks holding dump pipes are asked to
    dump first, and this waits up to ``wait_s`` seconds for one file per rank asked (torch's
    monitor thread polls its pipe about once a second). Dumps already there (written by NCCL's
    own watchdog timeout) are copied as they are."""
    asked = request_dumps(attempt_dir) if ask else 0
    deadline = time.monotonic() + wait_s
    while asked and len(dumps(attempt_dir)) < asked and time.monotonic() < deadline:
        time.sleep(0.1)
    found = _settled(dumps(attempt_dir))
    if not found:
        return []
    target = into / FOLDER
    target.mkdir(parents=True, exist_ok=True)
    return [Path(shutil.copy2(path, target / path.name)) for path in found]
