"""``conftest.console_noise``: a teardown that gloo crashed after every rank closed its run is
forgiven its own lines, and only those; a warning or a traceback anywhere else on the console
still counts (issue 55: it passed a whole console as clean)."""

from __future__ import annotations

from typing import Any

from tests.conftest import console_noise

STARTED = """\
babysit: run 'tiny_train' in /tmp/run
babysit: starting -> running (first step 1)
[r0] rank 0 done at step 10 pid 18335
[r1] rank 1 done at step 10 pid 18336
"""
TORN = """\
[torchrun] W1207 14:28:49.184000 18314 torch/distributed/elastic/multiprocessing/api.py:1028] \
Sending process 18336 closing signal SIGTERM
[r0] terminate called without an active exception
[torchrun] E1207 14:28:49.328000 18314 torch/distributed/elastic/multiprocessing/api.py:1002] \
failed (exitcode: -6) local_rank: 0 (pid: 18335) of binary: /venv/bin/python
[torchrun] Traceback (most recent call last):
[torchrun]   File "<frozen runpy>", line 198, in _run_module_as_main
[torchrun] torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
[torchrun] Root Cause (first observed failure):
babysit: [warning] every rank finished and closed, then the process teardown crashed \
(torchrun exit 1); counted as finished
babysit: running -> succeeded (workers finished)
"""
JOURNAL: list[dict[str, Any]] = [{"event": "teardown_crash", "exit_code": 1,
                                  "closed_ranks": [0, 1]}]


def test_a_teardown_crash_after_every_rank_closed_is_forgiven_its_own_lines() -> None:
    assert console_noise(STARTED + TORN, JOURNAL, [0, 1]) == []


def test_a_warning_elsewhere_on_that_console_still_counts() -> None:
    warned = "[r1] /tmp/train.py:12: UserWarning: the LR scheduler stepped first\n"
    assert console_noise(STARTED + warned + TORN, JOURNAL, [0, 1]) == [warned.strip()]
    alert = "babysit: [warning] throughput fell to 40% of its baseline\n"
    assert console_noise(STARTED + alert + TORN, JOURNAL, [0, 1]) == [alert.strip()]


def test_an_earlier_attempts_failure_report_still_counts() -> None:
    """torchrun's report of a crash the run relaunched after is not the teardown's."""
    crashed = "[torchrun] Traceback (most recent call last):\n"
    console = STARTED + crashed + "babysit: starting -> running (first step 6)\n" + TORN
    assert console_noise(console, JOURNAL, [0, 1]) == [crashed.strip()]


def test_without_a_teardown_crash_of_every_rank_its_lines_count() -> None:
    assert console_noise(STARTED + TORN, [], [0, 1])
    partial = [{**JOURNAL[0], "closed_ranks": [0]}]
    assert console_noise(STARTED + TORN, partial, [0, 1])
