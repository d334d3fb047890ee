"""torch's NCCL flight recorder, pointed at the attempt's folder and collected on a hang.

The flight recorder is a ring buffer, in every rank, of the last collectives each process group
issued (which op, sizes, state: scheduled, started, completed). After a hang it answers the
question stacks cannot: which collective each rank is in, and which rank never entered it.
torch writes it to ``<prefix><rank>`` when the NCCL watchdog times out, or when something
writes to the rank's named pipe ``<pipe prefix><rank>.pipe``.

babysit sets, in the ranks' environment, unless the user (or ``launch.env``) already set any
name of the same setting:

    TORCH_FR_BUFFER_SIZE / TORCH_NCCL_TRACE_BUFFER_SIZE     entries kept (torch 2.13: 2000
                                                            by default; older torch: 0, off)
    TORCH_FR_DUMP_TEMP_FILE / TORCH_NCCL_DEBUG_INFO_TEMP_FILE   attempts/<n>/flight_recorder/rank_
    TORCH_NCCL_DEBUG_INFO_PIPE_FILE                         attempts/<n>/flight_recorder/rank_
    TORCH_NCCL_DUMP_ON_TIMEOUT                              1

A renamed setting is set under the one name the installed torch reads: the newest of its names
that torch's native libraries hold (``torch_reads``: their read-only data searched for the name,
a few tens of MB, once per process). torch 2.13 reads both names of a renamed setting but warns,
in every rank of every attempt, about the old one ("Environment variable
TORCH_NCCL_TRACE_BUFFER_SIZE is deprecated"); torch before the rename knows only the old one.
Where the libraries cannot be read (another interpreter runs the ranks: ``launch.python``), or
hold none of a setting's names, every name is set, so any torch from 2.4 on reads one.

On a hang babysit acts before NCCL's own timeout (docs/gpu.md says how to keep it so), so it
asks for the dump itself: ``collect`` writes to every rank's pipe, waits a moment for the
files, and copies them into the incident folder. Other incidents (a crash after NCCL's
watchdog fired, a rollback) only copy the dumps already written: nothing is waited for. With
gloo (no NCCL) there are no pipes and ``collect`` costs one directory listing.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import importlib.util
import mmap
import os
import shutil
import struct
import sys
import time
from collections.abc import Collection, Mapping
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


def environment(attempt_dir: Path, env: Mapping[str, str],
                reads: Collection[str] | None = None) -> dict[str, str]:
    """The variables to add to the ranks' environment ``env`` so that torch's flight recorder
    records and dumps into ``attempt_dir/flight_recorder``. Pure: creates nothing (``prepare``
    makes the folder). A setting any of whose names is already in ``env`` is left to the user:
    none of its names is returned. ``reads``: the names the ranks' torch reads (``torch_reads``);
    a renamed setting goes under the newest of its names in it, or under all of them when none
    is (or ``reads`` is None: not known)."""
    prefix = str(attempt_dir / FOLDER / PREFIX)
    added: dict[str, str] = {}
    for names, value in _SETTINGS:
        if any(name in env for name in names):
            continue
        read = [name for name in names if reads is not None and name in reads][:1]
        added.update({name: prefix if value is None else value for name in read or names})
    return added


NAMES = tuple(name for names, _ in _SETTINGS for name in names)
"""Every name of every setting, newest first within each."""

LIBRARIES = ("libtorch_cpu", "libtorch_cuda", "libtorch")
"""torch's native libraries that read the settings (c10d, the flight recorder, NCCL's group)."""


@functools.cache
def torch_reads(python: str | None = None) -> frozenset[str] | None:
    """The names of ``NAMES`` that the torch this interpreter imports reads (holds in its native
    libraries), or None when that cannot be told: ``python`` is another interpreter than this
    one, or no library of torch's was found or read. Reads files; cached for the process."""
    if python is not None and os.path.realpath(python) != os.path.realpath(sys.executable):
        return None
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    lib = Path(next(iter(spec.submodule_search_locations))) / "lib"
    found: set[str] = set()
    searched = False
    for stem in LIBRARIES:
        for path in sorted(lib.glob(f"{stem}.*")):
            if path.suffix not in (".so", ".dylib"):
                continue
            try:
                found |= _names_in(path, NAMES)
                searched = True
            except (OSError, ValueError):
                continue
    return frozenset(found) if searched else None


def _names_in(path: Path, names: tuple[str, ...]) -> set[str]:
    """Which of ``names`` ``path`` holds as C strings, searched in its ``.rodata`` section when
    it is an ELF file whose section table says where that is (18 MB of torch 2.13's 430 MB
    libtorch_cpu), else in the whole file."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        start, end = _rodata(m) or (0, len(m))
        return {name for name in names if m.find(name.encode() + b"\0", start, end) >= 0}


def _rodata(m: mmap.mmap) -> tuple[int, int] | None:
    """The file offsets of a little-endian 64-bit ELF file's ``.rodata`` section, or None."""
    if m[:6] != b"\x7fELF\x02\x01":
        return None
    shoff = struct.unpack_from("<Q", m, 0x28)[0]
    entsize, count, names_at = struct.unpack_from("<HHH", m, 0x3A)
    if not shoff or entsize < 64 or names_at >= count or shoff + entsize * count > len(m):
        return None

    def section(i: int) -> tuple[int, int, int]:
        name, _, _, _, offset, size = struct.unpack_from("<IIQQQQ", m, shoff + i * entsize)
        return name, offset, size

    _, table, _ = section(names_at)
    for i in range(count):
        name, offset, size = section(i)
        if m[table + name:table + name + 8] == b".rodata\0" and offset + size <= len(m):
            return offset, offset + size
    return None


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
