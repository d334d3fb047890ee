"""This node's ranks' keepers: asking them for the last completed step after a fault.

Each attached rank's keeper (``rank/just_in_time.py``) answers on a socket of its own. After a
hang, a crash or a lost node, and before anything is stopped, the node asks every rank that is
alive and not stopped what it holds, has the chosen writers write it, copies the marks of the
others (their random streams at the step's start: ``checkpoints.mark``), and releases them all.
Who writes is decided where the whole job is seen: here for a single node (``save``), by the
leader for several (``cluster.leader``), from the views each node gathered
(``checkpoints.just_in_time.plan``). A process that is dead or stopped (SIGSTOP) is never asked
and never waited for; every request has a deadline, and the whole save one bound
(``Budget``), past which the relaunch goes on from the newest checkpoint.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import psutil

from babysit.checkpoints import just_in_time
from babysit.checkpoints.layout import step_dir
from babysit.checkpoints.manifest import FileEntry
from babysit.checkpoints.mark import MarkError
from babysit.checkpoints.mark import read as read_mark
from babysit.supervisor.contract import just_in_time as contract

Entry = tuple[str, dict[str, Any]]

VIEW_S = 2.0
"""How long a live rank has to say what it holds: a thread's answer, milliseconds when the GIL
is free; a rank that does not answer in this (its main thread holds the GIL in native code)
counts as absent."""
FLOOR_S = 10.0
"""The least time a just-in-time save is given (``Budget``)."""
CRASH_CAP_S = 25.0
"""After a crash, torchrun kills the survivors 30 s after its SIGTERM: a save must end first."""


@dataclass
class Budget:
    """How long a just-in-time save may take: ``timeout_s`` when set, else four times the
    slowest save this run measured plus 5 s, at least ``FLOOR_S``."""

    timeout_s: float | None = None
    slowest_s: float = 0.0

    def saved(self, seconds: float) -> None:
        """A checkpoint of this run took ``seconds`` from start to commit."""
        self.slowest_s = max(self.slowest_s, seconds)

    def seconds(self, crash: bool = False) -> float:
        bound = self.timeout_s if self.timeout_s is not None else \
            max(FLOOR_S, 4 * self.slowest_s + 5.0)
        return min(bound, CRASH_CAP_S) if crash else bound

    @property
    def hold_s(self) -> float:
        """How long a rank that is ending waits to be asked: the longest save and a margin."""
        return self.seconds() + 5.0


@dataclass
class Gathered:
    """What a node's ranks said: views of the live ones, why the others gave none, and the
    step each mark file there starts from (dead and live ranks alike)."""

    views: dict[int, just_in_time.RankView] = field(default_factory=dict)
    absent: dict[int, str] = field(default_factory=dict)
    marks: dict[int, int] = field(default_factory=dict)

    def add(self, other: Gathered) -> None:
        """Another node's answer: its ranks' views, absences and marks."""
        self.views.update(other.views)
        self.absent.update({r: w for r, w in other.absent.items() if r not in self.views})
        self.marks.update(other.marks)

    def missing(self, ranks: Mapping[int, str]) -> None:
        """Ranks nobody answered for (``ranks``: each with why, e.g. its node was lost)."""
        for rank, why in ranks.items():
            if rank not in self.views and rank not in self.absent:
                self.absent[rank] = why


class Remote(Protocol):
    """The other nodes of a multi-node run, as the leader reaches them (``cluster.keeping``);
    a single node has none. Each request goes out first (``ask``, ``write``) and its answers
    are collected after this node did its own part (``answers``, ``written``): the nodes work
    at the same time."""

    def ask(self, attempt: int, deadline: float) -> None:
        """Ask every other node what its ranks hold."""

    def answers(self, deadline: float) -> Gathered:
        """Every other node's answer, merged, by ``deadline``; the ranks of a node that gave
        none are absent, saying why."""

    def write(self, attempt: int, the_plan: just_in_time.Plan, dest: Path,
              deadline: float) -> None:
        """Have every other node write its part of ``the_plan``."""

    def written(self, deadline: float) -> tuple[list[FileEntry], dict[int, str]]:
        """Every other node's writers' files and failures; a node that did not answer in time
        fails its writers."""

    def release(self, attempt: int) -> None:
        """Every other node releases its ranks."""


class Keepers:
    """This node's ranks' keepers in one attempt."""

    def __init__(self, token_hex: str, marks_root: Path) -> None:
        self.token = token_hex
        self.marks_root = marks_root
        self._released: set[tuple[int, int]] = set()
        """(attempt, rank) of the ranks released: they are ending, and asked nothing more."""

    def marks(self, attempt: int) -> Path:
        """The folder of ``attempt``'s mark files (node-local shared memory)."""
        return self.marks_root / str(attempt)

    def settings(self, attempt: int, budget: Budget) -> dict[str, Any]:
        """The directive's ``just_in_time``: where the ranks mark, how long an ending one holds."""
        return {"marks": str(self.marks(attempt)), "hold_s": round(budget.hold_s, 3)}

    def gather(self, attempt: int, ranks: Mapping[int, int], deadline: float) -> Gathered:
        """Ask every rank of ``ranks`` (global rank -> pid) that is alive and running what it
        holds, all at once; read every mark file here."""
        out = Gathered()
        asked = {}
        for rank, pid in ranks.items():
            why = _not_running(pid)
            if why is None:
                asked[rank] = pid
            else:
                out.absent[rank] = why
        answers = self._each(attempt, asked, contract.STATE, lambda rank: {},
                             min(VIEW_S, max(0.1, deadline - time.monotonic())))
        for rank, answer in answers.items():
            if isinstance(answer, dict):
                out.views[rank] = just_in_time.RankView.from_json(answer)
            else:
                out.absent[rank] = answer
        for path in self.marks(attempt).glob("*"):
            try:
                out.marks[int(path.name)] = read_mark(path).step
            except (ValueError, MarkError):
                continue  # torn (its rank died writing it) or not a mark
        return out

    def write(self, attempt: int, the_plan: just_in_time.Plan, dest: Path, deadline: float,
              here: Collection[int]) -> tuple[list[FileEntry], dict[int, str]]:
        """Have this node's writers of ``the_plan`` (those of ``here``, this node's ranks)
        write into ``dest`` (at once, each from its keeper's thread) and copy the marks it
        names that are here. The files, and why each rank that failed did."""
        dest.mkdir(parents=True, exist_ok=True)
        files: list[FileEntry] = []
        failed: dict[int, str] = {}
        for rank in the_plan.marks:
            source = self.marks(attempt) / str(rank)
            if source.exists():
                shutil.copyfile(source, dest / just_in_time.mark_name(rank))
        writers = {r: 0 for r in the_plan.writers if r in here}
        answers = self._each(attempt, writers, contract.WRITE,
                             lambda rank: {"dir": str(dest), "step": the_plan.step, "model": True},
                             max(0.1, deadline - time.monotonic()))
        for rank, answer in answers.items():
            if isinstance(answer, dict) and answer.get("ok"):
                files += [FileEntry(str(f["name"]), int(f["size"]), int(f["crc32"]))
                          for f in answer["files"]]
            else:
                failed[rank] = answer if isinstance(answer, str) else str(answer.get("why"))
        return files, failed

    def release(self, attempt: int, ranks: Mapping[int, int]) -> None:
        """Tell every live rank of ``ranks`` the node is done with it (one holding on at its end
        ends now, as it would have)."""
        live = {r: pid for r, pid in ranks.items()
                if (attempt, r) not in self._released and _not_running(pid) is None}
        self._released |= {(attempt, r) for r in live}
        self._each(attempt, live, contract.RELEASE, lambda rank: {}, 1.0)

    def forget(self, attempt: int) -> None:
        """``attempt``'s mark files are of no more use."""
        shutil.rmtree(self.marks(attempt), ignore_errors=True)

    def _each(self, attempt: int, ranks: Mapping[int, int], request: str,
              body: Any, timeout: float) -> dict[int, dict[str, Any] | str]:
        """``request`` to every rank at once; each one's answer, or why it gave none."""
        if not ranks:
            return {}

        def one(rank: int) -> dict[str, Any] | str:
            try:
                return contract.ask(contract.address(self.token, attempt, rank), self.token,
                                    request, body(rank), timeout=timeout)
            except contract.Unanswered as exc:
                return f"no answer ({exc})"

        with ThreadPoolExecutor(max_workers=min(32, len(ranks)),
                                thread_name_prefix="babysit-keepers") as pool:
            futures = {rank: pool.submit(one, rank) for rank in ranks}
            return {rank: f.result() for rank, f in futures.items()}


def _not_running(pid: int) -> str | None:
    """Why the process ``pid`` cannot answer (dead, stopped), or None when it can."""
    try:
        status = psutil.Process(pid).status()
    except psutil.Error:
        return "dead"
    if status == psutil.STATUS_ZOMBIE:
        return "dead"
    if status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
        return "stopped (SIGSTOP): it cannot answer until continued"
    return None


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a just-in-time save came to: the journal's ``just_in_time`` entry's fields;
    ``outcome`` is ``saved``, ``none`` (there was state to keep, and it could not be: ``why``)
    or ``nothing`` (nothing to keep: no step since the attempt began, or a checkpoint of that
    very step saved)."""

    fields: dict[str, Any]

    @property
    def saved(self) -> bool:
        return self.fields.get("outcome") == "saved"

    def entry(self) -> tuple[str, dict[str, Any]]:
        """The journal's ``just_in_time`` entry: its fields and the console's summary."""
        return "just_in_time", {**self.fields, "summary": self.summary() or ""}

    def summary(self) -> str | None:
        """One line for the console; None when there was nothing to keep (nothing lost)."""
        f = self.fields
        if f["outcome"] == "nothing":
            return None
        if f["outcome"] != "saved":
            return f"no just-in-time state after the {f['fault']}: {f['why']}"
        writers = f["writers"]
        who = f"rank{'s' if len(writers) > 1 else ''} {_ranks(writers)}"
        lost = f" (random streams of rank(s) {_ranks(f['streams_lost'])} lost)" \
            if f["streams_lost"] else ""
        return (f"just-in-time state of step {f['step']} written by {who} after the "
                f"{f['fault']} in {f['seconds']:.2f} s{lost}")


def _ranks(ranks: list[int]) -> str:
    if len(ranks) <= 4:
        return ", ".join(map(str, ranks)) if len(ranks) < 3 else \
            ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"
    return f"{ranks[0]}-{ranks[-1]} ({len(ranks)})"


def decide(root: Path, world_size: int, gathered: Gathered, since_step: int
           ) -> just_in_time.Plan | just_in_time.NoPlan:
    """The plan for what was gathered, or why none: also none when no step completed since
    ``since_step`` (the attempt's resume point: nothing new to keep), or when a committed
    checkpoint of that step exists already (a save at that very step: it *is* the state)."""
    got = just_in_time.plan(world_size, gathered.views, gathered.marks, gathered.absent)
    if isinstance(got, just_in_time.NoPlan):
        return got
    if got.step <= since_step:
        return just_in_time.NoPlan(f"no step completed since the attempt resumed at step "
                                   f"{since_step}", got.step, nothing=True)
    if just_in_time.is_committed(step_dir(root, got.step)):
        return just_in_time.NoPlan(f"the checkpoint of step {got.step} is saved already",
                                   got.step, nothing=True)
    return got


def save(keepers: Keepers, attempt: int, ranks: Mapping[int, int], *, root: Path,
         world_size: int, since_step: int, fault: str, budget_s: float,
         remote: Remote | None = None) -> Outcome:
    """The whole just-in-time save, bounded by ``budget_s``: gather every rank's view (here:
    ``ranks``, global rank -> pid; elsewhere: ``remote``, the leader's other nodes), decide,
    write, commit; every rank is released whatever happens."""
    started = time.monotonic()
    deadline = started + budget_s
    fields: dict[str, Any] = {"fault": fault}
    try:
        if remote is not None:
            remote.ask(attempt, deadline)
        gathered = keepers.gather(attempt, ranks, deadline)
        if remote is not None:
            gathered.add(remote.answers(deadline))
        got = decide(root, world_size, gathered, since_step)
        if isinstance(got, just_in_time.NoPlan):
            fields.update(outcome="nothing" if got.nothing else "none", why=got.why,
                          step=got.step)
            return Outcome(fields)
        dest = just_in_time.staging_dir(root, got.step)
        shutil.rmtree(dest, ignore_errors=True)
        if remote is not None:
            remote.write(attempt, got, dest, deadline)
        files, failed = keepers.write(attempt, got, dest, deadline, ranks.keys())
        if remote is not None:
            more, failed_there = remote.written(deadline)
            files, failed = files + more, {**failed, **failed_there}
        if failed:
            shutil.rmtree(dest, ignore_errors=True)
            rank, why = min(failed.items())
            fields.update(outcome="none", step=got.step,
                          why=f"rank {rank} could not write its part: {why}")
            return Outcome(fields)
        path = just_in_time.commit(root, got, files, world_size, fault)
        fields.update(outcome="saved", path=str(path), **got.to_json())
        return Outcome(fields)
    except OSError as exc:
        fields.update(outcome="none", why=f"storage: {exc.strerror or exc}")
        return Outcome(fields)
    finally:
        fields["seconds"] = round(time.monotonic() - started, 3)
        keepers.release(attempt, ranks)
        if remote is not None:
            remote.release(attempt)
