"""Is a suspected hang real? Every rank's process state and CPU use, judged with its stack.

The hang detector only knows that no step arrived for a while (``max(floor_s, k x p99)``, two
seconds by default). That is cheap to suspect and expensive to act on, so before anything is
stopped, the confirmation (``node/hang.py``) looks at the processes with this module:

    procs = sample({0: 4242, 1: 4243})        # state and CPU over WINDOW_S (side effects)
    # or: sampling = Sample(pids); ...dump stacks...; procs = sampling.finish()
    verdict = judge(procs, stack_verdict)     # pure: hung or not, which ranks, and why

How it judges, in order (``judge``):

1. A *stopped* rank (state T: SIGSTOP, a debugger, job control) can reach no collective: hung,
   named, whether or not its stack could be read.
2. With stacks: ranks inside a collective wait; the ranks *outside* decide. One of them busy
   (CPU >= ``BUSY_CPU`` of a core, counting its children such as loader workers, or in
   uninterruptible I/O, state D) is working: a slow eval without ``phase()``, a long first step,
   checkpoint I/O, a GC pause, a slow loader. Not a hang: keep watching. If every rank outside
   is idle, they are the hang, named (a rank whose stack could not be read counts as outside).
3. Without a collective to tell who waits (or without stacks at all): any busy rank means
   work is going on; a whole group with no CPU progress is a hang.

Ranks inside a collective are not judged by their CPU: NCCL's host threads may spin while they
wait. The detector bounds the "busy" answer (``HangConfig.busy_s``): an endless loop is busy
forever, and is called a hang once it has gone that long without a step.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import psutil

from babysit.policies.wording import ranks_doing, said_ranks
from babysit.supervisor.node.stacks import StackVerdict

WINDOW_S = 0.3
"""Seconds over which each rank's CPU use is measured."""
BUSY_CPU = 0.05
"""A rank using at least this fraction of one core over the window is working, not stuck (a
rank waiting in gloo or sleeping uses about 0; a busy loop starved on this 2-core machine
under five other jobs still got 17 %). Erring high only delays a hang (watching on)."""

STOPPED = ("stopped", "tracing-stop")
"""psutil's states of a process that cannot run until someone resumes it (py-spy would wait on
it too)."""


@dataclass(frozen=True, slots=True)
class RankProcess:
    """One rank's process as sampled: ``state`` is psutil's (running, sleeping, disk-sleep,
    stopped, tracing-stop, zombie) or "gone"; ``cpu`` is cores used over the window by the
    rank and its children."""

    rank: int
    pid: int
    state: str
    cpu: float

    @property
    def stopped(self) -> bool:
        return self.state in STOPPED

    @property
    def busy(self) -> bool:
        return self.cpu >= BUSY_CPU or self.state == "disk-sleep"

    def describe(self) -> str:
        return f"state {self.state}, CPU {self.cpu:.0%} of a core"

    def to_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "state": self.state, "cpu": round(self.cpu, 3)}


@dataclass(frozen=True, slots=True)
class StallVerdict:
    """``hung``: act now; else keep watching. ``ranks``: the ranks named (may be empty when
    nothing tells them apart). ``reason``: in words, with the evidence."""

    hung: bool
    ranks: tuple[int, ...]
    reason: str


# -- sampling (side effects) ----------------------------------------------------------------------


def _cpu_seconds(proc: psutil.Process) -> float:
    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system
    return total


def _state(proc: psutil.Process | None) -> str:
    if proc is None:
        return "gone"
    try:
        return str(proc.status())
    except psutil.Error:
        return "gone"


class Sample:
    """Each rank's CPU time now; ``finish()`` turns it into ``RankProcess``es over the time
    since. Other work (the stack dumps) may run in between: the window is whatever elapsed,
    at least ``WINDOW_S``. Never raises (a vanished process is state "gone")."""

    def __init__(self, pids: Mapping[int, int]) -> None:
        self.pids = dict(pids)
        self._procs: dict[int, psutil.Process | None] = {}
        self._before: dict[int, float] = {}
        for rank, pid in self.pids.items():
            try:
                proc = psutil.Process(pid)
                self._procs[rank] = proc
                self._before[rank] = _cpu_seconds(proc)
            except psutil.Error:
                self._procs[rank] = None
        self._started = time.monotonic()

    def states(self) -> dict[int, str]:
        """Each rank's process state now."""
        return {rank: _state(proc) for rank, proc in self._procs.items()}

    def finish(self, window_s: float = WINDOW_S) -> dict[int, RankProcess]:
        time.sleep(max(0.0, self._started + window_s - time.monotonic()))
        elapsed = max(time.monotonic() - self._started, 1e-3)
        out = {}
        for rank, pid in self.pids.items():
            proc = self._procs[rank]
            cpu = 0.0
            if proc is not None and rank in self._before:
                with contextlib.suppress(psutil.Error):
                    cpu = max(0.0, _cpu_seconds(proc) - self._before[rank]) / elapsed
            out[rank] = RankProcess(rank, pid, _state(proc), cpu)
        return out


def all_alive(pids: Iterable[int]) -> bool:
    """No rank process has died (a zombie is dead: torchrun has not reaped it yet)."""
    for pid in pids:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return False
        except psutil.Error:
            return False
    return True


def statuses(pids: Iterable[int]) -> list[str]:
    """The psutil status of each rank process still in the process table (a zombie its parent
    has not reaped included; one gone left out)."""
    found: list[str] = []
    for pid in pids:
        try:
            found.append(psutil.Process(pid).status())
        except psutil.Error:
            continue
    return found


def any_alive(pids: Iterable[int]) -> bool:
    """Some rank process still lives (a zombie does not)."""
    return any(s != psutil.STATUS_ZOMBIE for s in statuses(pids))


def sample(pids: Mapping[int, int], window_s: float = WINDOW_S) -> dict[int, RankProcess]:
    """Each rank's state and CPU use over ``window_s`` seconds (``pids``: rank -> pid)."""
    return Sample(pids).finish(window_s)


# -- judging (pure) -------------------------------------------------------------------------------


def _names(ranks: list[int]) -> str:
    return said_ranks(ranks)


def judge(procs: Mapping[int, RankProcess], stacks: StackVerdict | None) -> StallVerdict:
    """Hung or still working, from each rank's process (``sample``) and the stack verdict
    (``stacks.odd_one_out`` over the ranks that could be dumped; None when none could). Pure.
    See the module docstring for the rules."""
    stopped = sorted(r for r, p in procs.items() if p.stopped)
    if stopped:
        return StallVerdict(True, tuple(stopped), f"{_names(stopped)} "
                            f"{'is' if len(stopped) == 1 else 'are'} stopped (process state "
                            f"T: SIGSTOP, a debugger or job control), so "
                            f"{'it' if len(stopped) == 1 else 'they'} cannot reach the "
                            f"collective the others wait in")
    waiting = set(stacks.waiting) if stacks is not None else set()
    if waiting:
        outside = sorted(set(procs) - waiting)
        busy = [r for r in outside if procs[r].busy]
        if busy:
            return StallVerdict(False, tuple(busy), _working(busy, procs, stacks))
        if outside:
            unread = [r for r in outside if stacks is not None and
                      any(e.startswith("no stack") for e in stacks.evidence.get(r, []))]
            what = "; ".join(f"rank {r}: {procs[r].describe()}" for r in outside)
            note = f" ({_names(unread)}: stack unreadable, named by its process)" \
                if unread else ""
            lead = stacks.reason if stacks is not None and stacks.suspects else \
                f"{_names(outside)} idle outside the collective " \
                f"{ranks_doing(waiting, 'waits', 'wait')} in"
            return StallVerdict(True, tuple(outside), f"{lead}; {what}{note}")
        # Everyone waits in a collective: they wait for each other (mismatched collectives).
        suspects = stacks.suspects if stacks is not None else ()
        return StallVerdict(True, tuple(suspects), f"every rank waits in a collective: "
                            f"{stacks.reason if stacks is not None else ''}")
    busy = sorted(r for r, p in procs.items() if p.busy)
    if busy:
        return StallVerdict(False, tuple(busy), _working(busy, procs, stacks))
    suspects = stacks.suspects if stacks is not None else ()
    what = "; ".join(f"rank {r}: {p.describe()}" for r, p in sorted(procs.items()))
    where = f" ({stacks.reason})" if stacks is not None else ""
    return StallVerdict(True, tuple(suspects), f"no rank makes CPU progress{where}; {what}")


def _working(busy: list[int], procs: Mapping[int, RankProcess],
             stacks: StackVerdict | None) -> str:
    parts = []
    for r in busy:
        at = stacks.evidence.get(r, [])[:1] if stacks is not None else []
        parts.append(f"rank {r} ({procs[r].describe()}" + (f", at {at[0]}" if at else "") + ")")
    return (f"{'; '.join(parts)} {'is' if len(busy) == 1 else 'are'} working outside any "
            f"collective: a slow step, not a hang; watching on")
