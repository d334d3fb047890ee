"""This node's folder in shared memory (``supervisor/node/shm.py``): made, owned, removed at
the run's end, and what dead babysitters left removed by the next, never a live one's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from babysit.supervisor.node.shm import ORPHAN_AGE_S, OWNER, NodeMemory, sweep


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
