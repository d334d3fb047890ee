"""A follower node's babysitter (``supervisor.cluster.follower``), driven by a scripted leader.

The leader's end is a real ``wire.Listener`` on loopback that the test plays from a thread,
message by message, reading what the follower sends as the leader reads it
(``messages.from_follower``). The follower runs for real in the test's main thread (it installs
signal handlers), and its torchrun is a real process: ``launch.python`` points at a shell script
that records its command line and sleeps (or exits), so what is stopped, and when, is a real
process's fate. The one thing left out is ``become_subreaper``, which would change the test
runner's own process for every test after this one.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from babysit.supervisor.cluster import leadership
from babysit.supervisor.cluster.follower import Follower
from babysit.supervisor.cluster.leadership import Lease, Term
from babysit.supervisor.cluster.messages import (
    Beat,
    Control,
    Exited,
    Finish,
    FollowerMessage,
    Launch,
    LeaderMessage,
    Leaving,
    Refused,
    Stop,
    Stopped,
    encode,
    from_follower,
)
from babysit.supervisor.cluster.wire import Listener, Peer
from babysit.supervisor.config.plan import SECRET_ENV, RunPlan, from_mapping
from babysit.supervisor.contract.directive import CONTROL_FILE, Directive
from babysit.supervisor.node import launcher
from babysit.supervisor.run import exit_codes
from babysit.supervisor.run.console import Console

SECRET = b"cluster-follower-test-secret"
LOST_AFTER_S = 1.0
T = TypeVar("T")


class ScriptedLeader:
    """The leader's end of the wire, played by a test script."""

    def __init__(self, listener: Listener) -> None:
        self.listener = listener
        self.peer: Peer | None = None
        self.heard: list[FollowerMessage] = []
        """Everything the follower sent on the current connection, beats included."""

    def join(self, timeout: float = 10.0) -> Peer:
        """Wait for the follower's next connection."""
        deadline = time.monotonic() + timeout
        while True:
            new = self.listener.accept()
            if new:  # the newest: earlier ones the follower has given up already
                self.peer = new[-1]
                self.heard = []
                return self.peer
            assert time.monotonic() < deadline, "the follower did not join"
            time.sleep(0.01)

    def send(self, message: LeaderMessage | dict[str, Any]) -> None:
        assert self.peer is not None
        assert self.peer.send(message if isinstance(message, dict) else encode(message))

    def expect(self, kind: type[T], timeout: float = 10.0) -> T:
        """The follower's next message of ``kind`` not yet expected."""
        assert self.peer is not None
        deadline = time.monotonic() + timeout
        seen = 0
        while True:
            self.heard += [from_follower(m) for m in self.peer.receive()]
            for message in self.heard[seen:]:
                seen += 1
                if isinstance(message, kind):
                    self.heard = self.heard[seen:]
                    return message
            assert time.monotonic() < deadline, f"no {kind.__name__}: {self.heard}"
            time.sleep(0.01)


class FakeTorchrun:
    """``launch.python``: records the command line and its pid, then sleeps or exits."""

    def __init__(self, folder: Path, exit_code: int | None = None) -> None:
        self.path = folder / "fake-python"
        self.args_file = folder / "torchrun-args"
        self.pid_file = folder / "torchrun-pid"
        end = "exec sleep 60" if exit_code is None else f"exit {exit_code}"
        self.path.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {self.args_file}\n"
                             f"echo $$ > {self.pid_file}.tmp && mv {self.pid_file}.tmp "
                             f"{self.pid_file}\n{end}\n")
        self.path.chmod(0o755)

    def started(self, timeout: float = 10.0) -> int:
        """The pid of the running fake, once it started."""
        deadline = time.monotonic() + timeout
        while not self.pid_file.exists():
            assert time.monotonic() < deadline, "torchrun was not started"
            time.sleep(0.01)
        return int(self.pid_file.read_text())

    def args(self) -> list[str]:
        return self.args_file.read_text().splitlines()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def listener() -> Iterator[Listener]:
    with Listener("127.0.0.1", 0, SECRET) as opened:
        yield opened


@pytest.fixture
def leader(listener: Listener) -> ScriptedLeader:
    return ScriptedLeader(listener)


@pytest.fixture(autouse=True)
def own_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The follower installs SIGINT/SIGTERM handlers and would make this process a subreaper:
    keep the test runner as it was."""
    monkeypatch.setenv(SECRET_ENV, SECRET.decode())
    monkeypatch.setattr(launcher, "become_subreaper", lambda: None)
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def make_plan(tmp_path: Path, listener: Listener, torchrun: FakeTorchrun,
              rejoin_timeout_s: float = 30.0) -> RunPlan:
    script = tmp_path / "train.py"
    script.write_text("print('training')\n")
    config = {
        "launch": {"script": str(script), "nproc_per_node": 2, "nnodes": "2", "node_rank": 1,
                   "python": str(torchrun.path), "stop_grace_s": 2.0},
        "nodes": {"leader": listener.address, "heartbeat_s": 0.2,
                  "lost_after_s": LOST_AFTER_S, "join_timeout_s": 10.0,
                  "rejoin_timeout_s": rejoin_timeout_s},
    }
    return from_mapping(config, "test", tmp_path, "t", run_dir=str(tmp_path / "run"))


class Run:
    """One follower, run to its end against a script."""

    def __init__(self, tmp_path: Path, listener: Listener, exit_code: int | None = None,
                 rejoin_timeout_s: float = 30.0) -> None:
        self.torchrun = FakeTorchrun(tmp_path, exit_code)
        self.plan = make_plan(tmp_path, listener, self.torchrun, rejoin_timeout_s)
        self.output = io.StringIO()
        self.follower = Follower(self.plan, Console(self.output, tty=False), self.plan.secret())
        self.listener = listener

    def against(self, script: Callable[[], None]) -> int | Term:
        """Run the follower to its exit code while ``script`` plays the leader. A script that
        fails hangs up, so the follower ends too; one that leaves the follower running fails."""
        errors: list[BaseException] = []
        done = threading.Event()

        def play() -> None:
            try:
                script()
                if not done.wait(20.0):
                    errors.append(AssertionError("the follower did not exit"))
            except BaseException as exc:
                errors.append(exc)
            if not done.is_set():
                self.listener.close()

        thread = threading.Thread(target=play, daemon=True)
        thread.start()
        try:
            code = self.follower.run()
        finally:
            done.set()
            thread.join(timeout=5.0)
        if errors:
            raise errors[0]
        return code

    def journal(self, event: str) -> list[dict[str, Any]]:
        lines = (self.plan.run_dir / "events.jsonl").read_text().splitlines()
        return [e for e in map(json.loads, lines) if e["event"] == event]


def launch(attempt: int = 1, **fields: Any) -> Launch:
    return Launch(**{"attempt": attempt, "directive": Directive(attempt=attempt),
                     "rdzv_id": f"t-{attempt}", "rdzv_endpoint": "127.0.0.1:29999",
                     "nnodes": 2, "node_rank": 1, **fields})


# -- commands -------------------------------------------------------------------------------------


def test_a_launch_starts_torchrun_as_told_and_a_stop_is_answered_with_stopped(
        tmp_path: Path, listener: Listener, leader: ScriptedLeader) -> None:
    run = Run(tmp_path, listener)
    pids: list[int] = []

    def script() -> None:
        leader.join()
        leader.send(launch(2, directive=Directive(attempt=2, lr_scale=0.5), nnodes=3,
                           node_rank=2, rdzv_id="job-2", rdzv_endpoint="10.0.0.9:29400"))
        pids.append(run.torchrun.started())
        leader.send(Stop("a hang on node 2", replacing=True))
        assert leader.expect(Stopped) == Stopped(attempt=2)
        assert not alive(pids[0])  # stopped before it said so
        leader.send(Finish(0))

    assert run.against(script) == 0

    args = " ".join(run.torchrun.args())
    for flag in ("--nnodes 3", "--rdzv-id job-2", "--rdzv-endpoint 10.0.0.9:29400"):
        assert flag in args
    assert "--node-rank" not in args  # c10d ignores it, and torchrun warns that it does
    attempt_dir = run.follower.workers.attempt_dir(2)
    written = Directive.from_json(json.loads((attempt_dir / "directive.json").read_text()))
    # As told, plus where this node's ranks keep state (checkpoints.every_steps: auto, the
    # default): their marks and memory copies in this node's own folder.
    assert dataclasses.replace(written, just_in_time={}, memory={}) == \
        Directive(attempt=2, lr_scale=0.5)
    assert "-n1" in written.just_in_time["marks"]
    [stop] = run.journal("stop_workers")
    assert stop["reason"] == "a hang on node 2" and pids[0] in stop["pids"]
    assert run.journal("follower_finished")[0]["exit_code"] == 0


def test_finish_stops_the_workers_and_exits_with_the_runs_code(
        tmp_path: Path, listener: Listener, leader: ScriptedLeader) -> None:
    run = Run(tmp_path, listener)
    pids: list[int] = []

    def script() -> None:
        leader.join()
        leader.send(launch())
        pids.append(run.torchrun.started())
        leader.send(Finish(3))

    assert run.against(script) == 3

    assert not alive(pids[0])
    assert run.journal("stop_workers")[0]["reason"] == "the run is over"


def test_a_control_request_reaches_the_attempts_control_file(
        tmp_path: Path, listener: Listener, leader: ScriptedLeader) -> None:
    run = Run(tmp_path, listener)
    control = run.follower.workers.attempt_dir(1) / CONTROL_FILE

    def script() -> None:
        leader.join()
        leader.send(launch())
        run.torchrun.started()
        leader.send(Control({"final_checkpoint": True}))
        deadline = time.monotonic() + 10.0
        while not control.exists():
            assert time.monotonic() < deadline, "no control file"
            time.sleep(0.01)
        leader.send(Finish(0))

    assert run.against(script) == 0

    assert json.loads(control.read_text()) == {"final_checkpoint": True}
    assert run.journal("control")[0]["fields"] == {"final_checkpoint": True}


def test_torchruns_own_exit_is_reported_with_its_attempt(
        tmp_path: Path, listener: Listener, leader: ScriptedLeader) -> None:
    run = Run(tmp_path, listener, exit_code=3)
    exits: list[Exited] = []

    def script() -> None:
        leader.join()
        leader.send(launch(4))
        exits.append(leader.expect(Exited))
        leader.send(Finish(1))

    assert run.against(script) == 1

    [exited] = exits
    assert (exited.attempt, exited.code, exited.step) == (4, 3, 0)
    assert run.journal("workers_exited")[0]["exit_code"] == 3


def test_a_message_the_follower_cannot_read_is_journaled_and_ignored(
        tmp_path: Path, listener: Listener, leader: ScriptedLeader) -> None:
    run = Run(tmp_path, listener)

    def script() -> None:
        leader.join()
        leader.send({"type": "teleport", "to": "node 9"})
        leader.send({**encode(launch()), "attempt": "one"})
        leader.send(Finish(0))

    assert run.against(script) == 0

    refused = run.journal("leader_message_refused")
    assert [e["type"] for e in refused] == ["teleport", "launch"]
    assert "unknown type 'teleport'" in refused[0]["error"]
    assert "field 'attempt' is not an integer: 'one'" in refused[1]["error"]
    assert run.journal("launch") == []  # nothing was started from it
    assert "ignoring a message from the leader" in run.output.getvalue()


# -- joining --------------------------------------------------------------------------------------


def test_a_final_refusal_ends_the_follower_with_code_1(
        tmp_path: Path, listener: Listener, leader: ScriptedLeader) -> None:
    run = Run(tmp_path, listener)

    def script() -> None:
        leader.join()
        leader.send(Refused("node rank 1 is not in 1..0 (launch.nnodes)", final=True))

    assert run.against(script) == 1

    assert run.journal("join_refused")[0]["why"] == "node rank 1 is not in 1..0 (launch.nnodes)"
    assert run.journal("follower_finished")[0]["exit_code"] == 1


def test_a_refusal_that_is_not_final_joins_again(
        tmp_path: Path, listener: Listener, leader: ScriptedLeader) -> None:
    run = Run(tmp_path, listener)

    def script() -> None:
        leader.join()
        leader.send(Refused("node rank 1 is already taken by gpu-a", final=False))
        leader.join()  # its previous connection was still seen open: it tries again
        leader.send(Finish(0))

    assert run.against(script) == 0

    assert [e["why"] for e in run.journal("join_refused")] == [
        "node rank 1 is already taken by gpu-a; trying again"]
    assert len(run.journal("joined")) == 2


# -- the leader's loss ----------------------------------------------------------------------------


def test_when_the_leader_is_gone_the_follower_stops_its_workers_and_claims_the_next_term(
        tmp_path: Path, listener: Listener, leader: ScriptedLeader) -> None:
    run = Run(tmp_path, listener)
    leadership.claim(run.plan.shared_dir, 0, 0, "gpu-0", listener.address)  # and no lease
    pids: list[int] = []

    def script() -> None:
        leader.join().keep_alive(0.2, encode(Beat()))
        leader.send(launch())
        pids.append(run.torchrun.started())
        listener.close()  # the leader's babysitter is gone, and its connections with it

    term = run.against(script)

    assert isinstance(term, Term) and (term.epoch, term.node) == (1, 1)
    assert leadership.newest(run.plan.shared_dir) == term
    # It leads from the address it reached the old leader from, on the leader's port.
    assert term.address == f"127.0.0.1:{listener.port}"
    assert not alive(pids[0])
    [stop] = run.journal("stop_workers")
    assert stop["reason"] == "leader lost: connection closed (eof)"
    assert run.journal("leader_lost")[0]["why"] == "connection closed (eof)"
    [elected] = run.journal("leader_elected")
    assert elected["previous"] == 0 and elected["term"] == 1
    assert "the leader (node 0) is gone; this node leads from here" in run.output.getvalue()


def test_a_leader_silent_for_lost_after_s_is_lost_too(
        tmp_path: Path, listener: Listener, leader: ScriptedLeader) -> None:
    run = Run(tmp_path, listener)
    leadership.claim(run.plan.shared_dir, 0, 0, "gpu-0", listener.address)
    pids: list[int] = []
    started = time.monotonic()

    def script() -> None:
        leader.join()  # and never a beat: a leader stuck, or a network that drops everything
        leader.send(launch())
        pids.append(run.torchrun.started())

    assert isinstance(run.against(script), Term)

    assert time.monotonic() - started > LOST_AFTER_S
    assert not alive(pids[0])
    [lost] = run.journal("leader_lost")
    assert lost["why"].startswith("silent for ")


def test_a_follower_cut_off_from_a_live_leader_rejoins_it_and_claims_nothing(
        tmp_path: Path, listener: Listener, leader: ScriptedLeader) -> None:
    run = Run(tmp_path, listener)
    leadership.claim(run.plan.shared_dir, 0, 0, "gpu-0", listener.address)
    lease = Lease(run.plan.shared_dir, 0, "gpu-0", every_s=0.1).start()  # the leader lives
    pids: list[int] = []

    def script() -> None:
        leader.join().keep_alive(0.2, encode(Beat()))
        leader.send(launch())
        pids.append(run.torchrun.started())
        assert leader.peer is not None
        leader.peer.close()  # this connection breaks (a partition), the leader does not
        time.sleep(3 * LOST_AFTER_S)  # longer than a dead leader's lease would need
        leader.join(timeout=10.0).keep_alive(0.2, encode(Beat()))
        leader.send(Finish(0))

    try:
        assert run.against(script) == 0
    finally:
        lease.leave()

    assert not alive(pids[0])  # stopped at once: it cannot train cut off from the others
    assert len(run.journal("joined")) >= 2 and not run.journal("leader_elected")
    assert leadership.newest(run.plan.shared_dir).epoch == 0


def test_a_follower_cut_off_past_rejoin_timeout_leaves_for_a_requeue(
        tmp_path: Path, listener: Listener, leader: ScriptedLeader) -> None:
    run = Run(tmp_path, listener, rejoin_timeout_s=1.5)
    leadership.claim(run.plan.shared_dir, 0, 0, "gpu-0", listener.address)
    lease = Lease(run.plan.shared_dir, 0, "gpu-0", every_s=0.1).start()

    def script() -> None:
        leader.join().keep_alive(0.2, encode(Beat()))
        listener.close()  # unreachable from here, yet beating: the link is down, not the node

    try:
        assert run.against(script) == exit_codes.REQUEUE
    finally:
        lease.leave()
    [gave_up] = run.journal("rejoin_timeout")
    assert "nodes.rejoin_timeout_s" in gave_up["why"]
    assert not run.journal("leader_elected")


def test_sigint_stops_the_node_and_tells_the_leader_it_is_leaving(
        tmp_path: Path, listener: Listener, leader: ScriptedLeader) -> None:
    run = Run(tmp_path, listener)
    pids: list[int] = []
    said: list[Leaving] = []

    def script() -> None:
        leader.join().keep_alive(0.2, encode(Beat()))
        leader.send(launch())
        pids.append(run.torchrun.started())
        os.kill(os.getpid(), signal.SIGINT)  # handled in the main thread, by the follower
        said.append(leader.expect(Leaving))

    assert run.against(script) == 128 + signal.SIGINT

    assert said == [Leaving(f"signal {signal.SIGINT}")]
    assert not alive(pids[0])


def test_a_follower_whose_leader_is_lost_joins_the_node_that_won_the_next_term(
        tmp_path: Path, listener: Listener, leader: ScriptedLeader) -> None:
    """Three nodes: node 2 claimed term 1 first; this follower (node 1) must join it at the
    address its term gives, not claim a term of its own."""
    run = Run(tmp_path, listener)
    leadership.claim(run.plan.shared_dir, 0, 0, "gpu-0", listener.address)
    with Listener("127.0.0.1", 0, SECRET) as second:
        winner = ScriptedLeader(second)

        def script() -> None:
            leader.join().keep_alive(0.2, encode(Beat()))
            leader.send(launch())
            run.torchrun.started()
            assert leadership.claim(run.plan.shared_dir, 1, 2, "gpu-2", second.address)
            listener.close()  # node 0 is gone; node 2 leads term 1
            winner.join(timeout=10.0).keep_alive(0.2, encode(Beat()))
            winner.send(Finish(0))

        assert run.against(script) == 0
    assert [e["term"] for e in run.journal("joined")] == [0, 1]
    assert run.journal("joined")[-1]["leader"] == second.address
    assert not run.journal("leader_elected")
    assert leadership.newest(run.plan.shared_dir).node == 2
