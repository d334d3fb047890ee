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


def sdc(node: int, step: int, rules: list[str]) -> Finding:
    return Finding(incident=Incident.SDC, detector="sdc", severity=Severity.CRITICAL, step=step,
                   onset_step=step - 4, message="m", ranks=(3,),
                   evidence={"node": node, "rules": rules, "check_step": step})


def test_a_corruption_the_vote_placed_on_a_node_makes_it_evictable_at_once() -> None:
    faults = NodeFaults(evict_after=2)
    assert machine_fault(sdc(1, 20, ["majority"])) == "silent data corruption"
    assert faults.add(sdc(1, 20, ["majority"])) == \
        "silent data corruption at step 20 on its rank(s)"
    # Two ranks that disagree with no majority: nobody can tell whose bits are wrong.
    assert machine_fault(sdc(2, 20, ["no_majority"])) is None
    assert faults.add(sdc(2, 20, ["no_majority"])) is None and 2 not in faults.seen
    assert NodeFaults(evict_after=0).add(sdc(1, 20, ["majority"])) is None


def test_a_gpu_fault_nvml_reported_on_a_node_makes_it_evictable_at_once() -> None:
    gpu = Finding(incident=Incident.GPU_FAULT, detector="gpu", severity=Severity.CRITICAL,
                  step=40, onset_step=31, message="m", ranks=(2, 3),
                  evidence={"node": 1, "gpus": {"0": ["Xid 79 (fallen off the bus)"]}})
    assert machine_fault(gpu) == "GPU fault"
    assert NodeFaults(evict_after=2).add(gpu) == \
        "GPU fault at step 40 (GPU 0: Xid 79 (fallen off the bus)) on its rank(s)"


def test_transient_faults_on_the_same_node_count_like_crashes() -> None:
    # A spike the rerun did not reproduce, first seen on a rank of node 1, twice.
    faults = NodeFaults(evict_after=2)
    assert faults.transient(1, 40) is None
    assert faults.transient(2, 50) is None
    assert faults.transient(1, 90) == \
        "2 machine faults on it: transient fault at step 40, transient fault at step 90"
    assert NodeFaults(evict_after=0).transient(1, 40) is None


def test_a_slow_node_is_worth_evicting_only_when_it_costs_more_than_a_relaunch() -> None:
    """Half the pace lost over an hour is 1,800 s of work; a relaunch of 40 s with a spare is
    far less, and so are 40 s plus a third of the work (1,200 s) on 2 of 3 nodes. 10% lost
    (360 s) is worth a spare's relaunch, not a third of the job; over 60 s, nothing is."""
    from babysit.supervisor.cluster.eviction import SlowCost

    def cost(slowdown: float, horizon_s: float, spare: bool) -> SlowCost:
        return SlowCost(slowdown=slowdown, horizon_s=horizon_s, relaunch_s=40.0, nodes=3,
                        spare=spare)

    assert cost(0.5, 3600, spare=True).evict and cost(0.5, 3600, spare=False).evict
    assert cost(0.1, 3600, spare=True).evict and not cost(0.1, 3600, spare=False).evict
    assert not cost(0.5, 60, spare=True).evict
    assert cost(0.5, 3600, spare=False).to_json() == {
        "slowdown": 0.5, "horizon_s": 3600, "relaunch_s": 40.0, "nodes": 3, "spare": False,
        "keep_s": 1800.0, "evict_s": 1240.0, "evict": True}
    assert cost(0.1, 3600, spare=False).describe() == (
        "keeping it costs ~360 s of work over the ~3600 s left (10% slower); evicting ~1240 s "
        "(a relaunch of ~40 s, 2 node(s) doing 67% of the work)")


def test_a_new_leader_recalls_what_the_lost_one_counted_from_the_journal() -> None:
    """Node 1: one SIGSEGV, then a second one (evictable, not evicted yet: the leader died).
    Node 2: a SIGSEGV the rules traced to the data (taken back), and a transient spike whose
    first moving rank (5) is there. Node 3: evicted."""
    from babysit.supervisor.cluster.eviction import recall

    def finding(node: int, step: int, **extra: Any) -> dict[str, Any]:
        return {"event": "finding", "finding": crash(node, step, **SEGV, **extra).to_json()}

    entries = [
        {"event": "worker_hello", "rank": 5, "data": {"node": 2}},
        finding(1, 10),
        finding(2, 12, follows="data"),
        {"event": "rerun", "verdict": "transient", "detected_step": 30, "moved_first": [5]},
        {"event": "node_evicted", "node": 3, "why": "silent data corruption at step 8"},
        finding(1, 40),
    ]
    faults, evictable, evicted = recall(entries, evict_after=2)
    assert faults.seen == {1: ["SIGSEGV at step 10", "SIGSEGV at step 40"],
                           2: ["transient fault at step 30"]}
    assert evictable == {1: "2 machine faults on it: SIGSEGV at step 10, SIGSEGV at step 40"}
    assert evicted == {3: "silent data corruption at step 8"}
    # One more transient fault on node 2 makes it evictable, as for the lost leader.
    assert faults.transient(2, 50) is not None
