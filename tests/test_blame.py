"""Naming the right rank, from evidence (pure parts): crash blame from each rank's exit,
hang confirmation from process state, CPU and stacks, and the takeover and preemption rules.
The same behaviour runs for real in ``test_blame_e2e.py``."""

from __future__ import annotations

import json
import signal
from pathlib import Path

from babysit.checkpoints import Catalog
from babysit.policies.detectors import HangConfig, HangDetector
from babysit.policies.loader import load_policy
from babysit.policies.types import RankStep
from babysit.supervisor.node import launcher
from babysit.supervisor.node.stacks import StackVerdict
from babysit.supervisor.node.stall import RankProcess, judge
from babysit.supervisor.run import preemption, takeover
from babysit.supervisor.run.watch import Watch
from tests.test_checkpoints_catalog import make_ckpt

RESET = """Traceback (most recent call last):
  File "train.py", line 40, in <module>
    loss.backward()
RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer
"""

SUMMARY = """Failures:
[1]:
  time      : 2026-11-23_16:00:01
  host      : box
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 4242)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
Root Cause (first observed failure):
[0]:
  time      : 2026-11-23_16:00:01
  host      : box
  rank      : 1 (local_rank: 1)
  exitcode  : -11 (pid: 4243)
  error_file: <N/A>
  traceback : Signal 11 (SIGSEGV) received by PID 4243
"""


def watch() -> Watch:
    return Watch(load_policy("default"))


# -- crash blame ----------------------------------------------------------------------------------


def test_torchruns_summary_gives_each_failed_ranks_exit_code() -> None:
    assert launcher.rank_exits(SUMMARY) == {0: 1, 1: -11}
    assert launcher.rank_exits("torchrun exited cleanly") == {}


def test_a_segfaulted_rank_is_blamed_not_the_peer_that_lost_its_connection() -> None:
    # torchrun noticed rank 0 first (it names it the root cause): the exits still say rank 1.
    finding = watch().classify_crash(1, {0: RESET, 1: "step 5\n"}, 5, root_rank=0,
                                     exits={0: 1, 1: -11})
    assert finding.ranks == (1,) and finding.evidence["class"] == "signal"
    assert finding.message.startswith("signal crash of rank 1 at step 5: signal SIGSEGV")
    assert finding.evidence["rank_exits"] == {"0": 1, "1": -11}


def test_a_sigkilled_rank_is_named_with_the_oom_killer_hint() -> None:
    finding = watch().classify_crash(1, {0: RESET, 1: ""}, 9, exits={0: 1, 1: -9})
    assert finding.ranks == (1,) and "SIGKILL" in finding.message
    assert "OOM killer" in finding.message


def test_a_rank_torchrun_stopped_is_never_blamed_over_one_that_failed() -> None:
    finding = watch().classify_crash(1, {0: RESET, 1: ""}, 9, exits={0: 1, 1: -15})
    assert finding.ranks == (0,) and finding.evidence["class"] == "network"


def test_an_exception_still_beats_a_signal() -> None:
    bug = "Traceback (most recent call last):\nValueError: bad shape\n"
    finding = watch().classify_crash(1, {0: bug, 1: ""}, 3, exits={0: 1, 1: -int(signal.SIGABRT)})
    assert finding.ranks == (0,) and finding.evidence["class"] == "user_code"


def test_without_exits_the_logs_still_decide() -> None:
    bug = "Traceback (most recent call last):\nValueError: bad shape\n"
    assert watch().classify_crash(1, {0: RESET, 1: bug}, 3).ranks == (1,)


# -- hang confirmation ----------------------------------------------------------------------------


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


def test_the_default_policy_suspects_a_stall_in_seconds_and_defers_when_told() -> None:
    config = load_policy("default").detectors.hang
    assert config.floor_s == 2.0 and config.k == 5.0
    det = HangDetector(config)
    det.start(0.0)
    for step in range(1, 21):
        for rank in (0, 1):
            det.observe(RankStep(rank=rank, step=step, time=0.05 * step), 0.05 * step)
    assert det.check(2.9) is None  # 1.9 s after the last step
    finding = det.check(3.1)
    assert finding is not None and finding.evidence["confirm"] is True
    det.defer(3.5, 2.5)  # the ranks were working: quiet for as long again
    assert det.check(5.9) is None
    assert det.check(6.1) is not None
    det.defer(6.5, 5.5)
    # Long enough without a step: a hang whatever the processes show (an endless loop).
    late = det.check(config.busy_s + 1.0)
    assert late is not None and late.evidence["confirm"] is False


def test_a_stall_looms_half_way_to_its_suspicion_and_never_inside_a_phase() -> None:
    det = HangDetector(HangConfig(floor_s=2.0))
    det.start(0.0)
    for step in range(1, 21):
        det.observe(RankStep(rank=0, step=step, time=0.05 * step), 0.05 * step)
    assert not det.looming(1.9) and det.looming(2.1)  # 0.9 s, then 1.1 s after the last step
    assert det.check(3.1) is not None and not det.looming(3.1)  # fired: nothing to read ahead
    det.phase(0, "eval", True, 3.2)
    det.defer(3.2, 2.2)
    assert not det.looming(10.0)  # an eval has its own (long) allowance


def test_progress_ends_a_deferral() -> None:
    det = HangDetector(HangConfig(floor_s=2.0))
    det.start(0.0)
    for step in range(1, 301):
        det.observe(RankStep(rank=0, step=step, time=0.05 * step), 0.05 * step)
    assert det.check(17.1) is not None
    det.defer(17.1, 2.1)  # quiet until 21.2 ...
    det.observe(RankStep(rank=0, step=301, time=18.0), 18.0)
    assert det.check(20.1) is not None  # ... but a new stall is judged afresh


# -- takeover and preemption ----------------------------------------------------------------------


def test_unwatched_checkpoints_stay_pending_until_their_probation_is_observed(
        tmp_path: Path) -> None:
    from babysit.supervisor.run.recovery import Recovery

    catalog = Catalog(tmp_path)
    for step in (10, 15, 20, 25):
        make_ckpt(tmp_path, step, size=100)
    recovery = Recovery(catalog, probation_steps=5, keep=10)
    # The previous supervisor saw up to step 12; the workers went on to 25 alone.
    resume, entries = recovery.resume_latest(watched_until=12)
    assert resume is not None and resume.step == 25
    pending = [e[1]["checkpoint_step"] for e in entries if e[0] == "checkpoint_verdict"]
    assert pending == [10, 15, 20]
    recovery.on_progress(40)
    verdicts = {c.step: c.verdict.value for c in catalog.checkpoints()}
    # 25's probation (26-30) was observed after the resume; 10's ran past 12 unwatched.
    assert verdicts == {10: "pending", 15: "pending", 20: "pending", 25: "good"}


def test_a_job_that_finished_unwatched_is_recognised(tmp_path: Path) -> None:
    closed = tmp_path / "closed"
    closed.mkdir()
    (closed / "0.json").write_text(json.dumps({"rank": 0, "world_size": 2, "step": 40}))
    assert takeover.finished_unwatched(tmp_path) is None  # rank 1 did not close
    (closed / "1.json").write_text(json.dumps({"rank": 1, "world_size": 2, "step": 40}))
    assert takeover.finished_unwatched(tmp_path) == 40


def test_a_missing_final_checkpoint_names_what_the_next_run_resumes_from(
        tmp_path: Path) -> None:
    catalog = Catalog(tmp_path)
    assert "from scratch" in preemption.fallback(catalog).describe()
    make_ckpt(tmp_path, 1000, size=100)
    fallback = preemption.fallback(catalog)
    assert fallback.step == 1000
    message = preemption.missing_message("none arrived within 30 s", fallback)
    assert "no final checkpoint" in message and "step 1000" in message
