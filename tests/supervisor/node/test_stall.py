"""The hang confirmation (``supervisor.node.stall``): naming the right rank from evidence, its
process state, CPU and stacks (pure). Crash blame: ``tests/supervisor/run/test_watch.py``; the
hang detector: ``tests/policies/detectors/test_detectors.py``; all of it for real in one run:
``tests/e2e/test_blame.py``."""

from __future__ import annotations

from typing import Any

from babysit.supervisor.node.stacks import StackVerdict
from babysit.supervisor.node.stall import RankProcess, judge


def proc(rank: int, cpu: float = 0.0, state: str = "sleeping") -> RankProcess:
    return RankProcess(rank, 1000 + rank, state, cpu)


def collective(waiting: tuple[int, ...], suspects: tuple[int, ...] = ()) -> StackVerdict:
    evidence = {r: ["finalize_backward (libtorch_cpu.so)"] for r in waiting}
    return StackVerdict(suspects, "rank 1 is outside any collective, at main (train.py:9), "
                        "while rank 0 waits for it", evidence, waiting, "collective")


def test_a_stopped_rank_is_a_hang_named_without_its_stack() -> None:
    verdict = judge({0: proc(0), 1: proc(1, state="stopped")}, collective((0,)))
    assert verdict.hung and verdict.ranks == (1,) and "stopped" in verdict.reason


def test_an_idle_rank_outside_the_collective_is_the_hang() -> None:
    verdict = judge({0: proc(0), 1: proc(1, cpu=0.01)}, collective((0,), (1,)))
    assert verdict.hung and verdict.ranks == (1,)
    assert "CPU 1% of a core" in verdict.reason


def test_a_busy_rank_outside_the_collective_is_slow_work_not_a_hang() -> None:
    # A slow eval without phase(), a GC pause, a long first step: rank 0 computes.
    verdict = judge({0: proc(0, cpu=0.95, state="running"), 1: proc(1)},
                    collective((1,), (0,)))
    assert not verdict.hung and verdict.ranks == (0,) and "watching on" in verdict.reason


def test_uninterruptible_io_counts_as_work() -> None:
    verdict = judge({0: proc(0, state="disk-sleep"), 1: proc(1)}, collective((1,), (0,)))
    assert not verdict.hung


def test_waiting_ranks_are_not_judged_by_their_cpu() -> None:
    # NCCL's host threads may spin while they wait: rank 0's CPU does not make it "working".
    verdict = judge({0: proc(0, cpu=1.0), 1: proc(1)}, collective((0,), (1,)))
    assert verdict.hung and verdict.ranks == (1,)


def test_an_unreadable_idle_rank_outside_the_collective_is_still_named() -> None:
    stacks = StackVerdict((), "all ranks are in the same place", {
        0: ["finalize_backward (libtorch_cpu.so)"], 1: ["no stack: ptrace refused"]}, (0,),
        "same")
    verdict = judge({0: proc(0), 1: proc(1)}, stacks)
    assert verdict.hung and verdict.ranks == (1,) and "stack unreadable" in verdict.reason


def test_without_a_collective_or_stacks_cpu_decides() -> None:
    assert not judge({0: proc(0, cpu=0.5), 1: proc(1, cpu=0.6)}, None).hung
    idle = judge({0: proc(0), 1: proc(1)}, None)
    assert idle.hung and "no rank makes CPU progress" in idle.reason


def test_a_confirmation_after_an_early_look_measures_cpu_from_that_look_and_waits_for_nothing(
        monkeypatch) -> None:
    # Two real idle processes stand in for ranks (real psutil, real py-spy). The early look
    # began the CPU window; the confirmation a moment later reads the CPU since then instead
    # of sampling its own 0.3 s window.
    import subprocess
    import sys
    import time

    from babysit.policies.types import Finding, Incident, Severity
    from babysit.supervisor.node import hang, stall

    ranks = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
             for _ in range(2)]
    try:
        time.sleep(0.5)  # past the interpreter's start-up
        pids = {r: p.pid for r, p in enumerate(ranks)}
        early = hang.EarlyLook(pids)
        early.wait()
        assert early.sample is not None
        windows: list[float] = []  # each CPU window closed, in seconds
        real_finish = stall.Sample.finish

        def finish(self: stall.Sample, window_s: float = stall.WINDOW_S) -> Any:
            out = real_finish(self, window_s)
            windows.append(time.monotonic() - self._started)
            return out

        monkeypatch.setattr(stall.Sample, "finish", finish)
        time.sleep(0.5)  # the rest of the way to the suspicion
        finding = Finding(Incident.HANG, "hang", Severity.CRITICAL, 5, 5, "no step",
                          evidence={"confirm": True})
        confirmation = hang.confirm(finding, pids, early)
        (window,) = windows
        assert window >= 0.5  # the early look's window, not a new one of WINDOW_S
        assert {p["state"] for p in confirmation.fields["processes"].values()} == {"sleeping"}
        assert all(p["cpu"] < stall.BUSY_CPU for p in confirmation.fields["processes"].values())
        assert confirmation.finding is not None  # idle and alone: nothing to tell them apart
    finally:
        for p in ranks:
            p.kill()
            p.wait()


def test_ranks_idle_outside_a_collective_are_named_in_a_sentence() -> None:
    stacks = StackVerdict((), "no rank stands out", {0: ["finalize_backward (libtorch_cpu.so)"]},
                          (0,), "same")
    verdict = judge({0: proc(0), 1: proc(1), 2: proc(2)}, stacks)
    assert verdict.hung and verdict.ranks == (1, 2)
    assert verdict.reason.startswith("ranks 1 and 2 idle outside the collective rank 0 waits in;")


def test_several_stopped_ranks_are_named_as_stuck_in_one_sentence() -> None:
    """Two real processes stand in for ranks, both SIGSTOPped: the hang's finding names them
    both, its verb agreeing ("ranks 0 and 1 are stuck", once "rank 0, 1 is stuck")."""
    import signal
    import subprocess
    import sys
    import time

    import psutil

    from babysit.policies.types import Finding, Incident, Severity
    from babysit.supervisor.node import hang
    from tests.journal_text import unreadable

    ranks = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
             for _ in range(2)]
    try:
        for p in ranks:
            p.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 30  # the stop is delivered when each is scheduled
        while any(psutil.Process(p.pid).status() != psutil.STATUS_STOPPED for p in ranks):
            assert time.monotonic() < deadline, "SIGSTOP never took"
            time.sleep(0.01)
        finding = Finding(Incident.HANG, "hang", Severity.CRITICAL, 5, 5, "no step",
                          evidence={"confirm": True})
        named = hang.confirm(finding, {r: p.pid for r, p in enumerate(ranks)}).finding
        assert named is not None and named.ranks == (0, 1)
        assert named.message.startswith("hang at step 5: ranks 0 and 1 are stuck (ranks 0 and "
                                        "1 are stopped (process state T"), named.message
        assert unreadable(named.message) == []
    finally:
        for p in ranks:
            p.kill()
            p.wait()
