"""After every rank closed its run: is the process teardown stuck (``node/teardown.py``)?
Real processes stand in for the ranks: one blocked (idle), one working, one exited."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import psutil
import pytest

from babysit.supervisor.node.teardown import Teardown


@pytest.fixture
def procs() -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    started = {
        "blocked": subprocess.Popen(
            [sys.executable, "-c", "import time; print(flush=True); time.sleep(60)"],
            stdout=subprocess.PIPE),
        "working": subprocess.Popen([sys.executable, "-c", "while True: pass"]),
        "exited": subprocess.Popen([sys.executable, "-c", "pass"]),
    }
    started["exited"].wait()
    # Past its interpreter's start (CPU, on a loaded machine for a while): asleep from here.
    assert started["blocked"].stdout is not None
    started["blocked"].stdout.readline()
    yield started
    for p in started.values():
        p.kill()
        p.wait()
        if p.stdout is not None:
            p.stdout.close()


@pytest.fixture
def zombie() -> Iterator[subprocess.Popen[bytes]]:
    """A rank process that exited and that its parent (this test, standing for torchrun) has
    not reaped yet."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and \
            psutil.Process(proc.pid).status() != psutil.STATUS_ZOMBIE:
        time.sleep(0.02)
    yield proc
    proc.wait()


def test_a_rank_blocked_with_no_cpu_for_idle_s_is_stuck_and_one_working_is_not(
        procs: dict[str, subprocess.Popen[bytes]]) -> None:
    blocked = Teardown({0: procs["blocked"].pid}, now=0.0, idle_s=0.3)
    working = Teardown({0: procs["working"].pid}, now=0.0, idle_s=0.3)
    assert not blocked.stuck(0.1) and not working.stuck(0.1)  # not idle_s yet
    time.sleep(0.4)
    assert blocked.stuck(0.4) and not blocked.exited
    assert blocked.seen[0].cpu < Teardown.IDLE_CPU
    assert not working.stuck(0.4)  # it works: looked at again later


def test_torchrun_outliving_its_exited_ranks_is_stuck_after_a_few_seconds_not_idle_s(
        procs: dict[str, subprocess.Popen[bytes]]) -> None:
    """Every rank's process is gone and torchrun is still up: on several nodes, its agent waits
    in its exit barrier for a node whose rank aborted. Judged after ``EXITED_S``, not the
    30 s idle window; a rank still alive keeps it the idle judgement's."""
    gone = Teardown({0: procs["exited"].pid, 1: procs["exited"].pid}, now=0.0, idle_s=30.0)
    assert not gone.stuck(0.0)
    assert not gone.stuck(Teardown.EXITED_S - 0.5)
    assert gone.stuck(Teardown.EXITED_S + 0.1) and gone.exited
    assert {p.state for p in gone.seen.values()} == {"gone"}
    one_left = Teardown({0: procs["exited"].pid, 1: procs["blocked"].pid}, now=0.0,
                        idle_s=30.0)
    assert not one_left.stuck(Teardown.EXITED_S + 0.1) and not one_left.exited


def test_ranks_torchrun_has_not_reaped_yet_are_no_wait_on_its_exit_barrier(
        zombie: subprocess.Popen[bytes]) -> None:
    """A rank that exited but is still a zombie: its torchrun has not looked yet (a loaded
    machine), so it is not waiting on its exit barrier. Given ``idle_s``, not ``EXITED_S``;
    once reaped, ``EXITED_S`` from then."""
    unreaped = Teardown({0: zombie.pid}, now=0.0, idle_s=30.0)
    assert not unreaped.stuck(0.0) and not unreaped.stuck(Teardown.EXITED_S + 1)
    zombie.wait()  # torchrun looks: reaped
    assert not unreaped.stuck(20.0) and not unreaped.stuck(20.0 + Teardown.EXITED_S - 0.5)
    assert unreaped.stuck(20.0 + Teardown.EXITED_S) and unreaped.exited


def test_a_torchrun_that_never_reaps_its_ranks_is_stuck_after_idle_s(
        zombie: subprocess.Popen[bytes]) -> None:
    unreaped = Teardown({0: zombie.pid}, now=0.0, idle_s=30.0)
    assert not unreaped.stuck(0.0) and not unreaped.stuck(29.0)
    assert unreaped.stuck(30.0) and unreaped.exited


def test_on_several_nodes_torchrun_is_waited_for_as_long_as_another_node_may_still_come(
        procs: dict[str, subprocess.Popen[bytes]]) -> None:
    """A follower's torchrun lingers in its exit barrier for the other nodes, whose teardowns
    their own babysitters give ``idle_s``: it waits that long more (``linger_s``). The leader's
    hosts the rendezvous store: stopping it while another node's torchrun runs takes the store
    from under that node's exit barrier and shutdown, so it waits while they run, and
    ``EXITED_S`` from the tick that says they are gone."""
    ranks = {0: procs["exited"].pid}
    follower = Teardown(ranks, now=0.0, idle_s=8.0, linger_s=8.0 + Teardown.EXITED_S)
    assert not follower.stuck(0.0) and not follower.stuck(Teardown.EXITED_S + 1)
    assert follower.stuck(8.0 + Teardown.EXITED_S) and follower.exited
    leader = Teardown(ranks, now=0.0, idle_s=8.0)
    assert not leader.stuck(0.0, others_up=True)
    assert not leader.stuck(100.0, others_up=True)  # another node still tears down
    assert not leader.stuck(101.0) and not leader.stuck(101.0 + Teardown.EXITED_S - 0.5)
    assert leader.stuck(101.0 + Teardown.EXITED_S) and leader.exited


def test_a_torchrun_still_working_after_its_ranks_are_gone_is_shutting_down_not_waiting(
        procs: dict[str, subprocess.Popen[bytes]]) -> None:
    """Every rank's process is gone; torchrun is still up ``EXITED_S`` later. One that sleeps
    (on its exit barrier's socket) is stuck; one that runs is shutting down on a loaded machine
    and is looked at again ``EXITED_S`` later (a CI run counted a clean end as a hung teardown
    when torchrun took over 3 s there)."""
    ranks = {0: procs["exited"].pid}
    waiting = Teardown(ranks, now=0.0, idle_s=30.0, launcher=procs["blocked"].pid)
    working = Teardown(ranks, now=0.0, idle_s=30.0, launcher=procs["working"].pid)
    assert not waiting.stuck(0.0) and not working.stuck(0.0)
    time.sleep(0.3)  # real time for the CPU each uses
    assert waiting.stuck(Teardown.EXITED_S) and waiting.exited
    assert not working.stuck(Teardown.EXITED_S) and not working.exited
    time.sleep(0.3)
    assert not working.stuck(2 * Teardown.EXITED_S)  # still at it
    procs["working"].kill()
    procs["working"].wait()
    assert working.stuck(3 * Teardown.EXITED_S) and working.exited
