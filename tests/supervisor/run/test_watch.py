"""Crash blame in the watch (``supervisor.run.watch``): the rank to name from each rank's exit
(torchrun's summary, read by ``supervisor.node.launcher``) and its log, pure. The same behaviour
runs for real in ``tests/e2e/test_blame.py``."""

from __future__ import annotations

import signal

from babysit.policies.loader import load_policy
from babysit.policies.types import Incident
from babysit.supervisor.contract.directive import Directive
from babysit.supervisor.contract.protocol import WorkerEvent
from babysit.supervisor.node import launcher
from babysit.supervisor.run.watch import Watch

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


def test_torchruns_summary_gives_each_failed_ranks_exit_code() -> None:
    assert launcher.rank_exits(SUMMARY) == {0: 1, 1: -11}
    assert launcher.rank_exits("torchrun exited cleanly") == {}


def test_a_failure_summary_counts_once_torchrun_has_printed_all_of_it() -> None:
    # torchrun prints it after stopping every rank; babysit acts on it rather than waiting
    # for torchrun's own exit.
    rule = "=" * 54 + "\n"
    whole = f"{rule}/w/train.py FAILED\n------\n{SUMMARY}{rule}"
    assert launcher.failure_summarized(whole)
    assert launcher.failure_summarized(whole + "W1126 Received SIGTERM death signal\n")
    assert not launcher.failure_summarized(whole[:-len(rule)])  # the root cause still printing
    assert not launcher.failure_summarized(SUMMARY.split("Root Cause")[0] + rule)
    assert not launcher.failure_summarized("torchrun exited cleanly")


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


def test_a_resume_check_that_failed_is_one_finding_per_attempt() -> None:
    watch = Watch(load_policy("default"))
    watch.new_attempt(0.0, Directive(attempt=1))

    def check(rank: int, took: bool) -> WorkerEvent:
        return WorkerEvent(rank=rank, type="resume_check", time=0.0,
                           data={"step": 20, "took": took, "restored": "a", "seen": "b"})

    assert watch.observe_resume(check(0, True)) is None
    finding = watch.observe_resume(check(1, False))
    assert finding is not None and finding.incident is Incident.RESUME
    assert (finding.step, finding.onset_step, finding.ranks) == (20, 20, (1,))
    assert "the restore did not take" in finding.message
    assert watch.observe_resume(check(0, False)) is None  # every rank says so: one finding
    watch.new_attempt(1.0, Directive(attempt=2))
    assert watch.observe_resume(check(0, False)) is not None


def test_a_rank_that_never_said_hello_in_its_attempt_is_held_against_no_step_or_batch() -> None:
    """The same SIGKILL at the same step is ``deterministic`` for a rank that trained there, but
    not for one that died before its hello (a standby's rank killed while it waited): marked
    ``attached`` False, which ``policies/cause.py`` places at no batch."""
    watch = Watch(load_policy("default"))
    watch.new_attempt(0.0, Directive(attempt=0))
    watch.attached(0)
    watch.attached(1)
    first = watch.classify_crash(1, {0: RESET, 1: ""}, 9, exits={0: 1, 1: -9})
    assert first.ranks == (1,) and "attached" not in first.evidence
    watch.new_attempt(1.0, Directive(attempt=1))
    watch.attached(0)  # rank 1 never got past its start-up
    second = watch.classify_crash(1, {0: RESET, 1: ""}, 9, exits={0: 1, 1: -9})
    assert second.ranks == (1,) and second.evidence["attached"] is False
    assert second.step == 9 and not second.evidence["deterministic"]
    watch.new_attempt(2.0, Directive(attempt=2))
    watch.attached(0)
    watch.attached(1)
    third = watch.classify_crash(1, {0: RESET, 1: ""}, 9, exits={0: 1, 1: -9})
    assert third.evidence["deterministic"] and "attached" not in third.evidence
    # A watch that launched no attempt (a supervisor that took the run over) does not know.
    assert "attached" not in Watch(load_policy("default")).classify_crash(
        1, {1: ""}, 9, exits={1: -9}).evidence
