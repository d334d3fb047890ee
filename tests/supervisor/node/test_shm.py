"""This node's folder in shared memory (``supervisor/node/shm.py``): made, owned, removed at
the run's end, and what dead babysitters left removed by the next, never a live one's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from babysit.supervisor.node import shm
from babysit.supervisor.node.shm import LOCK, ORPHAN_AGE_S, OWNER, NodeMemory, sweep
from tests.conftest import ROOT


def test_each_run_and_node_has_its_own_folder_removed_at_the_end(tmp_path: Path) -> None:
    a = NodeMemory.of(tmp_path / "run", 0, where=tmp_path)
    b = NodeMemory.of(tmp_path / "run", 1, where=tmp_path)
    other = NodeMemory.of(tmp_path / "other", 0, where=tmp_path)
    assert len({a.root, b.root, other.root}) == 3
    assert NodeMemory.of(tmp_path / "run", 0, where=tmp_path) == a  # the same run's, again
    a.open()
    assert json.loads((a.root / OWNER).read_text())["pid"] == os.getpid()
    (a.marks / "0").mkdir(parents=True)
    (a.marks / "0" / "1").write_bytes(b"x" * 10)
    assert a.held_bytes() > 10
    a.close()
    assert not a.root.exists()


def test_a_dead_babysitters_folder_goes_a_live_ones_stays_and_our_own_is_adopted(
        tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    owner = json.dumps({"pid": int(dead.stdout), "started": 1.0, "run_dir": "?", "node": 0})
    live = NodeMemory.of(tmp_path / "live", 0, where=tmp_path)
    live.open()  # this process: alive
    gone = NodeMemory.of(tmp_path / "gone", 0, where=tmp_path)
    gone.root.mkdir()
    (gone.root / OWNER).write_text(owner)
    ours = NodeMemory.of(tmp_path / "ours", 0, where=tmp_path)
    ours.root.mkdir()  # our own run's, left by our predecessor: its memory copies are ours
    (ours.root / "memory").mkdir()
    (ours.root / OWNER).write_text(owner)
    fresh = tmp_path / "babysit-fresh"  # no owner yet: being made, or an older babysit's
    fresh.mkdir()
    old = tmp_path / "babysit-old"
    old.mkdir()
    os.utime(old, (time.time() - 2 * ORPHAN_AGE_S,) * 2)
    removed = ours.open()
    assert sorted(p.name for p in removed) == sorted([gone.root.name, old.name])
    assert live.root.exists() and fresh.exists() and (ours.root / "memory").exists()
    assert json.loads((ours.root / OWNER).read_text())["pid"] == os.getpid()
    assert sweep(tmp_path, keep=None) == []  # every folder left has a live owner or is young


# -- whose folder is alive: a lock its babysitter holds, not a pid ------------------------------

_HOLDER = """
import sys
from pathlib import Path
from babysit.supervisor.node.shm import NodeMemory
NodeMemory.of(Path(sys.argv[1]), 0, where=Path(sys.argv[2])).open()
print("held", flush=True)
sys.stdin.read()
"""
"""A babysitter in a process of its own: opens its run's folder, says so, and lives until its
stdin closes (or it is killed)."""


def _holder(tmp_path: Path, run: str, *prefix: str) -> subprocess.Popen[str]:
    child = subprocess.Popen([*prefix, sys.executable, "-c", _HOLDER, str(tmp_path / run),
                              str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert child.stdout is not None and child.stdout.readline() == "held\n"
    return child


def _foreign_owner(folder: Path, pid: int) -> None:
    """``owner.json`` naming ``pid``, as a babysitter in another PID namespace writes it (the
    pid means nothing here: here it may be anyone, or no one)."""
    (folder / OWNER).write_text(json.dumps({"pid": pid, "started": 1.0, "run_dir": "?",
                                            "node": 0}))


def test_a_folder_whose_babysitter_holds_its_lock_stays_whatever_its_pid_says(
        tmp_path: Path) -> None:
    child = _holder(tmp_path, "live")
    live = NodeMemory.of(tmp_path / "live", 0, where=tmp_path)
    assert (live.root / LOCK).exists()
    _foreign_owner(live.root, 999_999_999)  # a pid no process here has
    assert sweep(tmp_path) == [] and live.root.exists()
    child.kill()  # the babysitter dies: the kernel lets its lock go
    child.wait()
    assert sweep(tmp_path) == [live.root] and not live.root.exists()


def test_a_folder_whose_lock_is_free_goes_though_its_pid_is_a_live_process(
        tmp_path: Path) -> None:
    child = _holder(tmp_path, "gone")
    assert child.stdin is not None
    child.stdin.close()  # it ends without removing its folder (as a SIGKILL would leave it)
    child.wait()
    gone = NodeMemory.of(tmp_path / "gone", 0, where=tmp_path)
    me = psutil.Process()  # the pid and start time of a live process: this one
    (gone.root / OWNER).write_text(json.dumps({"pid": me.pid, "started": me.create_time(),
                                               "run_dir": "?", "node": 0}))
    assert sweep(tmp_path) == [gone.root]


def test_a_babysitter_in_another_pid_namespace_keeps_its_folder(tmp_path: Path) -> None:
    """Containers sharing a host's /dev/shm: the babysitter in the other PID namespace (with
    its own /proc, as a container has) is pid 1 there, a pid that here is init, started long
    before. By its pid it is dead; by its lock it lives."""
    unshare = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]
    if subprocess.run([*unshare, "true"], capture_output=True).returncode:
        pytest.skip("no new PID namespace here (unshare --pid needs root)")
    child = _holder(tmp_path, "contained", *unshare)
    contained = NodeMemory.of(tmp_path / "contained", 0, where=tmp_path)
    assert json.loads((contained.root / OWNER).read_text())["pid"] == 1
    assert shm._owner_alive(contained.root) is False  # the pid rule would remove a live one's
    assert sweep(tmp_path) == [] and contained.root.exists()
    assert child.stdin is not None
    child.stdin.close()
    child.wait()
    assert sweep(tmp_path) == [contained.root]


def test_a_lock_is_held_until_close_and_a_folder_is_adopted_by_its_next_babysitter(
        tmp_path: Path) -> None:
    ours = NodeMemory.of(tmp_path / "ours", 0, where=tmp_path)
    ours.open()
    assert sweep(tmp_path) == []  # this process holds it: another sweeper finds it alive
    ours.open()  # open again (a takeover in the same process): the lock it holds is kept
    (ours.root / "memory").mkdir()
    ours.close()
    assert not ours.root.exists()
    child = _holder(tmp_path, "dead")
    dead = NodeMemory.of(tmp_path / "dead", 0, where=tmp_path)
    (dead.root / "memory").mkdir()
    child.kill()
    child.wait()
    adopted = NodeMemory.of(tmp_path / "dead", 0, where=tmp_path)
    assert adopted.open() == [] and (adopted.root / "memory").exists()
    assert sweep(tmp_path) == []
    adopted.close()


def test_where_there_is_no_shared_memory_the_folder_goes_to_the_temporary_folder_and_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert shm.shm_missing(tmp_path / "none") == f"{tmp_path / 'none'} is not there"
    assert NodeMemory.of(tmp_path / "run", 0).fallback is None  # this machine has one
    monkeypatch.setattr(shm, "SHM", tmp_path / "none")
    assert shm.base() == Path(tempfile.gettempdir())
    fallen = NodeMemory.of(tmp_path / "run", 0)
    assert fallen.root.parent == Path(tempfile.gettempdir())
    assert fallen.fallback is not None and "is not there" in fallen.fallback
    assert "give the node a writable /dev/shm" in fallen.fallback
