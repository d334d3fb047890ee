"""The run's record: what the members gathered, written down in a fixed order.

Each tick the loop hands ``Record.take`` what its members gathered (``run.members.Gathered``).
In order, it journals the members' own entries, the ranks' ``stream`` reports (where the data
is: a rerun on other samples is undecided before its steps are judged), writes each of the job's
steps to
``metrics.jsonl`` (the watch judges it; a rerun's verdict is journaled as ``rerun``), journals
each rank's event (an SDC digest is compared first; a resume that did not take is a finding),
and hands back what the loop decides on:
the watch's findings, the progress, the node findings. Who needs to know what happened
listens: to the journal (``Journal.listen``) and to the steps (``StepLog.listen``), never
called from here one by one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from babysit.checkpoints.capacity import size
from babysit.policies import decide as sm
from babysit.policies.types import Finding, JobStep
from babysit.supervisor.contract.protocol import WorkerEvent
from babysit.supervisor.run.journal import Journal
from babysit.supervisor.run.members import Entry, Gathered
from babysit.supervisor.run.recovery import Recovery
from babysit.supervisor.run.steps import StepLog
from babysit.supervisor.run.watch import Watch

WATCH_STATE_EVERY = 100
"""Steps between journaled judgement states (a few KB each: the detectors' windows)."""
JOURNALED = {"hello": "worker_hello", "close": "worker_close", "skip": "worker_skip",
             "scalars": "worker_scalars", "cadence": "cadence_applied",
             "stream": "worker_stream", "holding": "worker_holding"}
"""Rank events journaled as they are, by the entry's name."""


class Record:
    """The journal and ``metrics.jsonl`` of one run. Call ``open()`` first and ``close()``
    last; ``write`` from any thread, everything else from the loop's."""

    def __init__(self, run_dir: Path, watch: Watch, recovery: Recovery, world_size: int, *,
                 where: Callable[[], sm.Machine], warn: Callable[[str], None]) -> None:
        """``where()``: the machine whose attempt and step each entry carries; ``warn(title)``
        alerts at warning severity."""
        self.journal = Journal(run_dir / "events.jsonl")
        self.steps = StepLog(run_dir / "metrics.jsonl")
        self.watch, self.recovery = watch, recovery
        self._where, self._warn = where, warn
        self.world = world_size
        """The job's ranks, from the hellos (an SDC check waits for every rank's digests)."""
        self._memory_planned = False
        self._memory_off = False
        """Copies were off and the console said why: once a run (each attempt's rank 0 says it
        again, its figures a little different)."""
        self._memory_failed = 0
        """Memory copies that failed: the first is said on the console, the rest counted."""
        self.newest_step = 0
        """The newest step any rank reported this attempt (ahead of the merged steps)."""
        self.job_step: int | None = None
        """The job's step: that of the newest row written to ``metrics.jsonl`` (the newest
        step every rank completed; after a relaunch, the new attempt's once its first step
        is in). Every journal entry carries it as ``step``."""

    def open(self) -> None:
        self.journal.open()
        self.steps.open()

    def close(self) -> None:
        self.steps.close()
        self.journal.close()

    def write(self, event: str, /, step: int | None = None, **evidence: Any) -> None:
        """Journal ``event`` now, at the machine's attempt and the job's step (``job_step``):
        an entry's ``step`` means that, and a field of ``evidence`` names any other step (a
        checkpoint's is ``checkpoint_step``). ``step`` given stands in for the job's (no writer
        gives one today)."""
        self.journal.write(event, time.time(), self._where().attempt,
                           step if step is not None else self.job_step, **evidence)

    def write_all(self, entries: list[Entry]) -> None:
        for event, fields in entries:
            self.write(event, **fields)

    def take(self, got: Gathered, judging: bool) -> list[sm.Event | Finding]:
        """Record what the members saw: their own entries, the job's steps (judged when
        ``judging``: not while the workers are being replaced), the ranks' events, the
        progress. Returns the findings and progress, in order, and then the node findings.
        ``got.end`` is the caller's."""
        self.write_all(got.entries)
        for title in got.warnings:
            self._warn(title)
        if got.newest is not None:
            self.newest_step = max(self.newest_step, got.newest)
        items: list[sm.Event | Finding] = []
        # Where the ranks' data stream is comes first: a rank says it before its first step,
        # and a rerun that draws other samples must be known as such before its steps judge.
        streams = [e for e in got.events if e.type == "stream"]
        for event in streams:
            items += self._rank_event(event)
        for record, row in got.steps:
            self.steps.write(record, row)
            self.job_step = record.step
            if judging:
                items += self._judge_step(record)
        for event in got.events:
            if event.type != "stream":
                items += self._rank_event(event)
        if got.steps:
            newest = got.steps[-1][0].step
            items.append(sm.Progress(newest, first=got.steps[0][0].step))
            if judging:  # steps gathered while the workers are replaced vouch for nothing
                self.write_all(self.recovery.on_progress(newest))
        return items + got.findings

    def _judge_step(self, record: JobStep) -> list[Finding]:
        findings = self.watch.observe_record(record)
        self._write_verdicts()
        if record.step % WATCH_STATE_EVERY == 0:
            # So a supervisor taking over inherits the baselines, not only the last finding's.
            self.write("watch_state", state=self.watch.state_dict())
        return findings

    def _write_verdicts(self) -> None:
        """Whose fault each rerun's spike was: the data's comes back as a finding (its
        rollback's alert says so); a transient one is remedied by the rerun itself, said here,
        and so is one the rerun could not decide."""
        for verdict in self.watch.take_verdicts():
            self.write("rerun", **verdict.to_json())
            if not verdict.reproduced:
                self._warn(verdict.summary())

    def _rank_event(self, event: WorkerEvent) -> list[Finding]:
        """A rank's event (any node's rank, in a multi-node run), journaled; the journal's
        listeners take it from there (a saved checkpoint: its probation, the cadence)."""
        kind, data = event.type, event.data
        if kind == "hello":
            self.watch.attached(event.rank)  # its death can be held against a batch
            if isinstance(data.get("world_size"), int) and data["world_size"] > 0:
                self.world = data["world_size"]
        if kind in JOURNALED:
            self.write(JOURNALED[kind], rank=event.rank, data=data)
            if kind == "stream":  # where the data is: a rollback's skip is given in samples
                found = self.watch.observe_stream(data)
                self._write_verdicts()
                return found
        elif kind == "checkpoint":
            self.write("checkpoint_saved", checkpoint_step=int(data.get("step", 0)),
                       rank=event.rank, data=data)
        elif kind == "memory_copy":  # one rank's part; committed once every rank's is in
            self.write_all(self.recovery.memory_part(event.rank, data, self.world))
        elif kind == "memory_copy_plan":  # rank 0's, at each attempt's first copy
            said: dict[str, Any] = {"summary": _memory_plan(data)} \
                if not self._memory_planned else {}
            self._memory_planned = True  # the console says it once a run
            self.write(kind, rank=event.rank, data=data, **said)
        elif kind == "memory_copy_off":  # rank 0's, at each attempt's first copy: said once
            why = str(data.get("why", ""))
            said = {"summary": f"no memory copies: {why}"} if not self._memory_off else {}
            self._memory_off = True
            self.write(kind, rank=event.rank, why=why, **said)
        elif kind == "memory_copy_failed":  # the first said, the others counted
            self._memory_failed += 1
            said = {"summary": _memory_failed(event.rank, data)} \
                if self._memory_failed == 1 else {}
            self.write(kind, rank=event.rank, data=data, failed=self._memory_failed, **said)
        elif kind == "memory_copy_skipped":
            self.write(kind, rank=event.rank, data=data)
        elif kind == "checkpoints_off":  # checkpoints asked for, but this run can take none
            why = str(data.get("why", ""))
            self.write("checkpoints_off", rank=event.rank, why=why)
            self._warn(why)
        elif kind == "checkpoint_sync":  # asynchronous saves asked for, but no room for them
            reason = str(data.get("reason", ""))
            self.write("checkpoint_sync", rank=event.rank, reason=reason)
            self._warn(f"checkpoints: {reason}")
        elif kind == "checkpoint_failed":
            step, error = int(data.get("step", 0)), str(data.get("error", ""))
            self.write("checkpoint_failed", checkpoint_step=step, rank=event.rank, error=error)
            self._warn(f"checkpoint at step {step} failed to save; training goes on from the "
                       f"last good one: {error}")
        elif kind == "resume_check":
            self.write("resume_check", rank=event.rank, data=data)
            failed = self.watch.observe_resume(event)
            return [failed] if failed is not None else []
        elif kind == "fingerprint":
            check = self.watch.observe_fingerprint(event, self.world)
            if check is not None:
                finding = check.finding
                self.write("sdc_check", checked_step=check.step, agree=check.agree,
                           ranks=check.ranks,
                           repeat=not check.agree and finding is None,
                           last_agreeing_step=check.last_agreeing_step,
                           disagreeing=list(finding.ranks) if finding else [],
                           digests=finding.evidence.get("digests") if finding else None)
                return [finding] if finding is not None else []
        return []


def _memory_plan(data: dict[str, Any]) -> str:
    """The console's line for the memory copies' plan: how often, and the host memory they take
    on the node that holds the most."""
    held = [int(b) for b in (data.get("node_bytes") or {}).values()
            if isinstance(b, int | float)]
    every = data.get("every")
    when = (f"from step {every} on, as often as the cost model chooses"
            if data.get("auto") else f"every {every} steps")
    most = size(max(held)) if held else "nothing"
    return (f"memory copies {when}: up to {most} of shared memory on a node "
            f"({data.get('copies')} copies of its ranks' state and of the replica it keeps "
            f"for its peer)")


def _memory_failed(rank: int, data: dict[str, Any]) -> str:
    """The console's line for the first memory copy that failed: what failed, that training
    goes on, where the later ones are counted, and what to change when shared memory was
    full."""
    error = str(data.get("error", ""))
    full = "No space left on device" in error or "[Errno 28]" in error
    hint = (" /dev/shm is full: give the node a larger one (docker run --shm-size), or set "
            "checkpoints.memory_every_steps: 0." if full else "")
    return (f"rank {rank}'s memory copy of step {data.get('step')} failed: {error}. Training "
            f"goes on without it; later failures are counted in `babysit status`, not said "
            f"here.{hint}")
