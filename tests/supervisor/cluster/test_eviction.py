"""Machine faults traced to one node, and when that node is taken out (``cluster.eviction``).
Pure."""

from __future__ import annotations

import signal
from typing import Any

from babysit.policies.types import Finding, Incident, Severity
from babysit.supervisor.cluster.eviction import NodeFaults, machine_fault


def crash(node: int, step: int, **evidence: Any) -> Finding:
    return Finding(incident=Incident.CRASH, detector="crash", severity=Severity.CRITICAL,
                   step=step, onset_step=step, message="m", ranks=(2,),
                   evidence={"node": node, "host": f"gpu-{node}", **evidence})


SEGV = {"class": "signal", "signal": int(signal.SIGSEGV)}


def test_only_the_machines_faults_count() -> None:
    assert machine_fault(crash(1, 5, **SEGV)) == "SIGSEGV"
    assert machine_fault(crash(1, 5, **{"class": "hardware"})) == "hardware crash"
    assert machine_fault(crash(1, 5, **{"class": "signal", "signal": 9})) is None  # OOM killer?
    assert machine_fault(crash(1, 5, **{"class": "user_code"})) is None
    assert machine_fault(crash(1, 5, **{"class": "oom"})) is None
    hang = Finding(incident=Incident.HANG, detector="hang", severity=Severity.CRITICAL, step=5,
                   onset_step=5, message="m", evidence={"node": 1})
    assert machine_fault(hang) is None


def test_the_second_fault_on_the_same_node_makes_it_evictable_once() -> None:
    faults = NodeFaults(evict_after=2)
    assert faults.add(crash(1, 10, **SEGV)) is None
    assert faults.add(crash(2, 12, **SEGV)) is None  # another node: its own count
    assert faults.add(crash(1, 25, **{"class": "user_code"})) is None  # the job's, not counted
    why = faults.add(crash(1, 31, **{"class": "hardware"}))
    assert why == "2 machine faults on it: SIGSEGV at step 10, hardware crash at step 31"
    assert faults.add(crash(1, 40, **SEGV)) is None  # already said


def test_evict_after_zero_never_evicts() -> None:
    faults = NodeFaults(evict_after=0)
    assert all(faults.add(crash(1, s, **SEGV)) is None for s in range(5))


def test_a_fault_that_followed_the_data_is_forgiven() -> None:
    # A decoder that segfaults on one corrupt sample, at the same batch (and step) twice: the
    # rules skip the batch (the data's); the node it ran on is not to blame.
    faults = NodeFaults(evict_after=2)
    assert faults.add(crash(1, 10, **SEGV)) is None
    assert faults.add(crash(1, 10, **SEGV)) is not None
    assert faults.forgive(1, crash(1, 10, **SEGV, follows="data"))
    assert faults.seen[1] == []
    assert not faults.forgive(1, crash(1, 10, **SEGV))  # nothing left to forgive
    assert not faults.forgive(1, crash(1, 12, **{"class": "user_code"}))  # never counted
    # Counting starts again from nothing: one more machine fault does not evict.
    assert faults.add(crash(1, 30, **SEGV)) is None
