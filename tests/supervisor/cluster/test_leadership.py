"""Terms and leases on a shared run directory (``supervisor.cluster.leadership``), with real
files and threads; the one clock that is scripted is the watcher's."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from babysit.supervisor.cluster import leadership
from babysit.supervisor.cluster.leadership import Lease, LeaseWatch
from babysit.supervisor.cluster.roles import survivors
from babysit.supervisor.config.plan import SECRET_ENV, from_mapping


def test_one_claim_of_a_term_wins_and_the_newest_term_is_in_force(tmp_path: Path) -> None:
    assert leadership.newest(tmp_path) is None
    first = leadership.claim(tmp_path, 0, 0, "gpu-0", "10.0.0.1:29401")
    assert first is not None and first.node == 0
    assert leadership.claim(tmp_path, 0, 1, "gpu-1", "10.0.0.2:29401") is None
    won = leadership.claim(tmp_path, 1, 1, "gpu-1", "10.0.0.2:29401")
    assert won is not None and leadership.newest(tmp_path) == won
    assert leadership.read(tmp_path, 0) == first and leadership.read(tmp_path, 2) is None


def test_of_many_racing_claimants_exactly_one_wins(tmp_path: Path) -> None:
    results: list[object] = []
    start = threading.Barrier(8)

    def claimant(node: int) -> None:
        start.wait()
        results.append(leadership.claim(tmp_path, 3, node, f"h{node}", f"10.0.0.{node}:1"))

    threads = [threading.Thread(target=claimant, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [r for r in results if r is not None]
    assert len(winners) == 1 and leadership.newest(tmp_path) == winners[0]


def test_a_term_file_being_written_is_passed_over_for_the_last_whole_one(tmp_path: Path) -> None:
    whole = leadership.claim(tmp_path, 0, 0, "gpu-0", "10.0.0.1:29401")
    leadership.term_path(tmp_path, 1).write_text('{"epoch": 1, "no')  # a claimant mid-write
    assert leadership.newest(tmp_path) == whole


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_lease_is_alive_while_it_beats_stale_once_it_stops_gone_when_it_says_so(
        tmp_path: Path) -> None:
    lease = Lease(tmp_path, 2, "gpu-2", every_s=60.0).start()  # then only when the test says
    clock = Clock()
    watch = LeaseWatch(tmp_path, 2, lost_after_s=10.0, clock=clock)
    assert watch.state() == "alive"
    clock.now = 9.0
    lease._write("alive")  # a beat resets the silence, from when the watcher saw it
    assert watch.state() == "alive"
    clock.now = 18.0
    assert watch.state() == "alive"
    clock.now = 19.5
    assert watch.state() == "stale" and watch.silent_s() == 10.5
    lease.leave()
    assert watch.state() == "gone"
    assert json.loads(leadership.lease_path(tmp_path, 2).read_text())["state"] == "gone"


def test_a_lease_nobody_ever_wrote_goes_stale_after_lost_after_s(tmp_path: Path) -> None:
    clock = Clock()
    watch = LeaseWatch(tmp_path, 5, lost_after_s=3.0, clock=clock)
    assert watch.state() == "alive"  # too soon to tell
    clock.now = 3.5
    assert watch.state() == "stale"


def test_the_beating_thread_bumps_the_counter_and_records_its_last_success(
        tmp_path: Path) -> None:
    lease = Lease(tmp_path, 0, "gpu-0", every_s=0.02).start()
    try:
        first = json.loads(leadership.lease_path(tmp_path, 0).read_text())["beat"]
        threading.Event().wait(0.2)
        later = json.loads(leadership.lease_path(tmp_path, 0).read_text())["beat"]
        assert later > first
    finally:
        lease.leave()


def test_wait_alive_tells_a_live_lease_from_a_dead_ones_last_beat(tmp_path: Path) -> None:
    live = Lease(tmp_path, 0, "gpu-0", every_s=0.05).start()
    Lease(tmp_path, 1, "gpu-1", every_s=60.0).start()  # beats once, then never
    try:
        assert leadership.wait_alive(LeaseWatch(tmp_path, 0, 1.0), 0.02, lambda: False)
        assert not leadership.wait_alive(LeaseWatch(tmp_path, 1, 0.3), 0.02, lambda: False)
    finally:
        live.leave()


def test_a_new_leader_waits_for_every_node_the_lost_one_had_spares_and_late_joiners_too(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The lost leader (node 0) launched nodes 0-2 with spare 4, then node 3 joined and node 2
    was lost: node 1, elected, waits for 3 and 4 (not for 0, nor 2, nor itself)."""
    monkeypatch.setenv(SECRET_ENV, "a-secret-of-sixteen-chars")
    (tmp_path / "train.py").write_text("")
    plan = from_mapping({"launch": {"script": "train.py", "nnodes": "2:3", "node_rank": 1},
                         "nodes": {"leader": "127.0.0.1:29401", "spares": 2}},
                        "t", tmp_path, "t", run_dir=str(tmp_path / "run"))
    plan.shared_dir.mkdir(parents=True)
    entries = [{"event": "launch", "nodes": [0, 1, 2], "spares": {"4": "gpu-4"}},
               {"event": "node_joined", "node": 3}, {"event": "node_lost", "node": 2}]
    (plan.shared_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in entries))
    leadership.claim(plan.shared_dir, 0, 0, "gpu-0", "127.0.0.1:29401")
    term = leadership.claim(plan.shared_dir, 1, 1, "gpu-1", "127.0.0.1:29402")
    assert term is not None
    assert survivors(plan, term) == [3, 4]
