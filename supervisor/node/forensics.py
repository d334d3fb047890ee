"""What the supervisor examines when something went wrong: rank logs, stacks, incident folders.

The control loop decides *when* (a crash, a hang finding, a disruptive remedy); these functions
read the attempt's files and processes and say *what happened*. They journal nothing and send
no alert: the loop does that with what they return.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import psutil

from babysit.policies.detectors import CrashClass, classify
from babysit.policies.types import Finding, Incident, Remedy
from babysit.supervisor.node import flight_recorder, incident, launcher, stacks, stall

Diagnosis = tuple[Any, Any]
"""``(dumps, verdict)`` from ``stacks.diagnose``."""


def teardown_only(code: int, attempt_dir: Path) -> bool:
    """For an attempt whose every rank closed its run cleanly (``NodeWorkers.all_closed``): the
    ranks that failed left no error of their own (killed by a signal, no traceback), so the
    training finished and only the process teardown crashed (gloo in torch 2.13 sometimes
    aborts at exit with "terminate called without an active exception"). An exception raised
    after ``run.close()`` leaves a traceback and stays a crash."""
    logs = launcher.rank_logs(attempt_dir)
    classes = {classify(code, None, launcher.tail(path), None).crash_class
               for path in logs.values()}
    return classes <= {CrashClass.KILLED, CrashClass.UNKNOWN}


def ranks_all_alive(pids: Iterable[int]) -> bool:
    """No rank process has died (a zombie is dead: torchrun has not reaped it yet)."""
    for pid in pids:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return False
        except psutil.Error:
            return False
    return True


class EarlyLook:
    """The slow part of a hang confirmation, read ahead while a stall is only half-way to a
    suspicion (``HangDetector.looming``), in a thread of its own.

    A rank waiting in DDP's all-reduce shows only ``backward`` in Python; telling it from a
    rank stuck elsewhere needs its native frames, and ``py-spy dump --native`` takes about a
    second on a rank that loaded libtorch. Read ahead, that second is spent before the
    suspicion, not after it. The look is the confirmation's own first half (state and CPU over
    ``stall.WINDOW_S``, Python stacks) and takes native stacks only where the confirmation
    would (``stacks.deepen``), and only when no rank is busy: a working rank is not paused for
    a stall that is about to resolve itself. ``native_for`` hands them to ``confirm_hang`` if
    every rank's Python stack is still where it was."""

    def __init__(self, rank_pids: Mapping[int, int]) -> None:
        self.rank_pids = dict(rank_pids)
        self.python: dict[int, stacks.StackDump] = {}
        self.native: dict[int, stacks.StackDump] = {}
        self._thread = threading.Thread(target=self._look, name="babysit-early-look",
                                        daemon=True)
        self._thread.start()

    def _look(self) -> None:
        sampling = stall.Sample(self.rank_pids)
        readable = _readable(self.rank_pids, sampling.states())
        dumps = stacks.dump_stacks(readable) if readable else {}
        procs = sampling.finish()
        if not dumps or any(p.busy for p in procs.values()):
            return
        deeper, _ = stacks.deepen(readable, dumps, stacks.odd_one_out(dumps))
        self.python = dumps
        self.native = {r: d for r, d in deeper.items() if d.native and d.error is None}

    def wait(self, timeout_s: float = 15.0) -> None:
        """Until the look is done (py-spy cannot attach to a rank another py-spy holds)."""
        self._thread.join(timeout_s)

    def native_for(self, dumps: Mapping[int, stacks.StackDump]
                   ) -> dict[int, stacks.StackDump] | None:
        """The native dumps read ahead, in place of ``dumps`` (Python stacks read now), if the
        look took them and no rank moved since: the same main-thread frames in both reads."""
        if self._thread.is_alive() or not self.native or set(self.python) != set(dumps):
            return None
        for rank, now in dumps.items():
            before, after = self.python[rank].main_thread, now.main_thread
            if before is None or after is None or before.frames != after.frames:
                return None
        return {r: self.native.get(r, d) for r, d in dumps.items()}


def _readable(rank_pids: Mapping[int, int], states: Mapping[int, str]) -> dict[int, int]:
    """The ranks py-spy can dump: a stopped one would make it wait."""
    return {r: pid for r, pid in rank_pids.items()
            if states[r] not in ("stopped", "tracing-stop")}


def confirm_hang(finding: Finding, rank_pids: Mapping[int, int],
                 early: EarlyLook | None = None
                 ) -> tuple[Finding | None, Diagnosis, dict[str, Any]]:
    """Look at every rank before acting on a hang finding: process state and CPU over
    ``stall.WINDOW_S``, then the stacks of the ranks that can be dumped (a stopped rank is not:
    py-spy would wait on it), judged by ``stall.judge``. Returns the finding to act on, naming
    the stuck rank(s) with the evidence, or None when the ranks are working (keep watching; the
    caller defers the detector); the diagnosis for the incident folder; and the fields of the
    journal entry (``hang_diagnosis``, or ``hang_cleared`` for None).

    A finding without ``evidence["confirm"]`` (a startup or phase allowance ran out, or a stall
    went on for ``busy_s``) is acted on whatever the processes show; they still name the rank.
    Takes the window plus the stack dumps: about 0.4 s, 1.3 s when native frames are needed
    and ``early`` (an ``EarlyLook`` taken during the same stall) did not read them ahead."""
    started = time.monotonic()
    if early is not None:
        early.wait()
    sampling = stall.Sample(rank_pids)
    readable = _readable(rank_pids, sampling.states())
    # The Python dumps pause each rank for milliseconds: they fit inside the CPU window. The
    # native pass (DDP waits in C++) pauses longer, so it waits until the window closed, unless
    # it was read ahead.
    dumps = stacks.dump_stacks(readable) if readable else {}
    procs = sampling.finish()
    verdict: stacks.StackVerdict | None = None
    ahead = None
    if dumps:
        verdict = stacks.odd_one_out(dumps)
        ahead = early.native_for(dumps) if early is not None else None
        if ahead is not None:
            dumps, verdict = ahead, stacks.odd_one_out(ahead)
        # A rank busy in its own code decides (working): no need to pause it longer.
        elif not any(procs[r].busy and stacks.outside_torch(d) for r, d in dumps.items()):
            dumps, verdict = stacks.deepen(readable, dumps, verdict)
        if all(d.error is not None for d in dumps.values()):
            verdict = None  # no stack at all: judge by the processes alone
    judged = stall.judge(procs, verdict)
    fields: dict[str, Any] = {
        "suspects": list(judged.ranks), "reason": judged.reason, "hung": judged.hung,
        "processes": {str(r): p.to_json() for r, p in sorted(procs.items())},
        "evidence": verdict.to_dict().get("evidence") if verdict is not None else None,
        "seconds": round(time.monotonic() - started, 3),
        "read_ahead": ahead is not None}
    stack_info = verdict if verdict is not None else stacks.StackVerdict((), "no stack read")
    diagnosis: Diagnosis = (dumps, stack_info)
    act = judged.hung or not finding.evidence.get("confirm", False)
    if not act:
        return None, diagnosis, fields
    evidence = {**finding.evidence, "processes": fields["processes"]}
    if not judged.ranks:
        # Nothing told the ranks apart (every rank waits in a collective: the stuck one is on
        # another node). The detector's finding stands, without "stacks": a leader prefers a
        # node whose stacks named a rank.
        return dataclasses.replace(finding, evidence=evidence), diagnosis, fields
    named = ", ".join(map(str, judged.ranks))
    finding = dataclasses.replace(
        finding, ranks=tuple(judged.ranks),
        message=f"hang at step {finding.step}: rank {named} is stuck ({judged.reason})",
        evidence={**evidence, "stacks": stack_info.to_dict()})
    return finding, diagnosis, fields


def write_incident(run_dir: Path, attempt: int, finding: Finding, remedy: Remedy | str,
                   diagnosis: Diagnosis | None, tails: Mapping[int, str]) -> Path:
    """The incident folder: what was seen and done, the ranks' log tails (by global rank),
    the stacks, and (NCCL only) the ranks' flight recorder dumps, asked for while the ranks are
    still alive: call this before stopping them. ``remedy`` is the policy's answer, or in words
    what was done instead (a follower node reports its finding to the leader, which decides)."""
    dumps, verdict = diagnosis if diagnosis else (None, None)
    summary: dict[str, Any] = {"what": finding.message, "attempt": attempt,
                               "finding": finding.to_json()}
    if isinstance(remedy, str):
        summary["action"] = remedy
    else:
        summary.update(action=f"{remedy.action.value}: {remedy.reason}",
                       remedy=remedy.to_json())
    folder = incident.write_incident(run_dir, finding.incident.value, finding.step, summary,
                                     dumps, tails, verdict)
    if flight_recorder.collect(run_dir / "attempts" / str(attempt), folder,
                               ask=finding.incident is Incident.HANG):
        summary_txt = folder / "summary.txt"
        text = summary_txt.read_text()
        summary_txt.write_text(text + ("" if "files here:" in text else "files here:\n")
                               + "  flight_recorder/rank_<r>: torch's NCCL flight recorder per "
                                 "rank (read it with torchfrtrace)\n")
    return folder
