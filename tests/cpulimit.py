"""A real CPU limit for tests: a cgroup with a CFS quota, as a slow or throttled machine.

Processes moved into it get ``quota_us`` of CPU per ``period_us`` (1000 of 10000: a tenth of
one core), their children too. cgroup v1's ``cpu`` controller (``cpu.cfs_quota_us``) or v2's
``cpu.max``. The group is created by the test and removed after it (its processes moved back
to the root group first); nothing else is ever put in it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

V1 = Path("/sys/fs/cgroup/cpu")
V2 = Path("/sys/fs/cgroup")


def _root() -> tuple[Path, int] | None:
    if (V1 / "cpu.cfs_quota_us").exists():
        return V1, 1
    controllers = V2 / "cgroup.controllers"
    if controllers.exists() and "cpu" in controllers.read_text().split():
        return V2, 2
    return None


def available() -> str | None:
    """Why a CPU limit cannot be made here, or None when it can."""
    if os.geteuid() != 0:
        return "cgroups need root"
    if _root() is None:
        return "no cgroup cpu controller (v1 cpu.cfs_quota_us or v2 cpu.max) is mounted"
    return None


class CpuLimit:
    def __init__(self, path: Path, version: int, root: Path) -> None:
        self.path, self.version, self.root = path, version, root

    def add(self, pid: int) -> None:
        """Move process ``pid`` (all its threads) into the group."""
        (self.path / "cgroup.procs").write_text(f"{pid}\n")


@contextlib.contextmanager
def cpu_limit(quota_us: int, period_us: int = 10000) -> Iterator[CpuLimit]:
    found = _root()
    assert found is not None, available()
    root, version = found
    path = root / f"babysit-test-{os.getpid()}"
    path.mkdir(exist_ok=True)
    if version == 1:
        (path / "cpu.cfs_period_us").write_text(str(period_us))
        (path / "cpu.cfs_quota_us").write_text(str(quota_us))
    else:
        (path / "cpu.max").write_text(f"{quota_us} {period_us}")
    try:
        yield CpuLimit(path, version, root)
    finally:
        for pid in (path / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):  # gone meanwhile
                (root / "cgroup.procs").write_text(f"{pid}\n")
        with contextlib.suppress(OSError):
            path.rmdir()
