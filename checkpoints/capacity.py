"""How much room a node leaves its memory copies (``checkpoints/memory_copy.py``): the least of
the shared-memory filesystem's free space, the container's memory limit and the host's memory.

Torch-free and pure but for the three readings (``room``). Each limit is real on its own:

- ``/dev/shm`` is a tmpfs of its own size: Docker's default is 64 MiB, and a copy that does not
  fit fails with "No space left on device" however much memory the host has.
- A container's (or a Slurm job's) memory limit is its cgroup's: pages written into ``/dev/shm``
  are charged to it, and past it the kernel kills a rank, while the host looks half empty.
- The host's available memory is what every container on it shares.

The cgroup is found from ``/proc/self/cgroup``: v2's ``memory.max`` and ``memory.current``, v1's
``memory.limit_in_bytes`` and ``memory.usage_in_bytes``, at the process's own cgroup and every
ancestor (a limit set on a parent binds its children too). What the cgroup uses is counted
without its inactive file cache (``memory.stat``'s ``inactive_file``), as ``docker stats`` and
the kubelet count it: the kernel drops that cache before it fails a charge, and a node that
just wrote a checkpoint to disk would otherwise look full.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

UNLIMITED = 1 << 62
"""A cgroup v1 limit this large or larger is no limit (v1 says "none" as a page count's maximum,
9223372036854771712)."""
PROC_CGROUP = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True, slots=True)
class Room:
    """What one node leaves its memory copies, in bytes (None: no such limit there)."""

    folder: str
    """Where the copies go (a folder in ``/dev/shm``, or the temporary folder babysit fell back
    to)."""
    shm: int | None
    """Free space of the filesystem ``folder`` is on."""
    cgroup: int | None
    """What the cgroup's memory limit leaves."""
    host: int
    """The host's available memory."""
    held: int = 0
    """What the copies already in ``folder`` hold: a relaunch's copies are pruned before the
    next is written, so this is room for them too."""


def room(folder: Path, held: int = 0, *, proc_cgroup: Path = PROC_CGROUP,
         cgroup_root: Path = CGROUP_ROOT) -> Room:
    """The room this machine leaves copies written into ``folder`` now."""
    import psutil

    return Room(str(folder), free_space(folder), cgroup_free(proc_cgroup, cgroup_root),
                int(psutil.virtual_memory().available), held)


def free_space(folder: Path) -> int | None:
    """Free bytes of the filesystem ``folder`` (or its nearest existing parent) is on; None
    when none can be read."""
    here = Path(folder)
    while not here.exists() and here != here.parent:
        here = here.parent
    try:
        return shutil.disk_usage(here).free
    except OSError:
        return None


def cgroup_free(proc_cgroup: Path = PROC_CGROUP, cgroup_root: Path = CGROUP_ROOT) -> int | None:
    """What this process's memory cgroup limits leave, the tightest of its own and its
    ancestors' (v2, else v1); None where no limit is set or none can be read."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    found: list[int] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _id, controllers, path = parts
        if controllers == "":  # v2's unified hierarchy
            found += _levels(cgroup_root, path, _v2_free)
        elif "memory" in controllers.split(","):
            found += _levels(cgroup_root / controllers, path, _v1_free)
    return min(found) if found else None


def _levels(mount: Path, path: str, read: Callable[[Path], int | None]) -> list[int]:
    """``read`` at the cgroup ``path`` under ``mount`` and each of its ancestors that is there.
    Inside a container the path is often the host's (``/docker/<id>``, or one climbing out of
    a cgroup namespace with ``..``) while ``mount`` is the container's own cgroup: the walk up
    then meets the mount's root, which is that cgroup."""
    parts = [p for p in path.split("/") if p and p != "."]
    if ".." in parts:
        parts = []
    found = []
    for depth in range(len(parts), -1, -1):
        value = read(mount.joinpath(*parts[:depth]))
        if value is not None:
            found.append(value)
    return found


def _v2_free(cgroup: Path) -> int | None:
    limit = _number(cgroup / "memory.max")
    used = _number(cgroup / "memory.current")
    if limit is None or used is None:
        return None
    return max(0, limit - (used - _stat(cgroup, "inactive_file")))


def _v1_free(cgroup: Path) -> int | None:
    limit = _number(cgroup / "memory.limit_in_bytes")
    used = _number(cgroup / "memory.usage_in_bytes")
    if limit is None or used is None or limit >= UNLIMITED:
        return None
    cache = _stat(cgroup, "total_inactive_file") or _stat(cgroup, "inactive_file")
    return max(0, limit - (used - cache))


def _number(path: Path) -> int | None:
    """A cgroup file's one number; None for "max" (no limit) or a file not there."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat(cgroup: Path, key: str) -> int:
    """One counter of the cgroup's ``memory.stat`` (0 when not there)."""
    try:
        for line in (cgroup / "memory.stat").read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return 0


def shortfall(need: int, room: Room, node: int, copies: int) -> str | None:
    """Why ``need`` bytes of copies (``copies`` of node ``node``'s ranks' state and of its
    peer's) do not fit in ``room``, and what to change; None when they fit. Shared memory may
    fill up to its size; of the memory a limit leaves, the copies take at most half (the
    training needs the rest)."""
    more = need - room.held
    what = f"the copies need about {size(need)} on node {node} ({copies} copies of its ranks' " \
           "state and of its peer's)"
    off = "or set checkpoints.memory_every_steps: 0"
    if room.shm is not None and more > room.shm:
        if not room.folder.startswith("/dev/shm"):
            return (f"{what}, more than the {size(room.shm + room.held)} free in {room.folder} "
                    f"(no writable /dev/shm there): give the node a /dev/shm of at least "
                    f"{size(_suggested(need))}, {off}")
        return (f"{what}, more than the {size(room.shm + room.held)} free in /dev/shm there: "
                f"give node {node} a /dev/shm of at least {size(_suggested(need))} (docker run "
                f"--shm-size={_suggested(need) >> 20}m; Kubernetes: an emptyDir with medium: "
                f"Memory mounted on /dev/shm), {off}")
    if room.cgroup is not None and more > room.cgroup / 2 and room.cgroup < room.host:
        return (f"{what}, more than half the {size(room.cgroup + room.held)} that its memory "
                f"limit (its container's or job's cgroup) leaves free: raise the memory limit, "
                f"{off}")
    if more > room.host / 2:
        return (f"{what} of host memory, more than half the {size(room.host + room.held)} free "
                f"there: free host memory, {off}")
    return None


def _suggested(need: int) -> int:
    """A shared-memory size that fits ``need`` with a quarter to spare (the ranks' marks, the
    next copy's files before the oldest is pruned), rounded up to a GiB above 1 GiB, else to
    64 MiB."""
    want = need + need // 4
    step = 1 << 30 if want > 1 << 30 else 64 << 20
    return -(-want // step) * step


def size(count: float) -> str:
    """Bytes as a person reads them: 20 KiB, 3.5 MiB, 1.2 GiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{int(count)} bytes"


def held_bytes(folder: Path) -> int:
    """What the files under ``folder`` hold now (0 when it is not there)."""
    total = 0
    for dirpath, _dirs, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(dirpath, name)).st_size
    return total
