"""Stdout mode on one node: the ranks' printed progress, fed in as if they had reported it.

``NodeWorkers`` hands every tee'd output line to ``PrintedProgress.line``; its ``take`` then
adds to the telemetry drained from the socket what the lines said, in the socket's own types:

- the first progress line of an attempt announces its rank with a ``hello`` whose data says
  ``source: output`` (so the hang detector watches it, the aggregator counts one reporting
  rank, and the stack dumps of a hang know its pid);
- each progress line becomes a ``RankStep``;
- a new copy of the script's checkpoint folder (``ScriptCheckpoints``) becomes a ``checkpoint``
  event, so the journal, retention and the cadence advice see it like any other.

Only the lowest rank that prints progress is read (nanoGPT, the Trainer and Lightning print on
rank 0 only; a script whose every rank prints would otherwise count each step once per rank).
Stdout mode ends for the run as soon as any rank says hello through the worker API: a script
that calls ``attach()`` reports its steps itself.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterable
from pathlib import Path

import psutil

from babysit.policies.types import Action, Finding, RankStep, Remedy
from babysit.supervisor.config.schema import StdoutConfig
from babysit.supervisor.contract.protocol import WorkerEvent
from babysit.supervisor.node.progress_lines import ProgressParser
from babysit.supervisor.node.script_checkpoints import ScriptCheckpoints

Entry = tuple[str, dict[str, object]]
SOURCE = "output"
"""``data.source`` of the events stdout mode makes up, so nobody mistakes them for a rank's."""

NO_ROLLBACK = ("stdout mode cannot roll back: babysit only reads this script's output. Set "
               "stdout.checkpoint_dir (where the script saves) and stdout.resume_args (how it "
               "resumes, e.g. [--init_from=resume]), or call attach() in the script")


class PrintedProgress:
    """Stdout mode's state for one node; see the module docstring. No I/O but the checkpoint
    folder's (through ``ScriptCheckpoints``) and reading worker environments for pids."""

    def __init__(self, config: StdoutConfig, run_dir: Path, single_node: bool = True) -> None:
        """``single_node``: stdout mode serves single-node runs only (a multi-node leader
        merges its nodes' summaries of reports, which printed lines do not make)."""
        self.config = config
        self.enabled = config.progress == "auto" and single_node
        self.attached = False
        """A rank said hello through the worker API: stdout mode is off for the rest of the
        run."""
        pattern = re.compile(config.pattern) if config.pattern else None
        self.parser = ProgressParser(pattern)
        self.checkpoints = (ScriptCheckpoints(Path(config.checkpoint_dir).resolve(),
                                              run_dir / "script_checkpoints", config.keep)
                            if config.checkpoint_dir else None)
        self.reporter: int | None = None
        self._announced = False
        self._steps: list[RankStep] = []
        self._newest = -1
        self.resume_args: list[str] = []
        """Appended to the script's arguments for the next attempt (a copy was put back)."""

    @property
    def active(self) -> bool:
        """Progress of this attempt comes from printed lines."""
        return self.enabled and not self.attached and self.reporter is not None

    def start(self) -> None:
        if self.checkpoints is not None:
            self.checkpoints.start()

    def new_attempt(self) -> None:
        self.parser.reset()
        self.reporter = None
        self._announced = False
        self._steps = []
        self._newest = -1

    def line(self, rank: int | None, text: str, now: float) -> None:
        """One line rank ``rank`` printed (None: torchrun's own), at wall-clock ``now``."""
        if rank is None or not self.enabled or self.attached:
            return
        if self.reporter is not None and rank > self.reporter:
            return
        step = self.parser.feed(rank, text, now)
        if step is None:
            return
        if self.reporter is None or rank < self.reporter:
            # A lower rank prints too: read it instead (its steps are the job's).
            self.reporter, self._announced = rank, False
            self._steps = [s for s in self._steps if s.rank == rank]
        self._steps.append(step)

    def take(self, messages: Iterable[RankStep | WorkerEvent], now: float, monotonic: float,
             pid_of: Callable[[int], int | None]) -> list[RankStep | WorkerEvent]:
        """``messages`` (drained from the socket) followed by what printed lines said since the
        last call. ``pid_of(rank)`` finds a rank's process for the announcing hello."""
        out = list(messages)
        for m in out:
            if isinstance(m, WorkerEvent) and m.type == "hello" and m.data.get("source") != SOURCE:
                self.attached = True
        steps, self._steps = self._steps, []
        if not self.enabled or self.attached or self.reporter is None:
            return out
        if not self._announced and steps:
            self._announced = True
            data: dict[str, object] = {"source": SOURCE, "world_size": 1,
                                       "format": self.parser.sources.get(self.reporter, "?")}
            pid = pid_of(self.reporter)
            if pid is not None:
                data["pid"] = pid
            out.append(WorkerEvent(rank=self.reporter, type="hello", time=now, data=data))
        out.extend(steps)
        if steps:
            self._newest = max(self._newest, max(s.step for s in steps))
        if self.checkpoints is not None and self._newest >= 0:
            copy = self.checkpoints.poll(monotonic, self._newest)
            if copy is not None:
                out.append(WorkerEvent(rank=self.reporter, type="checkpoint", time=now,
                                       data={"step": copy.step, "source": SOURCE,
                                             "path": str(copy.path)}))
        return out

    def can_roll_back(self, finding: Finding) -> bool:
        """A copy of the script's checkpoints precedes ``finding``'s onset. Without the
        checkpoint keys: True, so the policy's rollback reaches ``remedy``, which explains what
        would enable it."""
        if self.checkpoints is None:
            return True
        return any(s.step < finding.onset_step for s in self.checkpoints.snapshots())

    def remedy(self, remedy: Remedy) -> Remedy:
        """A rollback this mode cannot perform becomes an alert saying what would enable it."""
        if remedy.action is Action.ROLLBACK and self.active and self.checkpoints is None:
            return Remedy(Action.ALERT, remedy.finding, f"{remedy.reason}; {NO_ROLLBACK}")
        return remedy

    def restore(self, remedy: Remedy | None, aside: Path) -> list[Entry]:
        """Before a relaunch for ``remedy``: put back the script's checkpoint copy it needs (the
        newest from before the onset for a rollback, the newest for anything else) and arrange
        ``resume_args`` for the next attempt."""
        self.resume_args = []
        if remedy is None or self.checkpoints is None or self.attached or not self.enabled:
            return []
        entries: list[Entry] = []
        # A save the polls saw but had not copied yet (a relaunch follows the stop at once).
        late = self.checkpoints.settle(self._newest)
        if late is not None:
            entries.append(("script_checkpoint_copied", {
                "checkpoint_step": late.step, "path": str(late.path),
                "reason": "the workers stopped before a poll had copied it"}))
        rollback = remedy.action is Action.ROLLBACK
        before = remedy.finding.onset_step if rollback else None
        chosen = self.checkpoints.restore(before, aside)
        if chosen is None:
            return [*entries, ("script_checkpoint_restored", {
                "from": None, "before_step": before,
                "reason": "no copy of the script's checkpoints qualifies: starting over"})]
        self.resume_args = list(self.config.resume_args)
        return [*entries, ("script_checkpoint_restored", {
            "from": str(chosen.path), "checkpoint_step": chosen.step, "before_step": before,
            "folder": str(self.checkpoints.folder), "set_aside": str(aside),
            "resume_args": self.resume_args})]


def rank_pids(processes: Iterable[psutil.Process]) -> dict[int, int]:
    """Local rank -> pid among an attempt's processes (torchrun's output prefixes name local
    ranks): the topmost process whose environment says ``LOCAL_RANK`` (its data-loader workers
    inherit the variable)."""
    ranks: dict[int, int] = {}
    for p in processes:
        with contextlib.suppress(psutil.Error, ValueError, KeyError):
            ranks[p.pid] = int(p.environ()["LOCAL_RANK"])
    found: dict[int, int] = {}
    for pid, rank in sorted(ranks.items()):
        with contextlib.suppress(psutil.Error):
            if ranks.get(psutil.Process(pid).ppid()) != rank:
                found.setdefault(rank, pid)
    return found
