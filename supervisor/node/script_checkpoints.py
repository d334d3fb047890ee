"""The script's own checkpoints, in stdout mode: copies babysit keeps, and putting one back.

A script that only prints saves where it likes (nanoGPT: ``out_dir/ckpt.pt``, overwritten in
place) and resumes when told to (``--init_from=resume``). Its folder therefore holds only the
newest checkpoint, which after a loss spike is usually already poisoned. babysit keeps its own
copies: each time the folder changes and then holds still for one poll (a save in progress keeps
changing sizes), it is copied whole into ``<run_dir>/script_checkpoints/step-<N>``, ``N`` being
the newest step the script had printed when the change was last seen. A copy is never named
earlier than what it holds: a rollback to before a spike's onset takes the newest copy named
before it, and one named early could hold the poisoned state. So where the folder changed again
before it held still (a slow save, or on a loaded machine two saves between polls: ``ckpt.pt``
overwritten at step 20, then 30 and 40), the copy is named by the newest sighting, and a slow
save's copy is named a little late (the safe side: a rollback may pass over it).

A ``torch.save`` file (a zip archive) cut short is never copied: one whose writer paused longer
than a poll is copied once it is whole, and one whose writer was killed mid-save (a crash, a
stop) never is, so a rollback puts back the copy before it rather than a file the script cannot
load. A rollback puts back the newest copy from before the spike's onset; what the folder held
is moved aside, never deleted.

Copies are plain file copies (a checkpoint written in place would corrupt a hard link) made on
the supervisor's thread: fine for the checkpoints of the jobs stdout mode is for, slow for
multi-GB ones, for which ``attach()`` and babysit's own checkpoints are the better path.
"""

from __future__ import annotations

import os
import re
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path

Fingerprint = tuple[tuple[str, int, int], ...]
POLL_S = 0.25
"""Seconds between looks at the folder; a copy is made after one look without change."""
_NAME = re.compile(r"^step-(\d+)$")


@dataclass(frozen=True, slots=True)
class Snapshot:
    step: int
    """The newest step printed when the script's save was first noticed."""
    path: Path


def fingerprint(folder: Path) -> Fingerprint:
    """(relative path, size, mtime in ns) of every file under ``folder``; empty if missing."""
    found = []
    for root, _, files in os.walk(folder):
        for name in files:
            path = Path(root, name)
            try:
                st = path.stat()
            except OSError:
                continue  # removed while we looked: the next poll sees the new state
            found.append((str(path.relative_to(folder)), st.st_size, st.st_mtime_ns))
    return tuple(sorted(found))


def torn(folder: Path) -> list[str]:
    """Files under ``folder`` that are zip archives cut short: ``torch.save``'s format (a zip)
    written in place by a process that was stopped, or is still writing, before the archive's
    closing directory. Other formats cannot be told whole or torn, and are taken as they are."""
    cut = []
    for root, _, files in os.walk(folder):
        for name in files:
            path = Path(root, name)
            try:
                with open(path, "rb") as f:
                    head = f.read(4)
            except OSError:
                continue
            if head == b"PK\x03\x04" and not zipfile.is_zipfile(path):
                cut.append(str(path.relative_to(folder)))
    return cut


class ScriptCheckpoints:
    """Watches ``folder`` and keeps the newest ``keep`` copies of it under ``store``.

    Calling rules: ``start()`` once before the first launch (what the folder holds then came
    from before this run and is not copied); ``poll(now, step)`` every tick with a monotonic
    ``now`` and the newest printed step; ``settle(step)`` then ``restore(before, aside)`` just
    before a relaunch, once the workers are stopped.
    """

    def __init__(self, folder: Path, store: Path, keep: int) -> None:
        self.folder = folder
        self.store = store
        self.keep = keep
        self._seen: Fingerprint = ()
        self._changing: tuple[Fingerprint, int] | None = None
        self._next_poll = 0.0

    def start(self) -> None:
        self._seen = fingerprint(self.folder)

    def snapshots(self) -> list[Snapshot]:
        """The copies kept, oldest first."""
        found = []
        if self.store.is_dir():
            for path in self.store.iterdir():
                m = _NAME.match(path.name)
                if m and path.is_dir():
                    found.append(Snapshot(int(m.group(1)), path))
        return sorted(found, key=lambda s: s.step)

    def poll(self, now: float, step: int) -> Snapshot | None:
        """A new copy, when the folder changed and held still since the last poll."""
        if now < self._next_poll:
            return None
        self._next_poll = now + POLL_S
        current = fingerprint(self.folder)
        if not current or current == self._seen:
            self._changing = None
            return None
        if self._changing is None or self._changing[0] != current:
            # Named by this sighting: what the folder holds once still was written after it.
            self._changing = (current, step)
            return None
        if torn(self.folder):  # a writer paused mid-file (or died there): not a checkpoint yet
            return None
        return self._copy(current, self._changing[1])

    def _copy(self, current: Fingerprint, step: int) -> Snapshot:
        """Copy the folder, whose fingerprint is ``current``, as step ``step``'s; it is seen."""
        self._changing, self._seen = None, current
        target = self.store / f"step-{step}"
        if target.exists():  # saved twice at the same printed step: the newer one wins
            shutil.rmtree(target)
        partial = self.store / f".partial-step-{step}"
        shutil.rmtree(partial, ignore_errors=True)
        shutil.copytree(self.folder, partial)
        partial.rename(target)
        for old in self.snapshots()[:-self.keep]:
            shutil.rmtree(old.path, ignore_errors=True)
        return Snapshot(step, target)

    def settle(self, step: int) -> Snapshot | None:
        """The workers are stopped, so nothing writes the folder any more: a change no poll has
        copied yet (a save seen once, or made since the last look) is copied now, under the
        step of its last sighting if it has not changed since, else ``step`` (the newest printed:
        never earlier than the save, so a rollback never takes it for older than it is)."""
        current = fingerprint(self.folder)
        if not current or current == self._seen or torn(self.folder):
            return None  # nothing new, or a save the stopped writer never finished
        changing = self._changing
        return self._copy(current, changing[1] if changing is not None and changing[0] == current
                          else step)

    def restore(self, before: int | None, aside: Path) -> Snapshot | None:
        """Put back the newest copy from strictly before step ``before`` (None: the newest
        copy); the folder's current files move to ``aside``. None when no copy qualifies (the
        folder is left as it is)."""
        usable = [s for s in self.snapshots() if before is None or s.step < before]
        if not usable:
            return None
        chosen = usable[-1]
        if self.folder.exists():
            aside.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(self.folder), str(aside))
        shutil.copytree(chosen.path, self.folder)
        self._seen, self._changing = fingerprint(self.folder), None
        return chosen
