"""Slow work that is not a hang, on real processes: what the hang confirmation
(``hang.confirm``) sees of each shape a healthy rank can take when it goes seconds
without a step and without ``phase()``: a slow loader (the rank waits on a busy child), checkpoint
I/O (writes and fsyncs), a GC pause over a big object graph, and a CPU-bound eval. Each is a real
Python process read with the real py-spy and psutil; every one must be cleared (keep watching),
and a truly idle one confirmed. The torchrun path around it (suspicion, deferral, no action) is
``tests/e2e/test_blame.py``'s attempt 4.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from babysit.policies.types import Finding, Incident, Severity
from babysit.supervisor.node.hang import confirm

pytestmark = pytest.mark.e2e  # real processes, read by py-spy

SHAPES = {
    "a slow loader": """
import subprocess, sys
subprocess.run([sys.executable, "-c", "while True: sum(i * i for i in range(10000))"])
""",
    "checkpoint I/O": """
import os, sys
chunk = os.urandom(1 << 20)
with open(sys.argv[1], "wb") as f:
    while True:
        for _ in range(16):
            f.write(chunk)
        f.flush(); os.fsync(f.fileno()); f.seek(0)
""",
    "a GC pause": """
import gc
class Node:
    def __init__(self, other): self.other = other
while True:
    nodes = [Node(None) for _ in range(300_000)]
    for a, b in zip(nodes, nodes[1:]): a.other = b
    nodes[-1].other = nodes[0]
    gc.collect()
""",
    "an eval without phase()": """
def evaluate():
    while True:
        sum(i * i for i in range(10000))
evaluate()
""",
}


@pytest.fixture
def rank(tmp_path: Path) -> Iterator[dict[str, int]]:
    """Start the shapes as real processes; yields name -> pid, stops them all after."""
    procs = {name: subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "ckpt.bin")])
             for name, code in SHAPES.items()}
    procs["idle"] = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    time.sleep(1.5)  # past interpreter start-up: each is in its steady shape
    try:
        yield {name: p.pid for name, p in procs.items()}
    finally:
        tree = [psutil.Process(p.pid) for p in procs.values()]
        tree += [c for p in tree for c in p.children(recursive=True)]  # the loader's child
        for p in tree:
            p.kill()
        psutil.wait_procs(tree, timeout=10)
        for child in procs.values():
            child.wait()


def test_slow_work_is_cleared_and_an_idle_rank_is_confirmed(rank: dict[str, int]) -> None:
    suspicion = Finding(Incident.HANG, "hang", Severity.CRITICAL, 10, 10, "no step for 2 s",
                        evidence={"confirm": True})
    for name in SHAPES:
        seen = confirm(suspicion, {0: rank[name]})
        assert seen.finding is None, (name, seen.fields)  # working: keep watching
        assert not seen.fields["hung"] and "working" in seen.fields["reason"], (name, seen.fields)
    seen = confirm(suspicion, {0: rank["idle"]})
    assert seen.finding is not None and seen.fields["hung"], seen.fields
    assert "no rank makes CPU progress" in seen.fields["reason"]
    assert seen.finding.evidence["processes"]["0"]["pid"] == rank["idle"]
