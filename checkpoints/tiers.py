"""Where each kind of kept state lives, and what follows from it: one interface.

babysit keeps a run's state in three places, and every question the catalog, the supervisor's
recovery and a rank's load ask of a state is answered here, by its **tier** (``tier_of``), never
by branching on its origin:

- ``ON_DISK``, origin ``periodic`` (the cadence, a final checkpoint, a framework's or the
  script's own registered save): its files in the checkpoint folder; a rollback target;
  retained in the disk pool.
- ``JUST_IN_TIME``, origin ``just_in_time`` (the last completed step, written by the live ranks
  after a fault): its files in the checkpoint folder, in the writers' layout; a relaunch's
  target only; the disk pool.
- ``IN_MEMORY``, origin ``memory`` (every K steps, in each node's shared memory and its peer's):
  its files in the nodes' shared memory, only its manifest on disk; a rollback target; the
  memory pool.

Each answers:

- **how it is read**: ``writers_layout`` (each writer's DCP metadata, merged at load),
  ``on_disk``, ``streams_from_marks`` (a rank dead when it was written: its random streams
  from its mark), ``verify`` (the supervisor's check before it is chosen), ``verify_at_load`` (a
  rank's check as it loads), ``unavailable`` (out of reach now: no live node holds a file);
- **whether it can be a rollback target**: ``relaunch_only`` (a relaunch may resume from it, a
  rollback for the weights' or the machine's fault never: just-in-time state is the moment of
  the fault, not a state proven good);
- **how it is retained**: ``pool`` (retention keeps the newest few of each pool apart, so memory
  copies never push a checkpoint on disk out), ``lasting`` (a checkpoint the run saved on its
  cadence: what "the newest checkpoint" means in a resume's summary).

Torch-free (the supervisor uses it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from babysit.checkpoints.manifest import (
    ORIGIN_JUST_IN_TIME,
    ORIGIN_MEMORY,
    ORIGIN_PERIODIC,
    Manifest,
    verify_manifest,
)
from babysit.checkpoints.memory import Place, copy_dir, missing

DISK, MEMORY = "disk", "memory"
"""Retention's pools."""


@dataclass(frozen=True, slots=True)
class Tier:
    """Where one kind of state lives (see the module docstring). The base is a checkpoint on
    disk, checked against its manifest."""

    origin: str
    said: str
    """What it is called in a sentence: "checkpoint", "just-in-time state", "memory copy"."""
    on_disk: bool = True
    writers_layout: bool = False
    relaunch_only: bool = False
    pool: str = DISK
    lasting: bool = True
    streams_from_marks: bool = False
    """A rank dead when it was written has its random streams from its mark file."""

    def unavailable(self, manifest: Manifest, place: Place | None) -> str | None:
        """Why it cannot be loaded now (None: it can)."""
        return None

    def verify(self, manifest: Manifest, path: Path, place: Place | None,
               full: bool = True) -> list[str]:
        """The supervisor's check of its files before choosing it (empty: all good)."""
        return verify_manifest(manifest, path, full=full)

    def verify_at_load(self, manifest: Manifest, path: Path) -> list[str]:
        """A rank's quick check as it loads (sizes; the CRCs were checked at the choice)."""
        return verify_manifest(manifest, path, full=False)


@dataclass(frozen=True, slots=True)
class InMemory(Tier):
    """A memory copy: the files in the nodes' shared memory (``checkpoints/memory.py``)."""

    def unavailable(self, manifest: Manifest, place: Place | None) -> str | None:
        """No live node holds one of its files, or the run keeps no memory copies here."""
        if place is None:
            return "this run keeps no memory copies"
        gone = missing(manifest, place.live())
        if gone:
            return (f"no live node holds {', '.join(gone[:3])}{' ...' if len(gone) > 3 else ''} "
                    f"(their node and its peer are gone)")
        return None

    def verify(self, manifest: Manifest, path: Path, place: Place | None,
               full: bool = True) -> list[str]:
        """The files this node holds, byte for byte (the other nodes' are checked by their
        ranks as they load, or fetch)."""
        if place is None:
            return ["this run keeps no memory copies"]
        held = (manifest.memory or {}).get("holders", {})
        mine = [e for e in manifest.files if place.node in held.get(e.name, ())]
        local = dataclasses.replace(manifest, files=tuple(mine), external_path=None)
        return verify_manifest(local, copy_dir(place.folder, manifest.step, manifest.timeline),
                               full=full)

    def verify_at_load(self, manifest: Manifest, path: Path) -> list[str]:
        return []  # what a rank reads is checked against its CRC as it is fetched or read


ON_DISK = Tier(ORIGIN_PERIODIC, "checkpoint")
JUST_IN_TIME = Tier(ORIGIN_JUST_IN_TIME, "just-in-time state", writers_layout=True,
                    relaunch_only=True, lasting=False, streams_from_marks=True)
IN_MEMORY = InMemory(ORIGIN_MEMORY, "memory copy", on_disk=False, writers_layout=True,
                     pool=MEMORY, lasting=False)
TIERS = {t.origin: t for t in (ON_DISK, JUST_IN_TIME, IN_MEMORY)}


def tier_of(manifest: Manifest) -> Tier:
    """Where the state ``manifest`` describes lives (an origin this babysit does not know:
    a checkpoint on disk, checked against its manifest)."""
    return TIERS.get(manifest.origin, ON_DISK)
