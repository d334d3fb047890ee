"""Confirming a hang: where a stall the timers suspect becomes a named hang, or is cleared.

The hang detector only knows that no step arrived for a while. Before anything is stopped,
``confirm`` looks at every rank, in this order:

    1. look     each rank's process state and CPU over ``stall.WINDOW_S`` (or since the early
                look began, which is longer and waits for nothing) and, inside that window,
                the Python stacks of the ranks py-spy can dump (a stopped rank would make it
                wait)
    2. deepen   no collective in Python (DDP waits in C++): the native stacks of the busy
                ranks and of a sample of each place (``stacks.deepen``), taken from the early
                look if no rank moved since, else read now; skipped when a stopped rank or a
                rank busy in its own code already decides
    3. judge    ``stall.judge``: hung or working, which ranks, and why
    4. name     the finding to act on with its evidence, or None (working: keep watching)

The early look (``EarlyLook``) is steps 1 and 2 run ahead, in a thread, while a stall is
half-way to a suspicion: ``py-spy dump --native`` takes about a second on a rank that loaded
libtorch, and read ahead that second is spent before the suspicion, not after it. A
``Confirmer`` holds it between ticks. ``stall`` and ``stacks`` are the libraries underneath:
they sample, read and judge, and never call back.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from babysit.policies.types import Finding
from babysit.policies.wording import ranks_doing
from babysit.supervisor.node import stacks, stall
from babysit.supervisor.node.stacks import Diagnosis, StackDump, StackVerdict


@dataclass(frozen=True, slots=True)
class Confirmation:
    """What a look at every rank concluded about one hang finding."""

    finding: Finding | None
    """The finding to act on, naming the stuck rank(s) with the evidence; None when the ranks
    are working (the caller defers the detector and keeps watching)."""
    diagnosis: Diagnosis
    """Every rank's stack dump and the verdict on them, for the incident folder."""
    fields: dict[str, Any]
    """The journal entry's fields: ``hang_diagnosis``, or ``hang_cleared`` when ``finding`` is
    None."""


class Confirmer:
    """One attempt's hang confirmations on this node, with the stacks read ahead for them.

    Calling rules: ``ahead`` once per tick while every rank is alive, then ``confirm`` for each
    finding the hang timers gave in that tick. A new attempt gets a new ``Confirmer``."""

    def __init__(self) -> None:
        self._early: EarlyLook | None = None

    def ahead(self, rank_pids: Mapping[int, int], looming: bool) -> None:
        """``looming``: a stall is half-way to a suspicion (``HangDetector.looming``). Starts
        one early look per stall; forgets it once the stall is over."""
        if not looming:
            self._early = None
        elif self._early is None and rank_pids:
            self._early = EarlyLook(rank_pids)

    def confirm(self, finding: Finding, rank_pids: Mapping[int, int]) -> Confirmation:
        """``confirm`` with this stall's early look, which it uses up."""
        early, self._early = self._early, None
        return confirm(finding, rank_pids, early)


def confirm(finding: Finding, rank_pids: Mapping[int, int],
            early: EarlyLook | None = None) -> Confirmation:
    """Look at every rank (``rank_pids``: rank -> pid) before acting on a hang finding; see the
    module docstring for the steps.

    A finding without ``evidence["confirm"]`` (a startup or phase allowance ran out, or a stall
    went on for ``busy_s``) is acted on whatever the processes show; they still name the rank.
    Takes the window plus the stack dumps: about 0.4 s, 1.3 s when native frames are needed
    and ``early`` (an ``EarlyLook`` taken during the same stall) did not read them ahead, and
    only the Python dumps (tens of ms) when the early look's window and native frames serve."""
    started = time.monotonic()
    since = None
    if early is not None:
        early.wait()  # py-spy cannot attach to a rank another py-spy holds
        since = early.sample if early.rank_pids == dict(rank_pids) else None
    seen = _look(rank_pids, since)
    dumps, verdict, read_ahead = _deepen(seen, early)
    judged = stall.judge(seen.procs, verdict)
    fields: dict[str, Any] = {
        "suspects": list(judged.ranks), "reason": judged.reason, "hung": judged.hung,
        "processes": {str(r): p.to_json() for r, p in sorted(seen.procs.items())},
        "evidence": verdict.to_dict().get("evidence") if verdict is not None else None,
        "seconds": round(time.monotonic() - started, 3),
        "read_ahead": read_ahead}
    diagnosis = Diagnosis(dumps, verdict if verdict is not None else
                          StackVerdict((), "no stack read"))
    return Confirmation(_name(finding, judged, fields["processes"], diagnosis.verdict),
                        diagnosis, fields)


@dataclass(frozen=True, slots=True)
class _Seen:
    readable: dict[int, int]
    """The ranks py-spy could dump: rank -> pid."""
    dumps: dict[int, StackDump]
    """Their Python stacks (empty when none was readable)."""
    procs: dict[int, stall.RankProcess]

    @property
    def stopped(self) -> bool:
        return any(p.stopped for p in self.procs.values())

    @property
    def busy(self) -> list[int]:
        return [r for r, p in self.procs.items() if p.busy]


def _look(rank_pids: Mapping[int, int], since: stall.Sample | None = None) -> _Seen:
    """Step 1. The Python dumps pause each rank for milliseconds, so they fit inside the CPU
    window; the native pass pauses longer and waits until the window closed. ``since``: the
    early look's CPU sample, begun a second or so before; its window is already longer than
    ``stall.WINDOW_S``, so nothing is waited for (a rank that worked for part of it counts
    as working, which only defers the hang to the next confirmation)."""
    sampling = since if since is not None else stall.Sample(rank_pids)
    states = sampling.states()
    readable = {r: pid for r, pid in rank_pids.items() if states[r] not in stall.STOPPED}
    dumps = stacks.dump_stacks(readable) if readable else {}
    return _Seen(readable, dumps, sampling.finish())


def _deepen(seen: _Seen, early: EarlyLook | None
            ) -> tuple[dict[int, StackDump], StackVerdict | None, bool]:
    """Step 2: the dumps to judge by, their verdict (None: no stack at all, judge by the
    processes alone), and whether the native stacks were read ahead."""
    if not seen.dumps:
        return {}, None, False
    dumps, verdict = seen.dumps, stacks.odd_one_out(seen.dumps)
    ahead = early.native_for(dumps) if early is not None else None
    if ahead is not None:
        dumps, verdict = ahead, stacks.odd_one_out(ahead)
    # A stopped rank decides (hung, ``stall.judge``'s first rule), and so does a rank busy in
    # its own code (working): no native frames needed, no rank paused longer.
    elif not seen.stopped and \
            not any(seen.procs[r].busy and stacks.outside_torch(d) for r, d in dumps.items()):
        dumps, verdict = stacks.deepen(seen.readable, dumps, verdict, busy=seen.busy)
    if all(d.error is not None for d in dumps.values()):
        return dumps, None, ahead is not None
    return dumps, verdict, ahead is not None


def _name(finding: Finding, judged: stall.StallVerdict, processes: dict[str, Any],
          stack_info: StackVerdict) -> Finding | None:
    """Step 4: the finding to act on, or None to keep watching."""
    if not judged.hung and finding.evidence.get("confirm", False):
        return None
    evidence = {**finding.evidence, "processes": processes}
    if not judged.ranks:
        # Nothing told the ranks apart (every rank waits in a collective: the stuck one is on
        # another node). The detector's finding stands, without "stacks": a leader prefers a
        # node whose stacks named a rank.
        return dataclasses.replace(finding, evidence=evidence)
    stuck = ranks_doing(judged.ranks, "is", "are")
    return dataclasses.replace(
        finding, ranks=tuple(judged.ranks),
        message=f"hang at step {finding.step}: {stuck} stuck ({judged.reason})",
        evidence={**evidence, "stacks": stack_info.to_dict()})


class EarlyLook:
    """Steps 1 and 2 of a confirmation, read ahead in a thread of its own while a stall is
    half-way to a suspicion.

    A rank waiting in DDP's all-reduce shows only ``backward`` in Python; telling it from a rank
    stuck elsewhere needs its native frames. The look takes them only where the confirmation
    would (``stacks.deepen``), and only when no rank is busy: a working rank is not paused for a
    stall that is about to resolve itself. ``native_for`` hands them to ``confirm`` if every
    rank's Python stack is still where it was."""

    def __init__(self, rank_pids: Mapping[int, int]) -> None:
        self.rank_pids = dict(rank_pids)
        self.python: dict[int, StackDump] = {}
        self.native: dict[int, StackDump] = {}
        self.sample: stall.Sample | None = None
        """Each rank's CPU time when the look began: the start of the confirmation's window."""
        self._thread = threading.Thread(target=self._look, name="babysit-early-look",
                                        daemon=True)
        self._thread.start()

    def _look(self) -> None:
        self.sample = stall.Sample(self.rank_pids)
        seen = _look(self.rank_pids, self.sample)
        if not seen.dumps or seen.busy or seen.stopped:
            return
        deeper, _ = stacks.deepen(seen.readable, seen.dumps, stacks.odd_one_out(seen.dumps))
        self.python = seen.dumps
        self.native = {r: d for r, d in deeper.items() if d.native and d.error is None}

    def wait(self, timeout_s: float = 15.0) -> None:
        """Until the look is done."""
        self._thread.join(timeout_s)

    def native_for(self, dumps: Mapping[int, StackDump]) -> dict[int, StackDump] | None:
        """The native dumps read ahead, in place of ``dumps`` (Python stacks read now), if the
        look took them and no rank moved since: the same main-thread frames in both reads."""
        if self._thread.is_alive() or not self.native or set(self.python) != set(dumps):
            return None
        for rank, now in dumps.items():
            before, after = self.python[rank].main_thread, now.main_thread
            if before is None or after is None or before.frames != after.frames:
                return None
        return {r: self.native.get(r, d) for r, d in dumps.items()}
