"""This node's folder in shared memory: the ranks' marks and memory copies, and nothing left
behind.

Host memory is the scarcest thing on a training node, and ``/dev/shm`` is memory that no
process frees by ending. Everything a babysitter's ranks keep there lives in one folder of the
run and the node, ``/dev/shm/babysit-<run>-n<node>/`` (``marks/``: ``checkpoints.mark``;
``memory/``: ``checkpoints.memory``). The folder is removed when the run ends, and a
babysitter starting on a node removes the folders whose owner is gone, except its own run's
and node's (a babysitter taking over from one that died: the memory copies in it are the
run's). A folder of a live owner is never touched, whatever its run.

Who owns a folder is told by a lock, not a pid: its babysitter holds an exclusive ``flock`` on
the folder's ``owner.lock`` for the run's life, and the kernel lets it go when that process
ends, however it ends. A sweeper that can take the lock knows the owner is gone. A pid says
nothing across PID namespaces: containers that share a host's ``/dev/shm`` each number their
processes from 1, so one babysitter's pid may be another container's live process, or its own
live owner's pid not even exist here. ``owner.json`` (pid and start time, the run directory,
the node) is still written, for a person reading the folder; a folder without a lock file (an
older babysit's) is judged by it as before.

``/dev/shm`` itself may be missing or read-only (some containers): the folder then goes to the
system's temporary folder, on disk, and ``NodeMemory.fallback`` says why, for the console.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from babysit.checkpoints.capacity import held_bytes

PREFIX = "babysit-"
OWNER = "owner.json"
LOCK = "owner.lock"
"""The file whose ``flock`` the folder's babysitter holds while it lives."""
SHM = Path("/dev/shm")
ORPHAN_AGE_S = 600.0
"""A folder with no owner file (a babysitter killed while making it, or an older babysit's) is
removed once nothing in it changed for this long."""


def base() -> Path:
    """Node-local shared memory, or the system's temporary folder where there is none."""
    return SHM if shm_missing() is None else Path(tempfile.gettempdir())


def shm_missing(shm: Path | None = None) -> str | None:
    """Why ``shm`` (``/dev/shm``) cannot hold the node's folder (not there, or not writable);
    None: it can."""
    shm = SHM if shm is None else shm
    if not shm.is_dir():
        return f"{shm} is not there"
    if not os.access(shm, os.W_OK):
        return f"{shm} is not writable"
    return None


@dataclass(slots=True)
class NodeMemory:
    """The folder of one run's node (``root``). ``open`` and ``close`` it in one process: that
    process holds the folder's lock in between."""

    root: Path
    run_dir: str
    node: int
    _lock: int | None = field(default=None, compare=False, repr=False)
    """The open ``owner.lock`` whose ``flock`` this process holds (between ``open`` and
    ``close``)."""

    @classmethod
    def of(cls, run_dir: Path, node: int, where: Path | None = None) -> NodeMemory:
        """The folder of the run in ``run_dir`` (the run's shared folder) on node ``node``."""
        run = str(Path(run_dir).resolve())
        tag = hashlib.sha1(run.encode()).hexdigest()[:12]
        return cls((where or base()) / f"{PREFIX}{tag}-n{node}", run, node)

    @property
    def marks(self) -> Path:
        return self.root / "marks"

    @property
    def fallback(self) -> str | None:
        """Why the folder is not in ``/dev/shm`` (its copies and marks then live on disk, in
        the temporary folder, and outlive nothing a node's memory would not); None: it is."""
        if self.root.parent == SHM:
            return None
        why = shm_missing()
        return None if why is None else f"{why}: memory copies and step marks go to " \
            f"{self.root.parent} instead, on disk (give the node a writable /dev/shm)"

    def open(self) -> list[Path]:
        """Make the folder, take its lock for this process's life and write who owns it;
        remove what dead babysitters left on this node (``sweep``). Returns the folders
        removed."""
        removed = sweep(self.root.parent, keep=self.root)
        if self._lock is None:
            self._lock = _own(self.root)
        me = psutil.Process()
        tmp = self.root / f".{OWNER}.tmp"
        tmp.write_text(json.dumps({"pid": me.pid, "started": me.create_time(),
                                   "run_dir": self.run_dir, "node": self.node}))
        os.replace(tmp, self.root / OWNER)
        return removed

    def close(self) -> None:
        """The run is over on this node: nothing of it stays in memory. The lock goes last, so
        that no sweeper meets a half-removed folder it could take for a dead one's."""
        shutil.rmtree(self.root, ignore_errors=True)
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    def held_bytes(self) -> int:
        """What the folder holds now."""
        return held_bytes(self.root)


OWN_TRIES = 50
"""How often ``_own`` tries a lock that is held (every 0.1 s): a sweeper holds a dead owner's
lock only while it removes the folder."""


def _own(root: Path) -> int | None:
    """Make ``root`` and hold its lock: the open lock file, or None where another live process
    holds it still after ``OWN_TRIES`` (a second babysitter of the same run and node: the
    folder is then shared, and stays while either lives). A lock taken on a file a sweeper
    removed meanwhile is let go and taken again on a new folder."""
    for _ in range(OWN_TRIES):
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(root / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            time.sleep(0.1)
            continue
        if _same_file(fd, root / LOCK):
            return fd
        os.close(fd)  # a sweeper removed the folder while we waited for its lock
    return None


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except OSError:
        return False


def sweep(where: Path, keep: Path | None = None, now: float | None = None) -> list[Path]:
    """Remove every babysit folder in ``where`` whose owner is gone (its lock free; a folder
    without a lock file: its owner's process dead, or its pid now another process's), but
    ``keep`` (this babysitter's own run and node: adopted); return those removed."""
    now = time.time() if now is None else now
    removed = []
    try:
        names = sorted(n for n in os.listdir(where) if n.startswith(PREFIX))
    except OSError:
        return []
    for name in names:
        folder = where / name
        if folder == keep or not folder.is_dir():
            continue
        if _remove_if_gone(folder, now):
            removed.append(folder)
    return removed


def _remove_if_gone(folder: Path, now: float) -> bool:
    """Remove ``folder`` if its owner is gone; whether it was removed. With a lock file, the
    lock is taken (without waiting) and held while the folder goes: a babysitter adopting the
    folder meanwhile waits for it and makes a new one."""
    try:
        fd = os.open(folder / LOCK, os.O_RDONLY)
    except FileNotFoundError:
        return _remove_unlocked(folder, now)
    except OSError:  # not ours to judge (another user's folder): left alone
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False  # its owner lives
    try:
        shutil.rmtree(folder, ignore_errors=True)
    finally:
        os.close(fd)
    return True


def _remove_unlocked(folder: Path, now: float) -> bool:
    """The rule of a folder with no lock file (an older babysit's, or one being made): gone
    when its ``owner.json`` names a process that is gone, or, with no owner file, once nothing
    in it changed for ``ORPHAN_AGE_S``."""
    alive = _owner_alive(folder)
    if alive or (alive is None and now - _newest_change(folder) < ORPHAN_AGE_S):
        return False
    shutil.rmtree(folder, ignore_errors=True)
    return True


def _owner_alive(folder: Path) -> bool | None:
    """Whether the babysitter named in the folder's owner file still runs (None: no readable
    owner file). Only for folders without a lock file: a pid is only meaningful in the PID
    namespace that wrote it."""
    try:
        owner = json.loads((folder / OWNER).read_text())
        pid, started = int(owner["pid"]), float(owner["started"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    try:
        return abs(psutil.Process(pid).create_time() - started) < 1.0
    except psutil.Error:
        return False


def _newest_change(folder: Path) -> float:
    newest = 0.0
    for dirpath, _dirs, files in os.walk(folder):
        for name in [".", *files]:
            with contextlib.suppress(OSError):
                newest = max(newest, os.stat(os.path.join(dirpath, name)).st_mtime)
    return newest
