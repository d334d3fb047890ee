"""The supervisor's view of a checkpoint root: what exists, which is good, what to roll back to.

Torch-free: pure decisions over manifests plus small file I/O at the edges (listing, reading
manifests, the verdicts file, deleting). The constructor does no I/O; every method reads the
directory afresh, so checkpoints committed by the running job appear without a reload.

Verdicts and how a checkpoint moves between them::

    (committed) -> PENDING --promote(healthy_step, probation)--> GOOD
                      |  \\                                        |
                      |   `--mark_suspect / mark_anomaly------> SUSPECT <--'
                      `--(and GOOD) failed verification-------> CORRUPT

- PENDING: committed, not yet proven. Promoted once the run stayed healthy ``probation`` steps
  past it; only the caller knows "healthy", so it passes the step it vouches for.
- GOOD: may be rolled back to.
- SUSPECT: an anomaly began soon after it (or it was saved during one). Sticky: never promoted.
- CORRUPT: verification failed (size or checksum). Sticky, never chosen, deleted by retention.

Verdicts live in ``<root>/verdicts.json`` (atomic writes), keyed by the manifest's ``id``, a
state's identity: a checkpoint saved again at the same step after a rollback starts PENDING
again, and the pin names the state chosen, not its step.

Lineage (``checkpoints/lineage.py``): a state that a rollback abandoned (its timeline forked off
before it) is **fenced**: never chosen, never promoted, and deleted by retention before anything
else. A state of a timeline the run does not know is another run's: never chosen, never deleted.
"""

from __future__ import annotations

import enum
import os
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from babysit.checkpoints import lineage
from babysit.checkpoints._atomic import atomic_write_json, uncommit_and_remove
from babysit.checkpoints.errors import ManifestError
from babysit.checkpoints.layout import (
    MANIFEST_NAME,
    PART_MARKER_PREFIX,
    TMP_SUFFIX,
    VERDICTS_NAME,
    parse_step_dir,
)
from babysit.checkpoints.manifest import Manifest, read_manifest
from babysit.checkpoints.memory import Place
from babysit.checkpoints.tiers import DISK, MEMORY, tier_of

_VERDICTS_FORMAT = 2
"""Keyed by a state's id (format 1 was keyed by its step; it is read and converted)."""


class Verdict(str, enum.Enum):
    """How far a committed checkpoint can be trusted (see the module docstring)."""

    PENDING = "pending"
    GOOD = "good"
    SUSPECT = "suspect"
    CORRUPT = "corrupt"


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """One committed checkpoint as the catalog sees it. ``path`` is its step directory."""

    step: int
    cursor: int
    path: Path
    manifest: Manifest
    verdict: Verdict
    reason: str | None = None
    """Why it got its verdict (for suspect and corrupt ones), as passed by the caller."""
    fenced: bool = False
    """Off the current timeline's chain (``lineage.py``): abandoned by a rollback, or another
    run's (``foreign``). Never chosen."""
    foreign: bool = False
    """Of a timeline this run's lineage does not know: another run's, never deleted."""

    @property
    def id(self) -> str:
        """The state's identity (its manifest's id): what verdicts, pins and retention use."""
        return self.manifest.id

    @property
    def timeline(self) -> str | None:
        return self.manifest.timeline


@dataclass(frozen=True, slots=True)
class Refusal:
    """A checkpoint ``choose_for_rollback`` refused, and why (one line per problem found)."""

    step: int
    path: Path
    problems: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class RollbackChoice:
    """The result of ``choose_for_rollback``: the checkpoint to load (None: none is usable) and
    every newer candidate refused on the way, for the journal."""

    checkpoint: Checkpoint | None
    refused: tuple[Refusal, ...] = field(default_factory=tuple)


class Catalog:
    """The committed checkpoints under ``root`` and their verdicts.

    Calling rules: one supervisor owns a root's verdicts (it is the only writer of
    ``verdicts.json``). Steps are optimizer steps, the same numbers the workers report.

    Memory copies (``checkpoints/memory.py``) are checkpoints of the same root whose files are in
    the nodes' shared memory: ``memory`` says where this supervisor stands among the nodes, so
    that one no live node fully holds is passed over (not marked: it is not damaged, only out
    of reach) and the files this node holds are verified; retention keeps the newest
    ``MEMORY_KEEP`` of them apart from the others (they never push a checkpoint on disk out).
    """

    MEMORY_KEEP = 2
    """Memory copies kept committed: the newest, and the one before while a newer is written."""

    def __init__(self, root: str | Path, memory: Place | None = None) -> None:
        self.root = Path(root)
        self.memory = memory

    # ---- reading ------------------------------------------------------------------------------

    def checkpoints(self) -> list[Checkpoint]:
        """Every committed checkpoint, oldest first, fenced ones included (``fenced``).
        Directories without a readable manifest are skipped (see ``clean_incomplete``)."""
        state = self._load_verdicts()
        history = self.history()
        chain = history.chain()
        found = []
        for step, path in self._step_dirs():
            try:
                manifest = read_manifest(path)
            except ManifestError:
                continue
            verdict, reason = Verdict.PENDING, None
            entry = state["states"].get(manifest.id)
            if entry is not None:
                verdict, reason = Verdict(entry["verdict"]), entry.get("reason")
            found.append(Checkpoint(step, manifest.cursor, path, manifest, verdict, reason,
                                    fenced=not lineage.live(chain, manifest.timeline, step),
                                    foreign=not history.known(manifest.timeline)))
        return found

    def live(self) -> list[Checkpoint]:
        """The committed checkpoints on the current timeline's chain, oldest first: the only
        ones a rollback, a relaunch or a takeover may choose."""
        return [c for c in self.checkpoints() if not c.fenced]

    def history(self) -> lineage.Lineage:
        """The run's timelines as recorded under the root (``checkpoints/lineage.py``)."""
        return lineage.read(self.root)

    def get(self, step: int) -> Checkpoint | None:
        """The committed checkpoint at ``step``, if any (one folder per step: a fenced one is
        replaced when the current timeline saves that step)."""
        return next((c for c in self.checkpoints() if c.step == step), None)

    def newest_good_before(self, step: int) -> Checkpoint | None:
        """The newest live GOOD checkpoint saved strictly before ``step`` (an anomaly's onset)."""
        good = [c for c in self.live() if c.verdict is Verdict.GOOD and c.step < step]
        return good[-1] if good else None

    @property
    def pinned_step(self) -> int | None:
        """The step of the checkpoint last chosen for a rollback, if any."""
        pin = self._load_verdicts()["pinned"]
        return int(pin["step"]) if pin else None

    @property
    def pinned_id(self) -> str | None:
        """The checkpoint last chosen for a rollback (retention never deletes it), if any."""
        pin = self._load_verdicts()["pinned"]
        return str(pin["id"]) if pin else None

    # ---- verdicts -----------------------------------------------------------------------------

    def promote(self, healthy_step: int, probation_steps: int,
                unwatched: tuple[int, int] | None = None) -> list[Checkpoint]:
        """Mark GOOD every PENDING checkpoint at a step <= ``healthy_step - probation_steps``.

        ``healthy_step``: the caller vouches that the run was healthy (no open anomaly) through
        this step. ``unwatched``: steps ``a < s <= b`` no supervisor observed (workers trained
        on while none ran); a checkpoint whose probation steps fall partly there stays
        PENDING, since nobody vouches for them. Returns the checkpoints promoted now.
        """
        if probation_steps < 0:
            raise ValueError(f"probation_steps must be >= 0, got {probation_steps}")

        def blind(c: Checkpoint) -> bool:
            return unwatched is not None and c.step < unwatched[1] and \
                c.step + probation_steps > unwatched[0]

        ready = [
            c
            for c in self.live()
            if c.verdict is Verdict.PENDING and c.step + probation_steps <= healthy_step
            and not blind(c)
        ]
        self._set(ready, Verdict.GOOD, f"healthy through step {healthy_step}")
        return ready

    def mark_suspect(self, step: int, reason: str) -> Checkpoint | None:
        """Mark the checkpoint at ``step`` SUSPECT (unless corrupt). Returns it, or None."""
        ckpt = self.get(step)
        if ckpt is None or ckpt.verdict is Verdict.CORRUPT:
            return None
        self._set([ckpt], Verdict.SUSPECT, reason)
        return ckpt

    def mark_anomaly(self, onset_step: int, window_steps: int, reason: str) -> list[Checkpoint]:
        """An anomaly began at ``onset_step``: mark SUSPECT every non-corrupt checkpoint whose step
        is >= ``onset_step - window_steps``.

        That is the ones the anomaly began within ``window_steps`` after (it may have been brewing
        when they were saved) and the ones saved during it (they belong to the bad run and must
        never be promoted later). Returns the checkpoints marked.
        """
        hit = [
            c
            for c in self.live()
            if c.step >= onset_step - window_steps and c.verdict is not Verdict.CORRUPT
        ]
        self._set(hit, Verdict.SUSPECT, reason)
        return hit

    def mark_corrupt(self, step: int, reason: str) -> Checkpoint | None:
        """Mark the checkpoint at ``step`` CORRUPT. Returns it, or None if there is none."""
        ckpt = self.get(step)
        if ckpt is not None:
            self._set([ckpt], Verdict.CORRUPT, reason)
        return ckpt

    # ---- rollback -----------------------------------------------------------------------------

    def choose_for_rollback(
        self, onset_step: int | None, *, verify: bool = True, allow_pending: bool = False,
        just_in_time: bool | None = None,
    ) -> RollbackChoice:
        """Pick the checkpoint to roll back to for an anomaly that began at ``onset_step``.

        Candidates: GOOD checkpoints (plus PENDING ones with ``allow_pending``) strictly before
        the onset (None: at any step), newest first; just-in-time ones
        (``checkpoints/just_in_time.py``) only with ``just_in_time`` (default: as
        ``allow_pending``, a relaunch's choice, never a spike's). With ``verify`` each is
        checked fully (sizes and CRC-32 of every byte); one that fails is marked CORRUPT and
        the next older is tried. The chosen one is pinned so retention keeps it. Journal
        ``refused``: it says what was wrong and where.
        """
        wanted = {Verdict.GOOD, Verdict.PENDING} if allow_pending else {Verdict.GOOD}
        jit = allow_pending if just_in_time is None else just_in_time
        return self._choose([c for c in self.live()
                             if c.verdict in wanted
                             and (onset_step is None or c.step < onset_step)
                             and (jit or not tier_of(c.manifest).relaunch_only)], verify)

    def choose_trained_on(self, after_step: int, before_step: int, upto_cursor: int, reason: str,
                          *, verify: bool = True) -> RollbackChoice:
        """Pick the newest checkpoint saved at a step ``after_step < step < before_step`` that
        has consumed no batch at or past ``upto_cursor``, whatever its verdict but corrupt, for
        a caller that vouches for such weights: a rerun replayed those steps on the same
        batches the remedy trains on (``Recovery.resume_for``). The chosen one is verified and
        pinned like ``choose_for_rollback``'s, and a SUSPECT one becomes PENDING (``reason``):
        the remedy's attempt proves it or not, as for any new checkpoint."""
        choice = self._choose([c for c in self.live()
                               if after_step < c.step < before_step and c.cursor <= upto_cursor
                               and c.verdict is not Verdict.CORRUPT], verify)
        if choice.checkpoint is not None and choice.checkpoint.verdict is Verdict.SUSPECT:
            self._set([choice.checkpoint], Verdict.PENDING, reason)
        return choice

    def _choose(self, candidates: list[Checkpoint], verify: bool) -> RollbackChoice:
        """The newest of ``candidates`` (in step order) that verifies, pinned; a memory copy
        out of reach is passed over, unmarked."""
        refused = []
        for ckpt in reversed(candidates):
            tier = tier_of(ckpt.manifest)
            why = tier.unavailable(ckpt.manifest, self.memory)
            if why is not None:
                refused.append(Refusal(ckpt.step, ckpt.path, (why,)))
                continue
            problems = tier.verify(ckpt.manifest, ckpt.path, self.memory) if verify else []
            if problems:
                self._set([ckpt], Verdict.CORRUPT, "; ".join(problems))
                refused.append(Refusal(ckpt.step, ckpt.path, tuple(problems)))
                continue
            self._pin(ckpt)
            return RollbackChoice(ckpt, tuple(refused))
        return RollbackChoice(None, tuple(refused))

    def unpin(self) -> None:
        """Forget the checkpoint chosen for the last rollback (retention may then delete it)."""
        state = self._load_verdicts()
        state["pinned"] = None
        self._save_verdicts(state)

    # ---- deleting -----------------------------------------------------------------------------

    def retain(self, keep_last: int) -> list[Path]:
        """Delete old checkpoints; return the step directories deleted.

        Fenced ones go first, whatever their age (a rollback abandoned them: nothing may load
        them). Of the live ones, kept: the newest ``keep_last`` on disk that are not corrupt,
        the newest GOOD one on disk (whatever its age: it is the only safe rollback target that
        lasts), the newest ``MEMORY_KEEP`` memory copies, the newest state of any kind (what a
        relaunch resumes from), and the pinned one (chosen for a rollback that may still be
        loading). Everything else goes, corrupt ones included (they can never be loaded; their
        reasons were returned when they were found). Another run's (``foreign``) are never
        touched. External data outside the step directory is deleted only if it was registered
        with ``owned=True``.
        """
        if keep_last < 0:
            raise ValueError(f"keep_last must be >= 0, got {keep_last}")
        all_ckpts = [c for c in self.checkpoints() if not c.foreign]
        usable = [c for c in all_ckpts if c.verdict is not Verdict.CORRUPT and not c.fenced]
        disk = [c for c in usable if tier_of(c.manifest).pool == DISK]
        memory = [c for c in usable if tier_of(c.manifest).pool == MEMORY]
        keep = {c.id for c in disk[max(0, len(disk) - keep_last):]} if keep_last else set()
        keep |= {c.id for c in memory[-self.MEMORY_KEEP:]}
        good = [c for c in disk if c.verdict is Verdict.GOOD]
        if good:
            keep.add(good[-1].id)
        if usable:
            keep.add(usable[-1].id)
        pinned = self.pinned_id
        if pinned is not None:
            keep.add(pinned)
        gone = [c for c in all_ckpts if c.id not in keep]
        for ckpt in sorted(gone, key=lambda c: not c.fenced):  # the fenced first
            uncommit_and_remove(ckpt.path)
            ext = ckpt.manifest.external_path
            if ext and ckpt.manifest.owned:
                # Exactly what was registered: a file is not a licence to delete its folder.
                if ckpt.manifest.external_is_file:
                    Path(ext).unlink(missing_ok=True)
                else:
                    shutil.rmtree(ext, ignore_errors=True)
        if gone:
            self._forget({c.id for c in gone})
        return [c.path for c in gone]

    def clean_incomplete(
        self,
        *,
        min_age_s: float = 0.0,
        exclude: Iterable[str | Path] = (),
        now: float | None = None,
    ) -> list[Path]:
        """Delete step directories without a manifest (saves that never finished); return them.

        The rule for never deleting a save in progress: call it between attempts (the old job is
        dead, the new one not launched) with the default ``min_age_s=0``. While a job runs, pass
        ``min_age_s`` longer than the slowest save can go without writing a byte (a directory
        counts as young while any file in it changed within ``min_age_s`` seconds of ``now``,
        Unix seconds) and/or ``exclude`` the step directory being saved. Also removes leftover
        temp files and async part markers inside committed checkpoints.
        """
        now = time.time() if now is None else now
        excluded = {Path(p).absolute() for p in exclude}
        removed = []
        for _step, path in self._step_dirs():
            if path.absolute() in excluded:
                continue
            if (path / MANIFEST_NAME).exists():
                self._sweep_protocol_leftovers(path)
                continue
            if now - _newest_mtime(path) < min_age_s:
                continue
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        return removed

    # ---- internals ----------------------------------------------------------------------------

    def _step_dirs(self) -> list[tuple[int, Path]]:
        try:
            entries = list(os.scandir(self.root))
        except FileNotFoundError:
            return []
        dirs = []
        for entry in entries:
            step = parse_step_dir(entry.name)
            if step is not None and entry.is_dir():
                dirs.append((step, Path(entry.path)))
        return sorted(dirs)

    @staticmethod
    def _sweep_protocol_leftovers(path: Path) -> None:
        # A crash between the manifest commit and marker removal leaves markers; harmless, tidy.
        for entry in os.scandir(path):
            if entry.name.startswith(PART_MARKER_PREFIX) or entry.name.endswith(TMP_SUFFIX):
                Path(entry.path).unlink(missing_ok=True)

    def _load_verdicts(self) -> dict[str, Any]:
        import json

        try:
            state = json.loads((self.root / VERDICTS_NAME).read_text())
        except FileNotFoundError:
            state = None
        except ValueError:
            # Written atomically, so damage means someone else wrote it; verdicts are recoverable
            # knowledge (everything restarts pending), a crash of the supervisor is not.
            state = None
        if isinstance(state, dict) and state.get("format") == 1:  # keyed by step: convert
            state = {"format": _VERDICTS_FORMAT, "pinned": state.get("pinned"),
                     "states": {e["id"]: {**e, "step": int(step)}
                                for step, e in state.get("checkpoints", {}).items()
                                if isinstance(e, dict) and "id" in e}}
        if not isinstance(state, dict) or state.get("format") != _VERDICTS_FORMAT:
            state = {"format": _VERDICTS_FORMAT, "pinned": None, "states": {}}
        return state

    def _save_verdicts(self, state: dict[str, Any]) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        atomic_write_json(self.root / VERDICTS_NAME, state)

    def _set(self, ckpts: list[Checkpoint], verdict: Verdict, reason: str) -> None:
        if not ckpts:
            return
        state = self._load_verdicts()
        for c in ckpts:
            state["states"][c.id] = {
                "step": c.step,
                "timeline": c.timeline,
                "verdict": verdict.value,
                "reason": reason,
                "time": time.time(),
            }
        self._save_verdicts(state)

    def _pin(self, ckpt: Checkpoint) -> None:
        state = self._load_verdicts()
        state["pinned"] = {"step": ckpt.step, "id": ckpt.id}
        self._save_verdicts(state)

    def _forget(self, ids: set[str]) -> None:
        state = self._load_verdicts()
        for key in ids:
            state["states"].pop(key, None)
        if state["pinned"] and state["pinned"].get("id") in ids:
            state["pinned"] = None
        self._save_verdicts(state)


def _newest_mtime(path: Path) -> float:
    newest = path.stat().st_mtime
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                newest = max(newest, os.stat(os.path.join(dirpath, name)).st_mtime)
            except FileNotFoundError:
                continue  # removed while we looked: the writer is alive, mtime of the dir counts
    return newest
