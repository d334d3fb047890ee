"""Hang diagnosis: the pure odd-one-out judgment, and py-spy on this process and its failures.
The dumps of a real hung gloo job: ``tests/e2e/test_stacks.py``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from babysit.supervisor.node.stacks import (
    Frame,
    StackDump,
    StackVerdict,
    ThreadStack,
    deepen,
    dump_stacks,
    find_py_spy,
    odd_one_out,
    parse_dump,
)

# -- the pure judgment ----------------------------------------------------------------------------

# Frames as py-spy prints them, innermost first.
IN_ALL_REDUCE = [("all_reduce", "torch/distributed/distributed_c10d.py", 3252),
                 ("_exception_logger.<locals>.wrapper", "torch/distributed/c10d_logger.py", 83),
                 ("main", "train.py", 51), ("<module>", "train.py", 61)]
SLEEPING = [("main", "train.py", 45), ("<module>", "train.py", 61)]
IN_BACKWARD = [("_engine_run_backward", "torch/autograd/graph.py", 979),
               ("backward", "torch/autograd/__init__.py", 395),
               ("Tensor.backward", "torch/_tensor.py", 623), ("main", "train.py", 241)]
DDP_NATIVE = [("pthread_cond_wait", "libc.so.6", None),
              ("c10d::Reducer::finalize_backward", "libtorch_cpu.so", None), *IN_BACKWARD]


def dump(rank: int, frames: Sequence[tuple[str, str, int | None]], **kw: object) -> StackDump:
    thread = ThreadStack(100 + rank, "MainThread", "idle",
                         tuple(Frame(f, file, line) for f, file, line in frames))
    return StackDump(rank, 100 + rank, raw="", threads=(thread,), **kw)  # type: ignore[arg-type]


def test_two_ranks_the_one_outside_the_collective_is_stuck() -> None:
    verdict = odd_one_out({0: dump(0, IN_ALL_REDUCE), 1: dump(1, SLEEPING)})
    assert verdict.suspects == (1,) and verdict.waiting == (0,) and verdict.rule == "collective"
    assert "rank 1 is outside any collective" in verdict.reason
    assert "main (train.py:45)" in verdict.reason and "all_reduce" in verdict.reason
    assert verdict.evidence[0][0] == "all_reduce (torch/distributed/distributed_c10d.py:3252)"
    assert len(verdict.evidence[0]) == 3


def test_eight_ranks_one_differs() -> None:
    # No collective in sight (e.g. stuck in backward without native frames): the majority rules.
    dumps = {r: dump(r, IN_BACKWARD) for r in range(8)}
    dumps[5] = dump(5, SLEEPING)
    verdict = odd_one_out(dumps)
    assert verdict.suspects == (5,) and verdict.rule == "majority"
    assert "rank 5 differs from the other 7" in verdict.reason
    # Line numbers do not make a rank different.
    dumps[5] = dump(5, [(f, file, (line or 0) + 7) for f, file, line in IN_BACKWARD])
    assert odd_one_out(dumps).suspects == ()


def test_eight_ranks_one_outside_the_collective() -> None:
    dumps = {r: dump(r, IN_ALL_REDUCE) for r in range(8)}
    dumps[3] = dump(3, SLEEPING)
    verdict = odd_one_out(dumps)
    assert verdict.suspects == (3,) and verdict.waiting == (0, 1, 2, 4, 5, 6, 7)


def test_the_collective_rule_beats_the_majority() -> None:
    # Seven ranks stuck together outside a collective (a shared file system, say) hold up the
    # one that reached it: the waiting rank is not the one to blame.
    dumps = {r: dump(r, SLEEPING) for r in range(8)}
    dumps[0] = dump(0, IN_ALL_REDUCE)
    verdict = odd_one_out(dumps)
    assert verdict.suspects == (1, 2, 3, 4, 5, 6, 7) and verdict.waiting == (0,)


def test_all_identical_names_no_one() -> None:
    verdict = odd_one_out({r: dump(r, IN_ALL_REDUCE) for r in range(4)})
    assert verdict.suspects == () and verdict.rule == "same"
    assert "all ranks are in the same place" in verdict.reason


def test_native_frames_show_ddp_waiting_in_backward() -> None:
    verdict = odd_one_out({0: dump(0, DDP_NATIVE), 1: dump(1, SLEEPING)})
    assert verdict.suspects == (1,) and verdict.waiting == (0,)
    assert "c10d::Reducer::finalize_backward" in verdict.reason
    # Without native frames two ranks cannot be told apart.
    assert odd_one_out({0: dump(0, IN_BACKWARD), 1: dump(1, SLEEPING)}).suspects == ()


def test_babysit_and_threading_frames_are_ignored() -> None:
    inside_api = [SLEEPING[0], ("Run.batches", "supervisor/rank/api.py", 110), SLEEPING[1]]
    installed = [SLEEPING[0], ("Run.step", "/venv/lib/site-packages/babysit/supervisor/rank/api.py",
                               140), SLEEPING[1]]
    threading_ = [*SLEEPING, ("Thread.run", "threading.py", 982)]
    dumps = {0: dump(0, SLEEPING), 1: dump(1, threading_), 2: dump(2, inside_api),
             3: dump(3, installed)}
    verdict = odd_one_out(dumps)
    assert verdict.rule == "same", verdict.reason


def test_failed_dumps_are_left_out_and_named() -> None:
    failed = StackDump(2, 102, error="Permission Denied", hint="ptrace")
    verdict = odd_one_out({0: dump(0, IN_ALL_REDUCE), 1: dump(1, SLEEPING), 2: failed})
    assert verdict.suspects == (1,)
    assert "rank 2: no stack" in verdict.reason
    assert verdict.evidence[2] == ["no stack: Permission Denied"]
    assert odd_one_out({2: failed}).suspects == ()


def test_parse_py_spy_text() -> None:
    text = """Process 13942: python -u train.py
Python v3.11.7 (/usr/bin/python3.11)

Thread 13942 (idle): "MainThread"
    all_reduce (torch/distributed/distributed_c10d.py:3252)
    _exception_logger.<locals>.wrapper (torch/distributed/c10d_logger.py:83)
    _call_with_frames_removed (<frozen importlib._bootstrap>:241)
    pthread_cond_wait (libc.so.6)
Thread 0x7F00AB (active+gil): "pt_data"
    run (threading.py:982)
"""
    main, other = parse_dump(text)
    assert (main.tid, main.name, main.status) == (13942, "MainThread", "idle")
    assert main.frames[1] == Frame("_exception_logger.<locals>.wrapper",
                                   "torch/distributed/c10d_logger.py", 83)
    assert main.frames[2].file == "<frozen importlib._bootstrap>" and main.frames[2].line == 241
    assert main.frames[3].native and main.frames[3].file == "libc.so.6"
    assert (other.tid, other.name, other.status) == (0x7F00AB, "pt_data", "active+gil")


# -- dumping a real process -----------------------------------------------------------------------


def test_missing_py_spy_is_an_error_not_an_exception(tmp_path: Path) -> None:
    dumps = dump_stacks({0: os.getpid()}, py_spy=tmp_path / "no-such-py-spy")
    assert dumps[0].error is not None and "py-spy not found" in dumps[0].error
    assert dumps[0].hint is not None and "pip install py-spy" in dumps[0].hint
    assert odd_one_out(dumps).suspects == ()


def test_a_vanished_process_is_an_error_with_a_hint() -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dumps = dump_stacks({0: gone.pid}, timeout_s=5)
    assert dumps[0].error is not None and dumps[0].hint is not None
    assert "gone" in dumps[0].hint


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root and setpriv to run py-spy as another user")
def test_a_refused_ptrace_says_what_to_do(tmp_path: Path) -> None:
    # The real py-spy, run as nobody against this (root's) process: the kernel refuses ptrace.
    real = find_py_spy()
    assert real is not None
    as_nobody = tmp_path / "py-spy"
    as_nobody.write_text(f"#!/bin/sh\nexec setpriv --reuid 65534 --regid 65534 --clear-groups "
                         f"{real} \"$@\"\n")
    as_nobody.chmod(0o755)
    dumps = dump_stacks({3: os.getpid()}, timeout_s=5, py_spy=as_nobody)
    assert dumps[3].error is not None and "permission" in dumps[3].error.lower()
    assert dumps[3].hint is not None and "ptrace_scope" in dumps[3].hint


# -- the native pass reads a sample of each place -------------------------------------------------


def canned_py_spy(tmp_path: Path, python: dict[int, list], native: dict[int, list]) -> Path:
    """An executable standing in for py-spy at its seam: it prints the canned dump of the pid
    it is asked for (``native`` with ``--native``) and records each native read in
    ``tmp_path/native-reads``."""
    def text(pid: int, frames: list) -> str:
        lines = [f"Process {pid}: python train.py", "Python v3.11.7", "",
                 f'Thread {pid} (idle): "MainThread"']
        lines += [f"    {f} ({file})" if line is None else f"    {f} ({file}:{line})"
                  for f, file, line in frames]
        return "\n".join(lines) + "\n"
    for pid, frames in python.items():
        (tmp_path / f"{pid}.python").write_text(text(pid, frames))
    for pid, frames in native.items():
        (tmp_path / f"{pid}.native").write_text(text(pid, frames))
    exe = tmp_path / "py-spy"
    exe.write_text(f"""#!/bin/sh
kind=python
for a in "$@"; do [ "$a" = --native ] && kind=native; done
for a in "$@"; do pid=$a; done
[ $kind = native ] && echo $pid >> {tmp_path}/native-reads
cat {tmp_path}/$pid.$kind
""")
    exe.chmod(0o755)
    return exe


def native_reads(tmp_path: Path) -> list[int]:
    reads = tmp_path / "native-reads"
    return sorted(int(p) for p in reads.read_text().split()) if reads.exists() else []


def test_the_native_pass_reads_two_of_each_place_and_lends_their_frames(tmp_path: Path) -> None:
    # 24 ranks: 23 idle in DDP's backward (the all-reduce is in C++), rank 21 asleep outside.
    pids = {r: 1000 + r for r in range(24)}
    python = {pid: IN_BACKWARD for pid in pids.values()} | {1021: SLEEPING}
    native = {pid: DDP_NATIVE for pid in pids.values()} | {1021: SLEEPING}
    exe = canned_py_spy(tmp_path, python, native)
    first = dump_stacks(pids, py_spy=exe)
    dumps, verdict = deepen(pids, first, odd_one_out(first), busy=[7], py_spy=exe)
    # Ranks 0 and 1 for the backward place, rank 21 alone in its place, rank 7 being busy.
    assert native_reads(tmp_path) == [1000, 1001, 1007, 1021]
    assert verdict.suspects == (21,) and verdict.rule == "collective"
    assert len(verdict.waiting) == 23
    lent = dumps[5]
    assert lent.like == 0 and lent.rank == 5 and lent.pid == 1005
    assert "rank 0 has the same Python stack" in lent.raw
    assert lent.to_dict()["native_as_rank"] == 0
    assert dumps[7].like is None and dumps[21].like is None


def test_a_place_whose_sample_disagrees_is_read_whole(tmp_path: Path) -> None:
    # Same Python stack everywhere; natively rank 1 is not in the all-reduce (a deadlock in C++
    # inside backward): the sample disagrees, so every rank of the place is read.
    pids = {r: 2000 + r for r in range(6)}
    python = {pid: IN_BACKWARD for pid in pids.values()}
    native = {pid: DDP_NATIVE for pid in pids.values()} | {
        2001: [("pthread_mutex_lock", "libc.so.6", None), *IN_BACKWARD]}
    exe = canned_py_spy(tmp_path, python, native)
    first = dump_stacks(pids, py_spy=exe)
    # Every Python stack alike is "same": the native pass is not asked for ...
    assert odd_one_out(first).rule == "same"
    # ... so ask as the confirmation does when it has a reason to (a majority verdict).
    dumps, verdict = deepen(pids, first, StackVerdict((), "", rule="none"),
                            py_spy=exe)
    assert native_reads(tmp_path) == sorted(pids.values())
    assert all(d.like is None for d in dumps.values())
    assert verdict.suspects == (1,)
