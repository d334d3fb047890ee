"""A just-in-time save of the last completed step, over every node's ranks: one path for a job
of one node or many.

Each attached rank's keeper (``rank/keeper.py``) answers on a socket of its own. After a
hang, a crash or a lost node, and before anything is stopped, ``save`` asks every rank of the
job that is alive and not stopped what it holds, chooses the writers from all the views
(``checkpoints.just_in_time.plan``), has them write, has every node copy the marks of its other
ranks (their random streams at the step's start: ``checkpoints.mark``), commits, and releases
them all. The job's ranks are reached in ``Part``s: this node's directly (``OwnRanks``), and on
a multi-node leader the other nodes' over the cluster's wire (``cluster.keeping.OtherNodes``).
A single node is a job of one part; nothing else differs. A process that is dead or stopped
(SIGSTOP) is never asked and never waited for; every request has a deadline, and the whole save
one bound (``Budget``), past which the relaunch goes on from the newest checkpoint. A mark that
no node copied is a rank whose random streams are lost (said so), never a missing file at the
commit.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import psutil

from babysit.checkpoints import just_in_time
from babysit.checkpoints.layout import step_dir
from babysit.checkpoints.manifest import FileEntry, hash_file
from babysit.checkpoints.mark import MarkError
from babysit.checkpoints.mark import read as read_mark
from babysit.supervisor.contract import keeper as contract

Entry = tuple[str, dict[str, Any]]

VIEW_S = 2.0
"""How long a live rank has to say what it holds: a thread's answer, milliseconds when the GIL
is free; a rank that does not answer in this (its main thread holds the GIL in native code)
counts as absent."""
FLOOR_S = 10.0
"""The least time a just-in-time save is given (``Budget``)."""
STOPPED_RELEASE_S = 60.0
"""How long a release waits in a stopped rank's socket for it to be continued (by the stop)."""
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
        """Ranks nobody answered for (``ranks``: each with why, e.g. "on a lost node")."""
        for rank, why in ranks.items():
            if rank not in self.views and rank not in self.absent:
                self.absent[rank] = why


@dataclass
class Written:
    """What the writers and mark copies of a part came to: the files in the staging folder (as
    manifest entries, hashed where they were written), why each writer that failed did, and the
    format each one that succeeded wrote (None: babysit's own; else a framework's, as its
    answer said: ``just_in_time.Format``)."""

    files: list[FileEntry] = field(default_factory=list)
    failed: dict[int, str] = field(default_factory=dict)
    formats: dict[int, just_in_time.Format | None] = field(default_factory=dict)

    def add(self, other: Written) -> None:
        self.files += other.files
        self.failed.update(other.failed)
        self.formats.update(other.formats)

    def answered(self, rank: int, answer: dict[str, Any] | str) -> None:
        """A writer's answer to ``WRITE``: its files and format, or why it wrote nothing."""
        if isinstance(answer, str) or not answer.get("ok"):
            self.failed[rank] = answer if isinstance(answer, str) else str(answer.get("why"))
            return
        try:
            form = answer.get("format")
            self.formats[rank] = just_in_time.Format.from_json(form) if form else None
            self.files += [FileEntry(str(f["name"]), int(f["size"]), int(f["crc32"]))
                           for f in answer["files"]]
        except (KeyError, TypeError, ValueError) as exc:
            self.failed[rank] = f"its answer is malformed ({type(exc).__name__}: {exc})"

    def form(self) -> just_in_time.Format | None:
        """The one format every writer wrote; raises ``ValueError`` when they differ."""
        forms = set(self.formats.values())
        if len(forms) > 1:
            raise ValueError("the writers wrote different formats (" + ", ".join(
                f"rank {r}: {f.name if f else 'babysit'}" for r, f in sorted(self.formats.items()))
                + ")")
        return next(iter(forms), None)


class Part(Protocol):
    """Some of the job's ranks, as a just-in-time save reaches them: this node's (``OwnRanks``)
    or the other nodes' of a multi-node run (``cluster.keeping.OtherNodes``). Each request goes
    out to every part first (``ask``, ``write``) and the answers are collected after
    (``answers``, ``written``), so that the nodes work at the same time."""

    def ask(self, attempt: int, deadline: float) -> None:
        """Ask the part's ranks what they hold."""

    def answers(self, deadline: float) -> Gathered:
        """The part's answers by ``deadline``; a rank that gave none is absent, saying why."""

    def write(self, attempt: int, the_plan: just_in_time.Plan, dest: Path,
              deadline: float) -> None:
        """Have the part's writers of ``the_plan`` write and its nodes copy the marks it names."""

    def written(self, deadline: float) -> Written:
        """What was written and copied; a node that did not answer in time fails its writers
        (and its marks are not there: those ranks' streams are lost)."""

    def release(self, attempt: int) -> None:
        """Release the part's ranks (one holding on at its end ends now, as it would have)."""


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
              here: Collection[int]) -> Written:
        """Have this node's writers of ``the_plan`` (those of ``here``, this node's ranks)
        write into ``dest`` (at once, each from its keeper's thread) and copy the marks it
        names that are here. The files (the marks' too, hashed here), and why each rank that
        failed did."""
        dest.mkdir(parents=True, exist_ok=True)
        out = Written()
        for rank in the_plan.marks:
            source = self.marks(attempt) / str(rank)
            name = just_in_time.mark_name(rank)
            try:
                shutil.copyfile(source, dest / name)
            except FileNotFoundError:
                continue  # another node's rank, or its mark is gone: not this node's to copy
            out.files.append(hash_file(dest, name))
        writers = {r: 0 for r in the_plan.writers if r in here}
        answers = self._each(attempt, writers, contract.WRITE,
                             lambda rank: {"dir": str(dest), "step": the_plan.step, "model": True},
                             max(0.1, deadline - time.monotonic()))
        for rank, answer in answers.items():
            out.answered(rank, answer)
        return out

    def release(self, attempt: int, ranks: Mapping[int, int]) -> None:
        """Tell every live rank of ``ranks`` the node is done with it (one holding on at its end
        ends now, as it would have). A stopped rank (SIGSTOP) is told too, by a request that
        waits in its socket: continued to be stopped (the stop that follows sends SIGCONT and
        SIGTERM), it reads it first and ends at once instead of holding on for ``hold_s``."""
        waiting = {r: pid for r, pid in ranks.items() if (attempt, r) not in self._released}
        self._released |= {(attempt, r) for r in waiting}
        why = {r: _not_running(pid) for r, pid in waiting.items()}
        self._each(attempt, {r: pid for r, pid in waiting.items() if why[r] is None},
                   contract.RELEASE, lambda rank: {}, 1.0)
        for rank in (r for r, w in why.items() if w is not None and w.startswith("stopped")):
            threading.Thread(target=self._ask_one, daemon=True, name="babysit-release",
                             args=(attempt, rank, contract.RELEASE, {}, STOPPED_RELEASE_S)
                             ).start()

    def forget(self, attempt: int) -> None:
        """``attempt``'s mark files are of no more use."""
        shutil.rmtree(self.marks(attempt), ignore_errors=True)

    def _each(self, attempt: int, ranks: Mapping[int, int], request: str,
              body: Any, timeout: float) -> dict[int, dict[str, Any] | str]:
        """``request`` to every rank at once; each one's answer, or why it gave none."""
        if not ranks:
            return {}

        def one(rank: int) -> dict[str, Any] | str:
            return self._ask_one(attempt, rank, request, body(rank), timeout)

        with ThreadPoolExecutor(max_workers=min(32, len(ranks)),
                                thread_name_prefix="babysit-keepers") as pool:
            futures = {rank: pool.submit(one, rank) for rank in ranks}
            return {rank: f.result() for rank, f in futures.items()}

    def _ask_one(self, attempt: int, rank: int, request: str, body: dict[str, Any],
                 timeout: float) -> dict[str, Any] | str:
        try:
            return contract.ask(contract.address(self.token, attempt, rank), self.token,
                                request, body, timeout=timeout)
        except contract.Unanswered as exc:
            return f"not answering ({exc})"


class OwnRanks:
    """This node's ranks of the attempt, reached directly: the ``Part`` every save has. Its
    work is done when its answers are collected, after every other part was asked."""

    def __init__(self, keepers: Keepers, ranks: Mapping[int, int]) -> None:
        """``ranks``: this node's global rank -> pid."""
        self.keepers = keepers
        self.ranks = dict(ranks)
        self._attempt = -1
        self._write: tuple[just_in_time.Plan, Path] | None = None

    def ask(self, attempt: int, deadline: float) -> None:
        self._attempt = attempt

    def answers(self, deadline: float) -> Gathered:
        return self.keepers.gather(self._attempt, self.ranks, deadline)

    def write(self, attempt: int, the_plan: just_in_time.Plan, dest: Path,
              deadline: float) -> None:
        self._write = (the_plan, dest)

    def written(self, deadline: float) -> Written:
        assert self._write is not None, "write() first"
        the_plan, dest = self._write
        return self.keepers.write(self._attempt, the_plan, dest, deadline, self.ranks.keys())

    def release(self, attempt: int) -> None:
        self.keepers.release(attempt, self.ranks)


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
        form = f" as a {f['format']} checkpoint" if f.get("format") else ""
        return (f"just-in-time state of step {f['checkpoint_step']} written by {who}{form} after "
                f"the {f['fault']} in {f['seconds']:.2f} s{lost}")


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


def save(parts: Sequence[Part], attempt: int, *, root: Path, world_size: int,
         since_step: int, fault: str, budget_s: float) -> Outcome:
    """The whole just-in-time save of the job's ranks in ``parts``, bounded by ``budget_s``:
    gather every rank's view, decide, write, commit; every rank is released whatever happens.
    A rank whose mark no node copied keeps no random streams (``streams_lost``)."""
    started = time.monotonic()
    deadline = started + budget_s
    fields: dict[str, Any] = {"fault": fault}
    try:
        for part in parts:
            part.ask(attempt, deadline)
        gathered = Gathered()
        for part in parts:
            gathered.add(part.answers(deadline))
        got = decide(root, world_size, gathered, since_step)
        if isinstance(got, just_in_time.NoPlan):
            fields.update(outcome="nothing" if got.nothing else "none", why=got.why,
                          checkpoint_step=got.step)
            return Outcome(fields)
        dest = just_in_time.staging_dir(root, got.step)
        shutil.rmtree(dest, ignore_errors=True)
        for part in parts:
            part.write(attempt, got, dest, deadline)
        written = Written()
        for part in parts:
            written.add(part.written(deadline))
        if written.failed:
            shutil.rmtree(dest, ignore_errors=True)
            rank, why = min(written.failed.items())
            fields.update(outcome="none", checkpoint_step=got.step,
                          why=f"rank {rank} could not write its part: {why}")
            return Outcome(fields)
        try:
            form = written.form()
        except ValueError as exc:
            shutil.rmtree(dest, ignore_errors=True)
            fields.update(outcome="none", checkpoint_step=got.step, why=str(exc))
            return Outcome(fields)
        got = just_in_time.with_marks(got, {e.name for e in written.files})
        path = just_in_time.commit(root, got, written.files, world_size, fault, form)
        story = got.to_json()
        fields.update(outcome="saved", path=str(path), checkpoint_step=story.pop("step"), **story,
                      **({"format": form.name} if form is not None else {}))
        return Outcome(fields)
    except OSError as exc:
        fields.update(outcome="none", why=f"storage: {exc.strerror or exc}")
        return Outcome(fields)
    finally:
        fields["seconds"] = round(time.monotonic() - started, 3)
        for part in parts:
            part.release(attempt)
