"""This node's folder in shared memory: the ranks' marks and memory copies, and nothing left
behind.

Host memory is the scarcest thing on a training node, and ``/dev/shm`` is memory that no
process frees by ending. Everything a babysitter's ranks keep there lives in one folder of the
run and the node, ``/dev/shm/babysit-<run>-n<node>/`` (``marks/``: ``checkpoints.mark``;
``memory/``: ``checkpoints.memory``), with an ``owner.json`` naming the babysitter that keeps
it (pid and process start time, the run directory, the node). The folder is removed when the
run ends, and a babysitter starting on a node removes the folders whose owner is gone, except
its own run's and node's (a babysitter taking over from one that died: the memory copies in
it are the run's). A folder of a live owner is never touched, whatever its run.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

PREFIX = "babysit-"
OWNER = "owner.json"
ORPHAN_AGE_S = 600.0
"""A folder with no owner file (a babysitter killed while making it, or an older babysit's) is
removed once nothing in it changed for this long."""


def base() -> Path:
    """Node-local shared memory, or the system's temporary folder where there is none."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


@dataclass(frozen=True, slots=True)
class NodeMemory:
    """The folder of one run's node (``root``)."""

    root: Path
    run_dir: str
    node: int

    @classmethod
    def of(cls, run_dir: Path, node: int, where: Path | None = None) -> NodeMemory:
        """The folder of the run in ``run_dir`` (the run's shared folder) on node ``node``."""
        run = str(Path(run_dir).resolve())
        tag = hashlib.sha1(run.encode()).hexdigest()[:12]
        return cls((where or base()) / f"{PREFIX}{tag}-n{node}", run, node)

    @property
    def marks(self) -> Path:
        return self.root / "marks"

    def open(self) -> list[Path]:
        """Make the folder and say it is this process's; remove what dead babysitters left on
        this node (``sweep``). Returns the folders removed."""
        removed = sweep(self.root.parent, keep=self.root)
        self.root.mkdir(parents=True, exist_ok=True)
        me = psutil.Process()
        tmp = self.root / f".{OWNER}.tmp"
        tmp.write_text(json.dumps({"pid": me.pid, "started": me.create_time(),
                                   "run_dir": self.run_dir, "node": self.node}))
        os.replace(tmp, self.root / OWNER)
        return removed

    def close(self) -> None:
        """The run is over on this node: nothing of it stays in memory."""
        shutil.rmtree(self.root, ignore_errors=True)

    def held_bytes(self) -> int:
        """What the folder holds now."""
        total = 0
        for dirpath, _dirs, files in os.walk(self.root):
            for name in files:
                with contextlib.suppress(OSError):
                    total += os.stat(os.path.join(dirpath, name)).st_size
        return total


def sweep(where: Path, keep: Path | None = None, now: float | None = None) -> list[Path]:
    """Remove every babysit folder in ``where`` whose owner is gone (its process dead, or its
    pid now another process's), but ``keep`` (this babysitter's own run and node: adopted);
    return those removed."""
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
        if _owner_alive(folder) or (_owner_alive(folder) is None
                                    and now - _newest_change(folder) < ORPHAN_AGE_S):
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


def _owner_alive(folder: Path) -> bool | None:
    """Whether the babysitter named in the folder's owner file still runs (None: no readable
    owner file)."""
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
