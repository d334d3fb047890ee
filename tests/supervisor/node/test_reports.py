"""What of a crash's reports reaches the console (``supervisor.node.reports``): torchrun's report
as one line naming its log, a rank's traceback as one line. The real run: tests/e2e/test_run.py's
segfault test."""

from __future__ import annotations

from pathlib import Path

from babysit.supervisor.node.launcher import OutputLine
from babysit.supervisor.node.reports import Reports

# What one segfaulted rank of two printed on the console, rank 0's side and torchrun's (a run of
# tests/workers/tiny_train.py, torchrun started ahead by babysit; abridged where it repeats).
RANK0 = """\
[rank0]: Traceback (most recent call last):
[rank0]:   File "/w/tests/workers/tiny_train.py", line 485, in <module>
[rank0]:     main()
[rank0]:   File "/w/tests/workers/tiny_train.py", line 272, in average_gradients
[rank0]:     dist.all_reduce(flat)
[rank0]:   File "/w/.venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", \
line 3252, in all_reduce
[rank0]:     work.wait()
[rank0]: RuntimeError: [../gloo/transport/tcp/pair.cc:553] Connection closed by peer \
[127.0.0.1]:60608.
rank 0 goes on"""

TORCHRUN = """\
W1207 14:17:22.181000 4912 torch/distributed/elastic/multiprocessing/api.py:1028] Sending \
process 4960 closing signal SIGTERM
E1207 14:17:22.482000 4912 torch/distributed/elastic/multiprocessing/api.py:1002] failed \
(exitcode: -11) local_rank: 1 (pid: 4961) of binary: /w/.venv/bin/python
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "/w/babysit/supervisor/node/ahead.py", line 212, in <module>
    main()
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
======================================================
/w/tests/workers/tiny_train.py FAILED
------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 1 (local_rank: 1)
  exitcode  : -11 (pid: 4961)  (SIGSEGV)
======================================================"""


def reports(tmp_path: Path) -> Reports:
    return Reports(tmp_path / "launcher.log", lambda local: tmp_path / f"{local}" / "stderr.log")


def feed(r: Reports, text: str, rank: int | None) -> list[str]:
    return [out for line in text.splitlines() for out in r.line(OutputLine(line, rank))]


def test_a_ranks_traceback_is_one_line_naming_its_log(tmp_path: Path) -> None:
    r = reports(tmp_path)
    assert feed(r, RANK0, 0) == [
        "[r0] RuntimeError: [../gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:60608. (at tiny_train.py:272 in average_gradients; the traceback, whole: "
        f"{tmp_path / '0' / 'stderr.log'})",
        "[r0] rank 0 goes on"]
    assert r.flush() == []
    # A rank that died while printing one: said at the attempt's end.
    assert feed(r, "Traceback (most recent call last):\n  File \"x.py\", line 3, in f", 1) == []
    assert r.flush() == [f"[r1] (a traceback cut short) (at x.py:3 in f; the traceback, whole: "
                         f"{tmp_path / '1' / 'stderr.log'})"]
    # A progress bar redrawn with carriage returns: its newest state, as before.
    assert r.line(OutputLine("10%\r50%\r", 0)) == ["[r0] 50%"]


def test_torchruns_report_is_one_line_naming_its_log(tmp_path: Path) -> None:
    r = reports(tmp_path)
    assert feed(r, "usage: torchrun [-h]\ntorchrun: error: bad argument", None) == [
        "[torchrun] usage: torchrun [-h]", "[torchrun] torchrun: error: bad argument"]
    said = feed(r, TORCHRUN, None)
    log = tmp_path / "launcher.log"
    assert said == [f"babysit: torchrun's report of the failure, whole: {log}"]
    assert feed(r, "anything after it", None) == []
    assert feed(r, "rank lines go on", 0) == ["[r0] rank lines go on"]
