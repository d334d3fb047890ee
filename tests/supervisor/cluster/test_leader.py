"""The leader's view of a multi-node run (``Cluster``), the leader's members as the control
loop drives them (``ClusterMembers``), and one node's view of its ranks (``NodeView``).

Followers are real ``supervisor.cluster.wire.connect`` clients on loopback talking to the
``Cluster``'s real listener, scripted by the test with typed messages; the only fake is the clock
that ``Cluster`` takes for its settle timing (an injected seam). Silence is measured by the wire
with the real monotonic clock, so the silence test waits for real, with ``nodes.lost_after_s``
kept small. ``ClusterMembers``' own torchrun is a shell script that sleeps (``launch.python``):
a real process, started and stopped, without torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest

from babysit.policies.loader import load_policy
from babysit.policies.types import (
    Action,
    Finding,
    Incident,
    RankStep,
    Remedy,
    Severity,
    Spread,
)
from babysit.supervisor.cluster import leadership
from babysit.supervisor.cluster.leader import ClusterMembers
from babysit.supervisor.cluster.leadership import Lease
from babysit.supervisor.cluster.membership import (
    LEADER,
    RANK_DEATH_EXIT_S,
    STACK_READING_S,
    Cluster,
    Heard,
    JobExit,
    Lost,
)
from babysit.supervisor.cluster.messages import (
    Beat,
    Exited,
    Finish,
    Launch,
    LeaderMessage,
    NodeFinding,
    RankEvent,
    Refused,
    Stop,
    Stopped,
    Summary,
    encode,
    from_leader,
)
from babysit.supervisor.cluster.node_view import NodeView, located
from babysit.supervisor.cluster.wire import AuthError, Peer, connect, parse_address
from babysit.supervisor.config.plan import SECRET_ENV, RunPlan, from_mapping
from babysit.supervisor.config.schema import ConfigError
from babysit.supervisor.contract.directive import Directive
from babysit.supervisor.contract.protocol import WorkerEvent
from babysit.supervisor.node import ahead
from babysit.supervisor.node.launcher import free_port
from babysit.supervisor.node.sketch import StepSummary
from babysit.supervisor.run.members import Fenced, Gathered, MembersMissing, Voice
from babysit.supervisor.run.watch import Watch
from tests.conftest import poll

SECRET = "cluster-leader-test-secret"
SETTLE_S = 0.5
LOST_AFTER_S = 1.0

Follow = Callable[..., Peer]


class Clock:
    """The injected clock: a list holding the time, advanced by hand."""

    def __init__(self) -> None:
        self.now = [1000.0]

    def __call__(self) -> float:
        return self.now[0]

    def advance(self, seconds: float) -> None:
        self.now[0] += seconds


def wait_for(condition: Callable[[], bool], timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


def accepted(cluster: Cluster, count: int) -> list[tuple[str, dict[str, Any]]]:
    """Poll ``accept()`` until ``count`` journal entries came back."""
    return poll(cluster.accept, count)


def received(cluster: Cluster, count: int) -> list[tuple[int, Heard]]:
    """Poll ``receive()`` until ``count`` messages came back."""
    return poll(cluster.receive, count)


def collect(peer: Peer, count: int, beats: bool = False, timeout: float = 2.0
            ) -> list[LeaderMessage]:
    """Poll a follower's end until ``count`` messages from the leader arrived, read as a
    follower reads them; the leader's heartbeats (sent on their own schedule) are left out
    unless ``beats``."""
    return poll(lambda: [from_leader(m) for m in peer.receive()], count, timeout,
                keep=lambda m: beats or not isinstance(m, Beat))


def make_plan(tmp_path: Path, node_rank: int = 0, **nodes: Any) -> RunPlan:
    script = tmp_path / "train.py"
    script.write_text("print('training')\n")
    config = {
        "launch": {"script": str(script), "nproc_per_node": 2, "nnodes": "2:3",
                   "node_rank": node_rank},
        "nodes": {"leader": f"127.0.0.1:{free_port()}", "heartbeat_s": 0.2,
                  "lost_after_s": LOST_AFTER_S, "settle_s": SETTLE_S, **nodes},
    }
    return from_mapping(config, "test", tmp_path, "t", run_dir=str(tmp_path / "run"))


@pytest.fixture
def plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> RunPlan:
    monkeypatch.setenv(SECRET_ENV, SECRET)
    return make_plan(tmp_path)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def cluster(plan: RunPlan, clock: Clock) -> Iterator[Cluster]:
    c = Cluster(plan, plan.secret(), clock)
    c.open()
    yield c
    c.close()


@pytest.fixture
def follow(cluster: Cluster) -> Iterator[Follow]:
    """Connect a real follower to the cluster's listener (not yet accepted by the leader)."""
    peers: list[Peer] = []

    def follow(node_rank: int, host: str | None = None, secret: str = SECRET) -> Peer:
        peer = connect(f"127.0.0.1:{cluster.listener.port}", secret.encode(),
                       {"node_rank": node_rank, "host": host or f"gpu-{node_rank}",
                        "pid": 4000 + node_rank}, timeout_s=2.0)
        peers.append(peer)
        return peer

    yield follow
    for peer in peers:
        peer.close()


@pytest.fixture
def followers(cluster: Cluster, follow: Follow) -> dict[int, Peer]:
    """Nodes 1 and 2 joined and accepted."""
    peers = {1: follow(1), 2: follow(2)}
    accepted(cluster, 2)
    return peers


@pytest.fixture
def launched(cluster: Cluster, followers: dict[int, Peer]) -> dict[int, Peer]:
    """Attempt 0 launched on nodes 0, 1 and 2; the followers' launch messages consumed."""
    cluster.launch(0, Directive(), "t-0", None)
    for peer in followers.values():
        assert isinstance(collect(peer, 1)[0], Launch)
    return followers


def hang_finding(node: int, ranks: tuple[int, ...] = (), **evidence: Any) -> Finding:
    return Finding(incident=Incident.HANG, detector="hang", severity=Severity.CRITICAL,
                   step=7, onset_step=7, ranks=ranks,
                   message=f"ranks stalled at step 7 [node {node}, host gpu-{node}]",
                   evidence={"node": node, **evidence})


# -- membership -----------------------------------------------------------------------------------


def test_two_followers_join_and_are_present(cluster: Cluster, follow: Follow) -> None:
    assert cluster.present() == [LEADER]
    follow(1, "gpu-a")
    follow(2, "gpu-b")

    entries = sorted(accepted(cluster, 2), key=lambda e: e[1]["node"])

    assert [kind for kind, _ in entries] == ["node_joined", "node_joined"]
    assert [(e["node"], e["host"], e["pid"]) for _, e in entries] == [
        (1, "gpu-a", 4001), (2, "gpu-b", 4002)]
    assert all(e["address"].startswith("127.0.0.1:") for _, e in entries)
    assert cluster.present() == [0, 1, 2]
    assert cluster.describe(2) == "node 2 (gpu-b)"
    assert cluster.describe(LEADER) == f"node 0 ({socket.gethostname()})"
    assert cluster.accept() == []  # each join is reported once


def test_a_second_connection_claiming_a_connected_node_rank_is_refused(
        cluster: Cluster, follow: Follow) -> None:
    first = follow(1, "gpu-a")
    accepted(cluster, 1)

    impostor = follow(1, "gpu-z")
    [(kind, entry)] = accepted(cluster, 1)

    assert kind == "node_refused"
    assert entry["node"] == 1 and entry["host"] == "gpu-z"
    assert "already taken by gpu-a" in entry["reason"]
    [refusal] = collect(impostor, 1)
    # Not final: the rank may be held by the follower's own connection, not yet seen closing.
    assert refusal == Refused(entry["reason"], final=False)
    wait_for(lambda: impostor.closed)
    # The node that was there first keeps its place and its connection.
    assert cluster.present() == [0, 1]
    assert cluster.hosts[1] == "gpu-a"
    assert not first.closed
    assert first.receive() == []


@pytest.mark.parametrize("node_rank", [3, 7, 0])
def test_a_node_rank_outside_nnodes_is_refused(cluster: Cluster, follow: Follow,
                                               node_rank: int) -> None:
    peer = follow(node_rank)

    [(kind, entry)] = accepted(cluster, 1)

    assert kind == "node_refused"
    assert entry["node"] == node_rank
    assert ("is not in 0..2 (launch.nnodes and nodes.spares) or is the leader's own (0)"
            in entry["reason"])
    # Final: another config or a typo in --node-rank never gets better by retrying.
    assert collect(peer, 1) == [Refused(entry["reason"], final=True)]
    wait_for(lambda: peer.closed)
    assert cluster.present() == [LEADER]


def test_a_spare_joins_beyond_nnodes_waits_and_takes_a_lost_nodes_place(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clock: Clock) -> None:
    """nnodes 2:3 and one spare (node rank 3): the first attempt takes nodes 0-2 and tells the
    spare nothing; once node 1 is lost, the next attempt takes the spare and keeps 3 nodes."""
    monkeypatch.setenv(SECRET_ENV, SECRET)
    plan = make_plan(tmp_path, spares=1)
    cluster = Cluster(plan, plan.secret(), clock)
    cluster.open()
    address = f"127.0.0.1:{cluster.listener.port}"
    peers = {n: connect(address, SECRET.encode(), {"node_rank": n, "host": f"gpu-{n}"},
                        timeout_s=2.0) for n in (1, 2, 3)}
    for peer in peers.values():
        peer.keep_alive(0.2, encode(Beat()))
    try:
        assert [kind for kind, _ in accepted(cluster, 3)] == ["node_joined"] * 3
        assert cluster.chosen() == ([0, 1, 2], [3])
        nodes, _ = cluster.launch(0, Directive(), "t-0", None)
        assert nodes == [0, 1, 2]
        assert [m.node_rank for n in (1, 2) for m in collect(peers[n], 1)
                if isinstance(m, Launch)] == [1, 2]
        cluster.tell(Stop("a rollback"))  # the attempt's nodes only
        time.sleep(0.3)
        assert [m for m in map(from_leader, peers[3].receive()) if not isinstance(m, Beat)] == []

        peers[1].close()
        assert poll(cluster.receive, 1, keep=lambda h: not isinstance(h[1], Beat)) == [
            (1, Lost("its connection closed (eof)"))]
        nodes, _ = cluster.launch(1, Directive(), "t-1", None)
        assert nodes == [0, 2, 3]
        [launch] = [m for m in collect(peers[3], 1) if isinstance(m, Launch)]
        assert (launch.nnodes, launch.node_rank, launch.attempt) == (3, 2, 1)
    finally:
        for peer in peers.values():
            peer.close()
        cluster.close()


def test_a_spare_must_come_after_nnodes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET_ENV, SECRET)
    with pytest.raises(ConfigError, match=r"launch.node_rank 5 is not below launch.nnodes' "
                                          r"most \(3\) plus nodes.spares \(2\)"):
        make_plan(tmp_path, spares=2, node_rank=5)


def test_a_follower_whose_connection_closed_rejoins_under_its_node_rank(
        cluster: Cluster, follow: Follow) -> None:
    gone = follow(1, "gpu-a")
    accepted(cluster, 1)
    gone.close()
    assert received(cluster, 1) == [(1, Lost("its connection closed (eof)"))]
    assert cluster.present() == [LEADER]

    back = follow(1, "gpu-a2")
    [(kind, entry)] = accepted(cluster, 1)

    assert (kind, entry["node"], entry["host"]) == ("node_joined", 1, "gpu-a2")
    assert cluster.present() == [0, 1]
    assert cluster.describe(1) == "node 1 (gpu-a2)"
    assert back.send(encode(Beat()))
    assert received(cluster, 1) == [(1, Beat())]


def test_a_rejoin_is_accepted_even_before_the_old_connection_was_reported_lost(
        cluster: Cluster, follow: Follow) -> None:
    gone = follow(1)
    accepted(cluster, 1)
    gone.close()
    wait_for(lambda: cluster.peers[1].closed)  # closed, but receive() has not seen it yet

    back = follow(1)
    [(kind, entry)] = accepted(cluster, 1)

    assert (kind, entry["node"]) == ("node_joined", 1)
    assert cluster.present() == [0, 1]
    assert back.send(encode(Beat()))
    # The old connection's loss still counts (its babysitter and workers are gone), first.
    assert received(cluster, 2) == [(1, Lost("its connection closed (eof)")), (1, Beat())]


def test_a_quick_rejoin_still_delivers_the_old_connections_last_messages(
        cluster: Cluster, follow: Follow) -> None:
    gone = follow(1)
    accepted(cluster, 1)
    assert gone.send(encode(Exited(attempt=0, code=1)))
    gone.close()
    wait_for(lambda: cluster.peers[1].closed)
    follow(1)
    accepted(cluster, 1)

    messages = [m for _, m in cluster.receive()]

    assert messages[:2] == [Exited(attempt=0, code=1), Lost("its connection closed (eof)")]


def test_a_client_with_the_wrong_secret_is_reported_as_rejected(
        cluster: Cluster, follow: Follow) -> None:
    with pytest.raises(AuthError):
        follow(1, secret="not-the-run-secret")

    [(kind, entry)] = accepted(cluster, 1)

    assert kind == "node_rejected"
    assert "mac" in entry["why"] and "node 1" in entry["why"]
    assert entry["counts"] == {"mac": 1}
    assert cluster.present() == [LEADER]
    assert cluster.accept() == []  # reported once


# -- telling the nodes ----------------------------------------------------------------------------


def test_launch_tells_every_present_follower_the_same_attempt(
        cluster: Cluster, followers: dict[int, Peer]) -> None:
    directive = Directive(attempt=3, lr_scale=0.5)

    nodes, endpoint = cluster.launch(3, directive, "t-3", None)

    assert nodes == [0, 1, 2]
    assert cluster.attempt.nodes == [0, 1, 2]
    host, port = parse_address(endpoint)
    assert host == "127.0.0.1" and port != cluster.listener.port
    launches = [collect(peer, 1)[0] for peer in followers.values()]
    # The leader is index 0; the followers get the other indices, one each.
    for index in (1, 2):
        assert Launch(attempt=3, directive=directive, rdzv_id="t-3", rdzv_endpoint=endpoint,
                      nnodes=3, node_rank=index) in launches


def test_a_rerun_keeps_the_nodes_of_the_attempt_it_replays(
        cluster: Cluster, follow: Follow) -> None:
    """Node 2 joins while attempt 0 runs on nodes 0 and 1: a rerun (``keep``) replays the same
    batches on the same two nodes, telling node 2 nothing; the next launch takes all three.
    Were one of the two gone, the rerun would take who is there."""
    one = follow(1)
    accepted(cluster, 1)
    assert cluster.launch(0, Directive(), "t-0", None)[0] == [0, 1]
    two = follow(2)
    accepted(cluster, 1)
    assert cluster.launch(1, Directive(attempt=1), "t-1", None, keep=True)[0] == [0, 1]
    assert [m.attempt for m in collect(one, 2) if isinstance(m, Launch)] == [0, 1]
    time.sleep(0.3)
    assert [m for m in map(from_leader, two.receive()) if not isinstance(m, Beat)] == []
    assert cluster.launch(2, Directive(attempt=2), "t-2", None)[0] == [0, 1, 2]
    one.close()
    poll(cluster.receive, 1, keep=lambda h: isinstance(h[1], Lost))
    assert cluster.launch(3, Directive(attempt=3), "t-3", None, keep=True)[0] == [0, 2]


def test_a_rerun_replaces_a_lost_node_to_keep_its_size(cluster: Cluster, follow: Follow) -> None:
    """Attempt 0 on nodes 0 and 1; node 2 joins, node 1 is lost: the rerun runs on 0 and 2,
    the same world size (the same samples in each global batch), not on whoever is there."""
    one = follow(1)
    accepted(cluster, 1)
    assert cluster.launch(0, Directive(), "t-0", None)[0] == [0, 1]
    follow(2)
    accepted(cluster, 1)
    one.close()
    poll(cluster.receive, 1, keep=lambda h: isinstance(h[1], Lost))
    assert cluster.launch(1, Directive(attempt=1), "t-1", None, keep=True)[0] == [0, 2]


def test_launch_numbers_the_nodes_present_now_not_the_configured_ranks(
        cluster: Cluster, follow: Follow) -> None:
    peer = follow(2)  # node 1 never came: an elastic run goes on with two nodes
    accepted(cluster, 1)

    nodes, endpoint = cluster.launch(1, Directive(attempt=1), "t-1", "10.0.0.5:29400")

    assert (nodes, endpoint) == ([0, 2], "10.0.0.5:29400")
    [message] = collect(peer, 1)
    assert isinstance(message, Launch)
    assert (message.nnodes, message.node_rank) == (2, 1)
    assert message.rdzv_endpoint == "10.0.0.5:29400"


def test_tell_reaches_only_the_followers_of_the_attempt(
        cluster: Cluster, follow: Follow) -> None:
    first = follow(1)
    accepted(cluster, 1)
    cluster.launch(0, Directive(), "t-0", None)  # nodes 0 and 1
    assert isinstance(collect(first, 1)[0], Launch)
    late = follow(2)  # joins during attempt 0: it takes part from the next launch
    accepted(cluster, 1)

    cluster.tell(Stop("hang"))

    assert collect(first, 1) == [Stop("hang")]
    time.sleep(0.05)
    assert late.receive() == []
    assert cluster.present() == [0, 1, 2]


def test_the_leader_beats_on_its_own_thread_and_close_says_finish(
        cluster: Cluster, followers: dict[int, Peer]) -> None:
    # Nobody calls the cluster here: the beats come from the connection's own thread, so a
    # leader busy checksumming a checkpoint or stopping workers never looks lost.
    for peer in followers.values():
        assert collect(peer, 2, beats=True) == [Beat(), Beat()]

    cluster.close(3)
    for peer in followers.values():
        wait_for(lambda p=peer: p.closed)  # it hung up, after saying how the run ended
        assert [m for m in map(from_leader, peer.receive()) if not isinstance(m, Beat)] == [
            Finish(3)]


# -- hearing from the nodes -----------------------------------------------------------------------


def test_a_closed_connection_is_reported_lost_once_after_its_last_messages(
        cluster: Cluster, followers: dict[int, Peer]) -> None:
    followers[1].send(encode(Stopped(attempt=0)))
    followers[1].close()

    got = received(cluster, 2)

    assert got == [(1, Stopped(attempt=0)), (1, Lost("its connection closed (eof)"))]
    assert cluster.present() == [0, 2]
    assert 1 not in cluster.peers
    time.sleep(0.05)
    assert cluster.receive() == []  # once


def test_a_silent_follower_is_lost_while_one_that_beats_is_not(
        cluster: Cluster, followers: dict[int, Peer]) -> None:
    deadline = time.monotonic() + LOST_AFTER_S + 0.15
    while time.monotonic() < deadline:  # node 2 beats, node 1 says nothing
        followers[2].send(encode(Beat()))
        time.sleep(0.1)

    got = [(n, m) for n, m in cluster.receive() if not isinstance(m, Beat)]

    assert len(got) == 1
    node, lost = got[0]
    assert node == 1 and isinstance(lost, Lost)
    assert lost.why.startswith("its babysitter was silent for")
    assert cluster.present() == [0, 2]
    wait_for(lambda: followers[1].closed)  # the leader hung up on it
    assert not followers[2].closed
    assert [m for _, m in cluster.receive() if isinstance(m, Lost)] == []


def test_summaries_from_a_follower_merge_with_the_leaders_own(
        cluster: Cluster, launched: dict[int, Peer]) -> None:
    def summary(step: int, ranks: tuple[int, ...]) -> StepSummary:
        s = StepSummary(step, 6)
        for rank in ranks:
            s.add(RankStep(rank=rank, step=step, time=float(step), loss=2.0))
        return s

    launched[1].send(encode(Summary(0, summary(1, (2, 3)))))
    [(node, message)] = received(cluster, 1)
    assert isinstance(message, Summary)
    assert cluster.summary(LEADER, summary(1, (0, 1))) == []
    assert cluster.summary(node, message.summary) == []

    [merged] = cluster.summary(2, summary(1, (4, 5)))  # the last node of the attempt

    assert (merged.step, merged.n_ranks, merged.missing_ranks()) == (1, 6, [])
    assert merged.mean_loss == pytest.approx(2.0)


# -- a crash settles ------------------------------------------------------------------------------


def test_every_node_exiting_zero_ends_the_attempt_once(
        cluster: Cluster, clock: Clock, launched: dict[int, Peer]) -> None:
    cluster.exited(0, 0, {}, None)
    cluster.exited(1, 0, {}, None)
    clock.advance(60)  # nobody failed: the job waits for every node, however long
    assert cluster.settled_exit() is None

    cluster.exited(2, 0, {}, None)

    assert cluster.settled_exit() == JobExit(code=0, nodes={0: 0, 1: 0, 2: 0})
    assert cluster.settled_exit() is None


def test_a_failure_settles_after_settle_s(
        cluster: Cluster, clock: Clock, launched: dict[int, Peer]) -> None:
    cluster.exited(2, 1, {4: "RuntimeError: boom"}, 4)
    assert cluster.settled_exit() is None
    clock.advance(SETTLE_S - 0.01)
    assert cluster.settled_exit() is None

    clock.advance(0.01)
    end = cluster.settled_exit()

    assert end == JobExit(code=1, tails={4: "RuntimeError: boom"}, root=4, nodes={2: 1})
    assert cluster.settled_exit() is None


def test_a_failure_settles_at_once_when_every_node_exited(
        cluster: Cluster, launched: dict[int, Peer]) -> None:
    cluster.exited(0, 0, {}, None)
    cluster.exited(1, 1, {2: "NCCL watchdog: peer closed", 3: "peer closed"}, None)
    assert cluster.settled_exit() is None  # node 2, which has the telling log, is still out

    cluster.exited(2, 1, {4: "Traceback: CUDA error: an illegal memory access", 5: "closed"}, 4)
    end = cluster.settled_exit()

    assert end is not None
    assert end.code == 1
    assert end.nodes == {0: 0, 1: 1, 2: 1}
    assert end.tails == {2: "NCCL watchdog: peer closed", 3: "peer closed",
                         4: "Traceback: CUDA error: an illegal memory access", 5: "closed"}
    assert end.root == 4  # node 1 named no root; node 2 did


def test_a_rank_dead_of_a_native_signal_settles_at_once(
        cluster: Cluster, clock: Clock, launched: dict[int, Peer]) -> None:
    # Node 2's rank 4 died of SIGSEGV: the cause, whatever the others will say (a closed
    # connection), and with NCCL their ranks may never exit by themselves. No settle_s wait.
    cluster.exited(2, 1, {4: "Signal 11 (SIGSEGV) received by PID 77"}, 4, {4: -11, 5: -15})
    end = cluster.settled_exit()
    assert end is not None and (end.code, end.root, end.exits) == (1, 4, {4: -11, 5: -15})
    assert end.nodes == {2: 1}


def test_a_closed_connection_or_a_stop_signal_still_waits_for_the_others(
        cluster: Cluster, clock: Clock, launched: dict[int, Peer]) -> None:
    # SIGTERM is torchrun stopping a survivor, SIGABRT NCCL aborting one whose peer died, an
    # exit 1 a closed connection: any node could say as much. The telling view may come next.
    cluster.exited(1, 1, {2: "Connection closed by peer", 3: "aborted"}, 2, {2: 1, 3: -6})
    cluster.exited(0, 1, {0: "stopped"}, 0, {0: -15, 1: -15})
    assert cluster.settled_exit() is None
    clock.advance(SETTLE_S)
    assert cluster.settled_exit() is not None


def test_exits_from_outside_the_attempt_and_repeated_exits_are_ignored(
        cluster: Cluster, clock: Clock, follow: Follow) -> None:
    follow(1)
    accepted(cluster, 1)
    cluster.launch(0, Directive(), "t-0", None)  # nodes 0 and 1

    cluster.exited(2, 1, {4: "not in this attempt"}, 4)
    clock.advance(10)
    assert cluster.settled_exit() is None  # and it started no settle timer

    cluster.exited(1, 0, {}, None)
    cluster.exited(1, 9, {2: "a second exit"}, 2)
    cluster.exited(0, 0, {}, None)

    assert cluster.settled_exit() == JobExit(code=0, nodes={0: 0, 1: 0})


def test_a_new_launch_forgets_the_previous_attempts_exits(
        cluster: Cluster, clock: Clock, launched: dict[int, Peer]) -> None:
    cluster.exited(1, 1, {2: "boom"}, 2)
    cluster.launch(1, Directive(attempt=1), "t-1", None)
    clock.advance(10)
    assert cluster.settled_exit() is None


def test_the_job_exit_code_is_the_first_non_zero_code_seen(
        cluster: Cluster, launched: dict[int, Peer]) -> None:
    cluster.exited(2, 1, {4: "RuntimeError: boom"}, 4)  # the failure
    cluster.exited(1, 143, {2: "SIGTERM"}, None)  # its consequence: torchrun tore node 1 down
    cluster.exited(0, 0, {}, None)

    end = cluster.settled_exit()

    assert end is not None and end.code == 1


# -- a hang settles -------------------------------------------------------------------------------


def test_one_nodes_hang_waits_for_settle_s(
        cluster: Cluster, clock: Clock, launched: dict[int, Peer]) -> None:
    finding = hang_finding(1, (2,))
    cluster.hang(1, finding)
    clock.advance(SETTLE_S - 0.01)
    assert cluster.settled_hang() is None

    clock.advance(0.01)

    assert cluster.settled_hang() == finding
    assert cluster.settled_hang() is None


def test_the_hang_settles_at_once_when_every_node_reported_and_prefers_stacks(
        cluster: Cluster, launched: dict[int, Peer]) -> None:
    waiting = hang_finding(0, (0, 1))
    stacks = hang_finding(2, (), stacks="rank 5 in all_reduce; rank 4 in a python loop")
    cluster.hang(0, waiting)
    cluster.hang(2, stacks)
    cluster.hang(2, hang_finding(2, (4,)))  # a node's first finding stands
    cluster.hang(7, hang_finding(7, (9,), stacks="not in this attempt"))
    assert cluster.settled_hang() is None

    cluster.hang(1, hang_finding(1, ()))

    assert cluster.settled_hang() == stacks


def test_the_hang_prefers_a_finding_that_names_ranks(
        cluster: Cluster, clock: Clock, launched: dict[int, Peer]) -> None:
    cluster.hang(0, hang_finding(0, ()))
    cluster.hang(1, hang_finding(1, (3,)))
    clock.advance(SETTLE_S)

    chosen = cluster.settled_hang()

    assert chosen is not None and chosen.ranks == (3,)


def test_a_node_still_reading_stacks_is_waited_for_past_settle_s(
        cluster: Cluster, clock: Clock, launched: dict[int, Peer]) -> None:
    """The race behind a flaky multi-node hang test: the leader's own view (ranks waiting in
    the collective, nobody named) came in first, and the node with the stuck rank was still
    dumping stacks when settle_s ran out, so the leader named nobody."""
    cluster.hang_suspected(1)  # node 1 stalled too and reads its ranks' stacks
    cluster.hang(0, hang_finding(0, ()))
    clock.advance(SETTLE_S * 3)
    assert cluster.settled_hang() is None

    named = hang_finding(1, (3,), stacks="rank 3 sleeps outside the all_reduce")
    cluster.hang(1, named)

    assert cluster.settled_hang() == named


def test_a_node_that_never_finishes_reading_stacks_is_not_waited_for_forever(
        cluster: Cluster, clock: Clock, launched: dict[int, Peer]) -> None:
    cluster.hang_suspected(1)
    cluster.hang(0, hang_finding(0, (1,)))
    clock.advance(STACK_READING_S)

    chosen = cluster.settled_hang()

    assert chosen is not None and chosen.ranks == (1,)


def test_a_stall_behind_a_crash_on_another_node_is_not_a_hang(
        cluster: Cluster, clock: Clock, launched: dict[int, Peer]) -> None:
    """Rank 3 on node 1 crashed; node 0's ranks wait in the collective for it and its timers
    fire before node 1's torchrun has torn down. The crash is judged, not the stall."""
    cluster.rank_died(1)
    cluster.hang(0, hang_finding(0, (0, 1)))
    clock.advance(SETTLE_S * 3)
    assert cluster.settled_hang() is None  # node 1's exit is on its way

    cluster.exited(1, 1, {3: "RuntimeError: injected crash"}, 3)
    clock.advance(SETTLE_S)
    assert cluster.settled_hang() is None
    end = cluster.settled_exit()

    assert end is not None and end.code == 1
    assert cluster.settled_hang() is None  # and the stall is forgotten, not judged later


def test_a_node_whose_rank_died_but_never_exits_does_not_hold_a_hang_forever(
        cluster: Cluster, clock: Clock, launched: dict[int, Peer]) -> None:
    cluster.rank_died(1)
    cluster.hang(0, hang_finding(0, (0,)))
    clock.advance(RANK_DEATH_EXIT_S)

    chosen = cluster.settled_hang()

    assert chosen is not None and chosen.ranks == (0,)


def test_lost_finding_names_the_nodes_ranks_and_host(
        cluster: Cluster, launched: dict[int, Peer]) -> None:
    cluster.rank_node.update({0: 0, 1: 0, 2: 1, 3: 1, 4: 2, 5: 2})
    launched[1].close()
    [(node, lost)] = received(cluster, 1)
    assert isinstance(lost, Lost)

    finding = cluster.lost_finding(node, lost.why, step=42)

    assert finding.incident is Incident.NODE_LOST
    assert finding.severity is Severity.CRITICAL
    assert (finding.step, finding.onset_step, finding.ranks) == (42, 42, (2, 3))
    assert finding.message == "node 1 (gpu-1) lost at step 42: its connection closed (eof)"
    assert finding.evidence == {"node": 1, "host": "gpu-1", "why": lost.why,
                                "nodes_left": [0, 2]}


def test_all_stopped_once_every_follower_said_so(
        cluster: Cluster, launched: dict[int, Peer]) -> None:
    assert not cluster.all_stopped()
    cluster.stopped(1)
    assert not cluster.all_stopped()
    cluster.stopped(2)
    assert cluster.all_stopped()


def test_all_stopped_counts_a_follower_that_is_gone(
        cluster: Cluster, launched: dict[int, Peer]) -> None:
    cluster.stopped(1)
    assert not cluster.all_stopped()
    launched[2].close()
    received(cluster, 1)
    assert cluster.all_stopped()


# -- one node's ranks -----------------------------------------------------------------------------


def node_view(local_ranks: int | None = 2) -> NodeView:
    view = NodeView(Watch(load_policy("default"), scope="node"), 1, "gpu-b", local_ranks)
    view.new_attempt(0.0, Directive())
    return view


def hello(view: NodeView, rank: int) -> None:
    view.observe_event(WorkerEvent(rank=rank, type="hello", time=0.0,
                                   data={"world_size": 4}), 0.0)


def test_node_summaries_come_out_once_per_step_with_both_ranks() -> None:
    view = node_view()
    hello(view, 2)
    hello(view, 3)
    emitted: list[StepSummary] = []

    for step in (1, 2, 3):
        for rank in (2, 3):
            summaries, findings = view.observe_rank(
                RankStep(rank=rank, step=step, time=float(step), loss=3.0 - step / 10), step)
            assert findings == []
            emitted += summaries

    assert [s.step for s in emitted] == [1, 2, 3]
    for s in emitted:
        assert (s.world_size, s.n_ranks, s.missing_ranks()) == (4, 2, [0, 1])
    assert emitted[-1].mean_loss == pytest.approx(2.7)
    assert view.flush() == ([], [])


def test_local_ranks_holds_a_step_until_the_second_ranks_hello_and_report() -> None:
    counted = node_view(local_ranks=None)
    fixed = node_view(local_ranks=2)
    for view in (counted, fixed):
        hello(view, 2)  # rank 3's hello is late

    early = RankStep(rank=2, step=1, time=1.0, loss=2.0)
    # Counting hellos, one hello means one rank: the step goes out with rank 2 alone.
    [alone], _ = counted.observe_rank(early, 1.0)
    assert alone.n_ranks == 1
    # With the node's ranks fixed, it waits for rank 3.
    assert fixed.observe_rank(early, 1.0) == ([], [])
    hello(fixed, 3)
    [both], _ = fixed.observe_rank(RankStep(rank=3, step=1, time=1.0, loss=2.0), 1.0)
    assert (both.step, both.n_ranks, both.world_size) == (1, 2, 4)


def test_a_non_finite_loss_is_named_with_the_node_and_host() -> None:
    view = node_view()
    hello(view, 2)
    hello(view, 3)
    view.observe_rank(RankStep(rank=2, step=5, time=5.0, loss=2.0), 5.0)

    [summary], findings = view.observe_rank(
        RankStep(rank=3, step=5, time=5.0, loss=math.nan), 5.0)

    assert summary.n_ranks == 2
    [nonfinite] = [f for f in findings if f.incident is Incident.NONFINITE]
    assert nonfinite.ranks == (3,)
    assert nonfinite.message.endswith("[node 1, host gpu-b]")
    assert nonfinite.evidence["node"] == 1
    assert nonfinite.evidence["host"] == "gpu-b"
    assert nonfinite.evidence["loss"] == {"3": "nan"}


def test_a_hang_on_the_node_is_named_with_the_node_and_host() -> None:
    view = node_view()
    hello(view, 2)
    hello(view, 3)
    for rank in (2, 3):
        view.observe_rank(RankStep(rank=rank, step=1, time=1.0, loss=2.0), 1.0)
    assert view.check(2.5) == []  # inside the default 2 s floor (no step intervals yet)

    [hang] = view.check(4.0)

    assert hang.incident is Incident.HANG
    assert hang.message.endswith("[node 1, host gpu-b]")
    assert (hang.evidence["node"], hang.evidence["host"]) == (1, "gpu-b")


def test_located_names_the_node_once() -> None:
    finding = hang_finding(3)
    plain = Finding(incident=Incident.STRAGGLER, detector="straggler",
                    severity=Severity.WARNING, step=3, onset_step=3, ranks=(2,),
                    message="rank 2 is slow", evidence={"factor": 1.5})

    once = located(plain, 1, "gpu-b")
    twice = located(once, 1, "gpu-b")

    assert once.message == "rank 2 is slow [node 1, host gpu-b]"
    assert once.evidence == {"factor": 1.5, "node": 1, "host": "gpu-b"}
    assert twice == once
    assert plain.message == "rank 2 is slow"  # the original is untouched
    assert located(finding, 3, "gpu-3") == finding


def test_torchruns_failure_summary_maps_local_ranks_to_global_ones() -> None:
    # A rank that dies before its hello is known only by its log folder (a local rank); the
    # summary torchrun prints at exit says which global rank that was.
    from babysit.supervisor.node import launcher

    summary = """Failures:
[1]:
  host      : gpu-b
  rank      : 3 (local_rank: 1)
  exitcode  : 1 (pid: 10399)
Root Cause (first observed failure):
[0]:
  host      : gpu-b
  rank      : 2 (local_rank: 0)
  exitcode  : 1 (pid: 10397)
"""
    assert launcher.failed_ranks(summary) == {1: 3, 0: 2}
    assert launcher.root_cause_rank(summary) == 2
    assert launcher.failed_ranks("torchrun exited cleanly") == {}


# -- the leader's members (ClusterMembers) --------------------------------------------------------


class Said:
    """A ``Voice`` that keeps what the members said."""

    def __init__(self) -> None:
        self.journal: list[tuple[str, dict[str, Any]]] = []
        self.voice = Voice(journal=lambda event, **fields: self.journal.append((event, fields)),
                           log=lambda _: None, status=lambda _: None,
                           alert=lambda *_: None, stopping=lambda: False)


@pytest.fixture
def members(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ClusterMembers]:
    """A two-node run's leader; its own torchrun is a shell script that sleeps (``launch.python``)
    so that a launch starts a real process, cheaply."""
    with leading(tmp_path, monkeypatch, "2") as m:
        yield m


@contextlib.contextmanager
def leading(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nnodes: str,
            expect: list[int] | None = None, early: ahead.Early | None = None
            ) -> Iterator[ClusterMembers]:
    """The ``members`` fixture's leader, for ``launch.nnodes`` ``nnodes``; ``expect``: the
    nodes a leader taking over waits for; ``early``: its first torchrun started ahead."""
    monkeypatch.setenv(SECRET_ENV, SECRET)
    fake = tmp_path / "fake-python"
    fake.write_text("#!/bin/sh\nexec sleep 60\n")
    fake.chmod(0o755)
    script = tmp_path / "train.py"
    script.write_text("print('training')\n")
    plan = from_mapping({
        "launch": {"script": str(script), "nproc_per_node": 2, "nnodes": nnodes,
                   "python": str(fake), "stop_grace_s": 2.0, "torchrun_ahead": False},
        "nodes": {"leader": f"127.0.0.1:{free_port()}", "heartbeat_s": 0.2,
                  "lost_after_s": LOST_AFTER_S, "settle_s": SETTLE_S, "join_timeout_s": 10.0},
    }, "test", tmp_path, "t", run_dir=str(tmp_path / "run"))
    plan.run_dir.mkdir(parents=True)  # the loop makes it before its members open
    term = leadership.claim(plan.shared_dir, 0, 0, "gpu-0", plan.leader_address)
    assert term is not None
    lease = Lease(plan.shared_dir, 0, "gpu-0", every_s=0.2).start()
    m = ClusterMembers(plan, plan.secret(), term, lease, expect, early)
    m.open()
    yield m
    m.close(0)
    lease.leave()


def join(members: ClusterMembers, said: Said) -> Peer:
    """A scripted follower (node 1) joins while ``ready()`` waits for it."""
    peers: list[Peer] = []

    def connect_later() -> None:
        deadline = time.monotonic() + 10.0
        while not peers:
            try:
                peers.append(connect(members.plan.leader_address, SECRET.encode(),
                                     {"node_rank": 1, "host": "gpu-1", "pid": 4001}))
            except OSError:  # not listening yet
                assert time.monotonic() < deadline
                time.sleep(0.02)

    thread = threading.Thread(target=connect_later, daemon=True)
    thread.start()
    members.ready(said.voice)
    thread.join(timeout=10.0)
    return peers[0]


def gathered(members: ClusterMembers, done: Callable[[Gathered], bool]) -> Gathered:
    """Gather ticks into one ``Gathered`` until ``done`` says so."""
    out = Gathered()
    deadline = time.monotonic() + 10.0
    while not done(out):
        assert time.monotonic() < deadline, f"not gathered in time: {out}"
        tick = members.gather(time.monotonic(), watching=True)
        out.events += tick.events
        out.findings += tick.findings
        out.entries += tick.entries
        time.sleep(0.02)
    return out


def test_ready_waits_for_the_follower_and_launch_tells_it_the_attempt(
        members: ClusterMembers) -> None:
    said = Said()
    follower = join(members, said)

    fields = members.launch(0, Directive(lr_scale=0.5), time.monotonic())

    assert [event for event, _ in said.journal] == ["leader_listening", "node_joined"]
    assert said.journal[1][1]["host"] == "gpu-1"
    assert fields["nodes"] == [0, 1] and fields["hosts"]["1"] == "gpu-1"
    [message] = collect(follower, 1)
    assert message == Launch(attempt=0, directive=Directive(lr_scale=0.5),
                             rdzv_id="t-0", rdzv_endpoint=fields["rdzv_endpoint"], nnodes=2,
                             node_rank=1)
    assert members.running()


def test_a_first_torchrun_started_ahead_that_the_launch_cannot_take_is_journaled(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``babysit run`` started it before reading the config; this run turned it off."""
    early = ahead.Early()
    try:
        with leading(tmp_path, monkeypatch, "2", early=early) as m:
            join(m, Said())
            m.launch(0, Directive(), time.monotonic())
            out = gathered(m, lambda g: any(e[0] == "ahead_unused" for e in g.entries))
            [fields] = [f for event, f in out.entries if event == "ahead_unused"]
            assert fields == {"why": "launch.torchrun_ahead is false"}
            assert early.take() is None  # stopped, not left running
    finally:
        early.stop()


def test_what_a_follower_reports_reaches_the_loop_and_an_unreadable_message_is_refused(
        members: ClusterMembers) -> None:
    follower = join(members, Said())
    members.launch(0, Directive(), time.monotonic())
    straggler = Finding(incident=Incident.STRAGGLER, detector="straggler",
                        severity=Severity.WARNING, step=3, onset_step=3, ranks=(3,),
                        message="rank 3 is slow [node 1, host gpu-1]", evidence={"node": 1})
    hello = WorkerEvent(rank=3, type="hello", time=1.0, data={"world_size": 4})

    follower.send(encode(RankEvent(0, hello)))
    follower.send(encode(NodeFinding(0, straggler)))
    follower.send(encode(NodeFinding(7, straggler)))  # about another attempt: dropped
    follower.send({"type": "summary", "attempt": 0, "summary": {"step": "three"}})
    out = gathered(members, lambda g: bool(g.findings and g.events and [
        e for e in g.entries if e[0] == "node_message_refused"]))

    assert [(e.rank, e.type, e.data["node"]) for e in out.events] == [(3, "hello", 1)]
    assert members.cluster.rank_node[3] == 1
    assert out.findings == [straggler]
    [(_, refused)] = [e for e in out.entries if e[0] == "node_message_refused"]
    assert (refused["node"], refused["type"]) == (1, "summary")
    assert "field 'summary' is not valid" in refused["error"]


def test_stop_tells_the_follower_and_waits_until_it_says_stopped(
        members: ClusterMembers) -> None:
    said = Said()
    follower = join(members, said)
    members.launch(0, Directive(), time.monotonic())
    assert isinstance(collect(follower, 1)[0], Launch)

    def answer() -> None:
        assert collect(follower, 1, timeout=10.0) == [Stop("a hang", replacing=True)]
        follower.send(encode(Stopped(0)))

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    members.stop("a hang", replacing=True)
    thread.join(timeout=5.0)

    assert not members.running()
    assert said.journal[-1] == ("nodes_stopped", {"missing": []})


def test_a_failed_attempt_stops_the_others_without_waiting_for_their_torchruns(
        members: ClusterMembers) -> None:
    # Node 1's rank 2 died of SIGSEGV: the cause by itself (settled at once: the Cluster test
    # above, on its clock); the others are told to stop without waiting for torchrun's own
    # shutdown, as the leader stops its own node's.
    follower = join(members, Said())
    members.launch(0, Directive(), time.monotonic())
    assert isinstance(collect(follower, 1)[0], Launch)
    follower.send(encode(Exited(0, 1, {2: "Signal 11 (SIGSEGV) received by PID 9"}, 2,
                                {2: -11, 3: -15})))
    deadline = time.monotonic() + 10.0
    end = None
    while end is None:
        assert time.monotonic() < deadline, "the attempt never ended"
        end = members.gather(time.monotonic(), watching=True).end
        time.sleep(0.02)

    assert (end.code, end.root) == (1, 2)
    assert collect(follower, 1) == [Stop("the attempt failed on another node", replacing=True)]


def test_a_follower_that_hangs_up_is_a_lost_node_with_its_ranks(
        members: ClusterMembers) -> None:
    """Dated with the newest step any node reported, not the merged one: a node that reported
    step 15 (and whose ranks may have saved it) while another's never came is lost at 15, so
    the relaunch may resume from a checkpoint of step 15 rather than train it again."""
    follower = join(members, Said())
    members.launch(0, Directive(), time.monotonic())
    follower.send(encode(RankEvent(0, WorkerEvent(rank=3, type="hello", time=1.0, data={}))))
    gathered(members, lambda g: bool(g.events))
    follower.send(encode(Summary(0, StepSummary.of(15, 2, [
        RankStep(rank=3, step=15, time=1.0, step_time=0.1)]))))  # the leader's never comes

    follower.close()
    out = gathered(members, lambda g: bool(g.findings))

    [(_, fields)] = [e for e in out.entries if e[0] == "node_lost"]
    assert fields == {"node": 1, "host": "gpu-1", "why": "its connection closed (eof)"}
    [lost] = out.findings
    assert (lost.incident, lost.ranks, lost.step) == (Incident.NODE_LOST, (3,), 15)
    assert members.cluster.present() == [LEADER]


def test_a_leader_that_sees_a_newer_term_is_fenced_stops_its_ranks_and_commands_nobody(
        members: ClusterMembers) -> None:
    follower = join(members, Said())
    members.launch(0, Directive(), time.monotonic())
    assert isinstance(collect(follower, 1)[0], Launch)
    group = members.workers.group
    assert group is not None and group.processes()
    # The others gave this leader up while it was cut off, and elected node 1.
    leadership.claim(members.plan.shared_dir, 1, 1, "gpu-1", "10.0.0.2:29401")
    deadline = time.monotonic() + 5.0
    with pytest.raises(Fenced, match=r"node 1 \(gpu-1\) leads term 1"):
        while time.monotonic() < deadline:
            members.gather(time.monotonic(), True)
            time.sleep(0.05)
    assert not group.processes()
    assert members.close(1) == []
    time.sleep(0.3)
    # No Finish: the followers follow the new leader, not this one's last word.
    assert not [m for m in map(from_leader, follower.receive()) if isinstance(m, Finish)]


def test_the_wait_for_a_lost_node_ends_once_its_babysitter_says_it_left(
        members: ClusterMembers) -> None:
    """A fixed two-node run lost node 1; its babysitter gave up (cut off past its own
    rejoin_timeout_s) and said so in its lease: the leader stops waiting its 600 s for it."""
    follower = join(members, Said())
    members.launch(0, Directive(), time.monotonic())
    assert isinstance(collect(follower, 1)[0], Launch)
    follower.close()
    gathered(members, lambda g: any(kind == "node_lost" for kind, _ in g.entries))
    Lease(members.plan.shared_dir, 1, "gpu-1", every_s=60.0).start().leave()
    started = time.monotonic()
    with pytest.raises(MembersMissing, match=r"node\(s\) 1 left the run") as raised:
        members.launch(1, Directive(), time.monotonic())
    assert raised.value.lost and time.monotonic() - started < 5.0


def test_a_leader_that_cannot_beat_its_lease_stops_its_ranks_before_the_others_elect(
        members: ClusterMembers) -> None:
    join(members, Said())
    members.launch(0, Directive(), time.monotonic())
    group = members.workers.group
    assert group is not None and group.processes()
    # The shared storage stops taking its beats: every write fails from now on.
    members.lease.path = members.plan.shared_dir / "unmounted" / "lease.json"
    with pytest.raises(Fenced, match="could not beat this node's lease"):
        gathered(members, lambda g: False)
    assert not group.processes()


def test_a_node_the_run_cannot_do_without_is_kept_and_said_so(members: ClusterMembers) -> None:
    """A fixed two-node run: two SIGSEGVs on node 1's rank make it evictable, but one node
    left would be below launch.nnodes: it stays, with a warning saying why."""
    said = Said()
    join(members, said)
    members.launch(0, Directive(), time.monotonic())
    members.cluster.rank_node[2] = 1
    for step in (9, 24):
        segv = Finding(incident=Incident.CRASH, detector="crash", severity=Severity.CRITICAL,
                       step=step, onset_step=step, message="m", ranks=(2,),
                       evidence={"class": "signal", "signal": 11})
        assert members.locate(segv).evidence["node"] == 1
    members.launch(1, Directive(), time.monotonic())
    kept = [fields for event, fields in said.journal if event == "node_kept"]
    assert len(kept) == 1 and "below the minimum 2" in kept[0]["kept"]
    assert not members.cluster.evicted and members.cluster.present() == [0, 1]


def test_a_native_crash_that_followed_the_data_does_not_make_its_node_evictable(
        members: ClusterMembers) -> None:
    """Node 1's decoder segfaults on the same corrupt batch twice: the rules skip the batch,
    and the prepare of that rollback takes the node's count back before the launch."""
    said = Said()
    join(members, said)
    members.launch(0, Directive(), time.monotonic())
    members.cluster.rank_node[2] = 1
    placed = []
    for _ in range(2):
        segv = Finding(incident=Incident.CRASH, detector="crash", severity=Severity.CRITICAL,
                       step=10, onset_step=10, message="m", ranks=(2,),
                       evidence={"class": "signal", "signal": 11})
        placed.append(members.locate(segv))
    assert members._evictable  # two machine faults on node 1, as counted
    data = dataclasses.replace(placed[1], evidence={**placed[1].evidence, "follows": "data"})
    members.prepare(Remedy(Action.ROLLBACK, data, "same crash twice -> the data's"), 1)
    assert not members._evictable and members.faults.seen[1] == []


def test_a_reruns_verdict_blames_the_node_the_first_pass_ran_the_rank_on(
        members: ClusterMembers) -> None:
    """Rank 3 ran on node 1 in the first pass and moved first; the rerun placed it elsewhere.
    Its transient verdict counts against node 1, where the rank was when it moved."""
    join(members, Said())
    members.launch(0, Directive(), time.monotonic())
    members.cluster.rank_node.update({0: 0, 1: 0, 2: 1, 3: 1})
    members.launch(1, Directive(attempt=1), time.monotonic(), keep_nodes=True)
    members.cluster.rank_node.update({0: 1, 1: 1, 2: 0, 3: 0})  # the rerun's hellos
    members.hear({"event": "rerun", "verdict": "transient", "detected_step": 40,
                  "moved_first": [3]})
    assert members.faults.seen[1] == ["transient fault at step 40"]
    assert members.faults.seen.get(0, []) == []


def test_an_sdc_on_one_nodes_rank_and_transient_spikes_make_their_nodes_evictable(
        members: ClusterMembers) -> None:
    """The SDC vote names rank 2 (node 1): node 1 is evictable at once. A vote that named
    ranks on two nodes places the finding on neither. Two reruns that did not reproduce their
    spikes, rank 3 (node 2) moving first both times, make node 2 evictable."""
    join(members, Said())
    members.launch(0, Directive(), time.monotonic())
    members.cluster.rank_node.update({0: 0, 1: 0, 2: 1, 3: 2})

    def sdc(*ranks: int) -> Finding:
        return Finding(incident=Incident.SDC, detector="sdc", severity=Severity.CRITICAL,
                       step=20, onset_step=16, message="sdc", ranks=ranks,
                       evidence={"rules": ["majority"]})

    both = members.locate(sdc(2, 3))
    assert "node" not in both.evidence and not members._evictable
    placed = members.locate(sdc(2))
    assert placed.evidence["node"] == 1 and "[node 1, host" in placed.message
    assert members._evictable == {1: "silent data corruption at step 20 on its rank(s)"}

    for step in (40, 90):
        members.hear({"event": "rerun", "verdict": "transient", "detected_step": step,
                      "moved_first": [3]})
    members.hear({"event": "rerun", "verdict": "reproduced", "detected_step": 95,
                  "moved_first": [3]})  # the data's: not the machine's
    assert members._evictable[2] == ("2 machine faults on it: transient fault at step 40, "
                                     "transient fault at step 90")


def test_a_node_back_while_the_job_runs_short_grows_it_back_at_the_next_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--nnodes 1:2`: node 1 is lost and the job goes on on node 0 alone; node 1 comes back.
    The attempt's next checkpoint asks to grow back (``node_joined``, once per attempt); a
    checkpoint while every node takes part asks nothing."""
    with leading(tmp_path, monkeypatch, "1:2") as members:
        said = Said()
        peer = join(members, said)
        members.launch(0, Directive(), time.monotonic())
        out = Gathered()
        saved = WorkerEvent(type="checkpoint", rank=0, time=0.0, data={"step": 5})
        members._rank_event(0, saved, out)
        assert out.findings == []  # every node takes part
        peer.close()
        gathered(members, lambda got: any(e == "node_lost" for e, _ in got.entries))
        members.launch(1, Directive(attempt=1), time.monotonic())
        assert members.cluster.attempt.nodes == [0]
        back = connect(members.plan.leader_address, SECRET.encode(),
                       {"node_rank": 1, "host": "gpu-1", "pid": 4002})
        try:
            gathered(members, lambda got: any(e == "node_joined" for e, _ in got.entries))
            out = Gathered()
            for step in (15, 20):  # a second checkpoint in the same attempt asks nothing more
                members._rank_event(0, WorkerEvent(type="checkpoint", rank=0, time=0.0,
                                                   data={"step": step}), out)
            [finding] = out.findings
            assert finding.incident is Incident.NODE_JOINED and finding.step == 15
            assert finding.evidence["joining"] == [1] and finding.evidence["grow_to"] == [0, 1]
            assert "grow back to 2 from the checkpoint of step 15" in finding.message
        finally:
            back.close()


def test_a_rerun_keeps_its_nodes_and_the_job_grows_after_its_verdict(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--nnodes 1:2`, node 1 back while the job runs on node 0: a spike's rerun replays on
    node 0 alone, and its checkpoints ask nothing (growing would end it before its verdict);
    the first checkpoint after the verdict grows the job."""
    with leading(tmp_path, monkeypatch, "1:2") as members:
        peer = join(members, Said())
        members.launch(0, Directive(), time.monotonic())
        peer.close()
        gathered(members, lambda got: any(e == "node_lost" for e, _ in got.entries))
        members.launch(1, Directive(attempt=1), time.monotonic())
        back = connect(members.plan.leader_address, SECRET.encode(),
                       {"node_rank": 1, "host": "gpu-1", "pid": 4002})
        try:
            gathered(members, lambda got: any(e == "node_joined" for e, _ in got.entries))
            fields = members.launch(2, Directive(attempt=2), time.monotonic(), keep_nodes=True)
            assert fields["nodes"] == [0]
            out = Gathered()
            members._rank_event(0, WorkerEvent(type="checkpoint", rank=0, time=0.0,
                                               data={"step": 15}), out)
            assert out.findings == []
            members.hear({"event": "rerun", "verdict": "transient", "detected_step": 18,
                          "moved_first": []})
            assert members._first_pass == {}  # node 0's ranks never said hello here
            members._rank_event(0, WorkerEvent(type="checkpoint", rank=0, time=0.0,
                                               data={"step": 20}), out)
            [finding] = out.findings
            assert finding.incident is Incident.NODE_JOINED and finding.step == 20
        finally:
            back.close()


def slow(node_ranks: tuple[int, ...], slowdown: float, step: int = 200,
         detector: str = "slow_compute") -> Finding:
    signal = {"signal": "forward", "ratio": 3.0} if detector == "slow_compute" else \
        {"signal": "link", "ratio": 500.0, "link_s": 0.05, "median_s": 0.0001}
    return Finding(incident=Incident.STRAGGLER, detector=detector,
                   severity=Severity.WARNING, step=step, onset_step=100, message="slow",
                   ranks=node_ranks, evidence={**signal, "slowdown": slowdown})


def test_a_gpu_fault_on_a_followers_node_evicts_it_at_the_next_launch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A follower's GPU reported Xid 79 (its ``gpu_watch``, sent as a node finding): the
    leader places it on node 1 and the relaunch the policy answers with runs without it."""
    with leading(tmp_path, monkeypatch, "1:2") as members:
        said = Said()
        join(members, said)
        members.launch(0, Directive(), time.monotonic())
        members.cluster.rank_node.update({0: 0, 1: 0, 2: 1, 3: 1})
        fault = Finding(incident=Incident.GPU_FAULT, detector="gpu", severity=Severity.CRITICAL,
                        step=40, onset_step=31, message="GPU fault at step 40", ranks=(2, 3),
                        evidence={"gpus": {"0": ["Xid 79 (fallen off the bus)"]}})
        placed = members.locate(fault)
        assert placed.evidence["node"] == 1
        members.prepare(Remedy(Action.ROLLBACK, placed, "gpu_fault -> rollback"), 1)
        members.launch(1, Directive(attempt=1), time.monotonic())
        assert members.cluster.attempt.nodes == [0]
        [evicted] = [f for event, f in said.journal if event == "node_evicted"]
        assert evicted["node"] == 1
        assert evicted["why"] == ("GPU fault at step 40 (GPU 0: Xid 79 (fallen off the bus)) "
                                  "on its rank(s)")


class Measured:
    """A connection whose round trip the kernel gave as ``rtt`` (the one seam: a slow link is
    real in ``tests/e2e/test_multinode.py``)."""

    def __init__(self, rtt: float | None) -> None:
        self._rtt = rtt

    def rtt(self) -> float | None:
        return self._rtt


def test_the_leader_puts_its_slowest_followers_link_against_the_others(
        members: ClusterMembers) -> None:
    """Each merged step carries the slowest follower's round trip against the (lower) median
    of the followers', named by that node's lowest rank; one link alone names nobody."""
    cluster = members.cluster
    cluster.rank_node.update({0: 0, 1: 0, 2: 1, 3: 1, 4: 2, 5: 2, 6: 3, 7: 3})
    cluster.attempt.peers = cast(dict[int, Peer], {
        1: Measured(0.0001), 2: Measured(0.02), 3: Measured(0.0002)})
    assert cluster.links() == Spread(rank=4, value=0.02, median=0.0002, count=3)
    cluster.attempt.peers = cast(dict[int, Peer], {1: Measured(0.0001), 2: Measured(0.02)})
    assert cluster.links() == Spread(rank=4, value=0.02, median=0.0001, count=2)
    cluster.attempt.peers = cast(dict[int, Peer], {1: Measured(0.0001), 2: Measured(None)})
    assert cluster.links() is None  # one link alone cannot say which end is slow


@contextlib.contextmanager
def slow_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ran_s: float,
             relaunch_s: float) -> Iterator[tuple[ClusterMembers, Said]]:
    """A `--nnodes 1:2` leader and a follower, 2 ranks each, launched: the run has gone on
    ``ran_s`` and a relaunch was measured at ``relaunch_s`` (what a slow node's cost weighs)."""
    with leading(tmp_path, monkeypatch, "1:2") as members:
        said = Said()
        join(members, said)
        members.launch(0, Directive(), time.monotonic())
        members.cluster.rank_node.update({0: 0, 1: 0, 2: 1, 3: 1})
        members._began -= ran_s
        members._starts = [relaunch_s]
        yield members, said


@pytest.mark.parametrize(("detector", "what"), [
    ("slow_compute", "its compute is 3.0x the others'"),
    ("slow_link", "its link's round trip is 50 ms against the others' 0.1 ms")])
def test_a_slow_node_is_evicted_at_the_next_checkpoint_when_the_cost_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, detector: str, what: str) -> None:
    """`--nnodes 1:2`, 1,000 s in, a relaunch measured at 5 s: node 1 at 30% slower costs
    300 s kept against 505 s evicted (5 s and half the work for the 1,000 s left): kept, and
    said. At 60% (600 s) it goes: at the attempt's next checkpoint, a ``slow_node`` finding,
    and the next launch evicts it. Its compute or its link alike."""
    with slow_job(tmp_path, monkeypatch, ran_s=1000.0, relaunch_s=5.0) as (members, said):

        kept = members.locate(slow((2, 3), 0.3, detector=detector))
        assert kept.evidence["node"] == 1 and kept.evidence["cost"]["evict"] is False
        assert "kept: it costs less than a relaunch without it" in kept.message
        out = Gathered()
        members._rank_event(0, WorkerEvent(type="checkpoint", rank=0, time=0.0,
                                           data={"step": 210}), out)
        assert out.findings == []

        evict = members.locate(slow((3,), 0.6, detector=detector))
        assert "evicting it at the next checkpoint" in evict.message
        members._rank_event(0, WorkerEvent(type="checkpoint", rank=0, time=0.0,
                                           data={"step": 225}), out)
        [finding] = out.findings
        assert finding.incident is Incident.SLOW_NODE and finding.step == 225
        assert "relaunch without it from the checkpoint of step 225" in finding.message
        costs = [f for event, f in said.journal if event == "slow_node_cost"]
        assert [c["verdict"] for c in costs] == ["keep", "evict"]
        assert costs[1]["keep_s"] == pytest.approx(600, rel=0.01)
        assert costs[1]["evict_s"] == pytest.approx(505, rel=0.01)

        members.prepare(Remedy(Action.RELAUNCH, finding, "slow_node -> relaunch"), 1)
        members.launch(1, Directive(attempt=1), time.monotonic())
        assert 1 in members.cluster.evicted and members.cluster.attempt.nodes == [0]
        [evicted] = [f for event, f in said.journal if event == "node_evicted"]
        assert evicted["node"] == 1 and what in evicted["why"]


def test_a_slow_node_kept_early_is_evicted_when_it_is_told_again_later(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--nnodes 1:2`, 100 s into the run, a relaunch measured at 50 s: node 1 at 60% slower
    costs 60 s over the ~100 s the run may still go (as long as it has), against 100 s for a
    relaunch and half the work: kept. The detector tells it again each time it has been at it
    twice as long; 1,100 s in, the same 60% costs 660 s against 600 s: evicted."""
    with slow_job(tmp_path, monkeypatch, ran_s=100.0, relaunch_s=50.0) as (members, said):
        assert "kept: it costs less" in members.locate(slow((2, 3), 0.6)).message
        members._began -= 1000.0
        again = dataclasses.replace(slow((2, 3), 0.6, step=900), evidence={
            **slow((2, 3), 0.6).evidence, "again": True})
        assert "evicting it at the next checkpoint" in members.locate(again).message
        out = Gathered()
        members._rank_event(0, WorkerEvent(type="checkpoint", rank=0, time=0.0,
                                           data={"step": 925}), out)
        [finding] = out.findings
        assert finding.incident is Incident.SLOW_NODE and finding.evidence["node"] == 1
        costs = [f for event, f in said.journal if event == "slow_node_cost"]
        assert [(c["verdict"], c["detected_step"]) for c in costs] == [("keep", 200),
                                                                        ("evict", 900)]


def test_a_slow_node_the_run_cannot_do_without_is_kept(members: ClusterMembers) -> None:
    """A fixed two-node run: however slow node 1 is, one node would be below the minimum."""
    said = Said()
    join(members, said)
    members.launch(0, Directive(), time.monotonic())
    members.cluster.rank_node.update({2: 1})
    members._began -= 1000.0
    members._starts = [5.0]
    kept = members.locate(slow((2,), 0.9))
    assert "kept: 1 node(s) would be left, below the minimum 2" in kept.message


def test_a_leader_taking_over_knows_the_machine_faults_the_lost_one_counted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The lost leader had counted one SIGSEGV on node 1 and evicted node 2: the new leader
    reads both back from the run's journal, so one more SIGSEGV on node 1 evicts it."""
    with leading(tmp_path, monkeypatch, "1:3", expect=[1]) as members:
        segv = Finding(incident=Incident.CRASH, detector="crash", severity=Severity.CRITICAL,
                       step=9, onset_step=9, message="m", ranks=(2,),
                       evidence={"class": "signal", "signal": 11, "node": 1, "host": "gpu-1"})
        with open(members.plan.shared_dir / "events.jsonl", "a") as f:
            for entry in ({"event": "finding", "finding": segv.to_json()},
                          {"event": "node_evicted", "node": 2, "why": "sdc"}):
                f.write(json.dumps(entry) + "\n")
        join(members, Said())
        assert members.faults.seen == {1: ["SIGSEGV at step 9"]}
        assert members.cluster.evicted == {2: "sdc"} and not members._evictable
        members.launch(0, Directive(), time.monotonic())
        members.cluster.rank_node[2] = 1
        members.locate(dataclasses.replace(segv, step=30, onset_step=30))
        assert members._evictable == {1: "2 machine faults on it: SIGSEGV at step 9, "
                                         "SIGSEGV at step 30"}


def test_a_relaunch_for_another_reason_before_the_checkpoint_takes_the_slow_node_out(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with leading(tmp_path, monkeypatch, "1:2") as members:
        join(members, Said())
        members.launch(0, Directive(), time.monotonic())
        members.cluster.rank_node.update({2: 1})
        members._began -= 1000.0
        members._starts = [5.0]
        assert "evicting it" in members.locate(slow((2,), 0.9)).message
        members.prepare(Remedy(Action.RELAUNCH, hang_finding(0), "hang -> relaunch"), 1)
        members.launch(1, Directive(attempt=1), time.monotonic())
        assert 1 in members.cluster.evicted and members.cluster.attempt.nodes == [0]
