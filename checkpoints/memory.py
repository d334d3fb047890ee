"""Memory copies: the state of every K-th step in node-local shared memory, and on a peer node.

A rank that dies, or a node that is lost, takes with it the only copy of its shard under
FSDP2's full sharding: nothing alive can write the last step (``checkpoints/just_in_time.py``).
So every ``checkpoints.memory_every_steps`` steps each rank also copies its state into its
node's shared memory (``/dev/shm``), which outlives the process, and sends the copy to a rank
on the next node, which keeps it in *its* node's shared memory, so that no single node's loss
takes both. A relaunch then loses the steps since that copy, not since the last checkpoint on
disk. What a copy is, and how it is trusted:

- **The layout** is just-in-time state's: each rank writes what it holds in DCP's uncoordinated
  layout (``__<rank>_0.distcp``, ``__<rank>.metadata``; only the lowest rank holding each shard
  writes it: under DDP rank 0 alone) and its ``rank_<r>.pt`` (its random streams, the
  scheduler, the cursor), into ``<node folder>/memory/step_<step>/``. Read back by ``load``
  like a just-in-time checkpoint (the writers' metadata merged), resharded where the world
  size changed.
- **Replicas** (``peers``): rank ``r`` sends its files to rank ``r + local world size`` (the same
  local rank on the next node, round the ring), over a gloo group of its own, from a thread;
  one node's copies are then also on the next node.
- **Committed** by the supervisor once every rank reported its part (``commit``): a manifest in
  the checkpoint root, ``step_<step>/manifest.json`` like any checkpoint's, of origin
  ``memory``, listing every file with its CRC-32 and the nodes that hold it. Pending until the
  resumed run proves it, refused when a file's CRC does not match (the next older checkpoint is
  taken, in memory or on disk), and chosen only when it is the newest checkpoint: a newer one
  on disk wins.
- **Loaded** by each rank from its own node's folder; what its node lacks (a lost node's shards,
  now held by their peer) is sent to it first over the same kind of gloo group
  (``checkpoints/memory_copy.py``).

This module is torch-free (the supervisor's side); the ranks' side is ``memory_copy.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from babysit.checkpoints._atomic import uncommit_and_remove
from babysit.checkpoints.layout import parse_step_dir, step_dir
from babysit.checkpoints.manifest import (
    FORMAT_MEMORY,
    KIND_DCP,
    ORIGIN_MEMORY,
    FileEntry,
    Manifest,
    merge_entries,
    write_manifest,
)

MEMORY_DIR = "memory"
"""The memory copies' folder inside a node's folder in shared memory."""
KEEP = 3
"""How many memory copies a node keeps: the newest two committed and one being written."""


def copy_dir(node_root: str | Path, step: int, timeline: str | None = None) -> Path:
    """Where a node keeps the memory copy of ``step`` made in ``timeline`` (``node_root``: the
    node's folder): a folder of its own, never one that another timeline's copy of the same
    step used (DCP's reader would merge the metadata of both)."""
    folder = step_dir(Path(node_root) / MEMORY_DIR, step)
    return folder if timeline is None else folder.with_name(f"{folder.name}.{timeline}")


def parse_copy_dir(name: str) -> tuple[int, str | None] | None:
    """The step and timeline of a copy's folder name (``copy_dir``), or None for another."""
    base, _, timeline = name.partition(".")
    step = parse_step_dir(base)
    return None if step is None else (step, timeline or None)


def on_node(node_root: str | Path, committed: str | Path) -> Path:
    """A committed copy's folder (its manifest's ``external_path``, on the committing node) as
    this node keeps it, under its own ``node_root``."""
    return Path(node_root) / MEMORY_DIR / Path(committed).name


@dataclass(frozen=True, slots=True)
class Peers:
    """Whom a rank sends its copy to, and whose copy it keeps (None: a job of one node)."""

    send_to: int | None
    keep_for: int | None


def peers(rank: int, world_size: int, local_world_size: int) -> Peers:
    """The same local rank on the next node (round the ring) takes ``rank``'s copy; ``rank``
    keeps the previous node's. torchrun numbers each node's ranks contiguously, so the next
    node's is ``local_world_size`` away."""
    if local_world_size <= 0 or world_size <= local_world_size:
        return Peers(None, None)
    return Peers((rank + local_world_size) % world_size, (rank - local_world_size) % world_size)


@dataclass(frozen=True, slots=True)
class Part:
    """What one rank reported of a copy (its ``memory_copy`` event)."""

    rank: int
    node: int
    files: tuple[FileEntry, ...]
    """The files it wrote (hashed as written)."""
    kept_for: int | None = None
    """The rank whose copy it received and keeps, on its own node."""
    kept: tuple[FileEntry, ...] = ()
    """That rank's files, as received (hashed here)."""
    cursor: int = 0
    lr_scale: float = 1.0
    samples: int | None = None
    stall_s: float = 0.0
    """What the copy held the rank's training thread (the copy into host memory)."""
    write_s: float = 0.0
    """The copy's whole write, replica included, on its thread."""
    timeline: str | None = None
    """The timeline the copy was made in (the rank's directive's)."""

    @classmethod
    def from_event(cls, rank: int, data: Mapping[str, Any]) -> Part:
        def entries(raw: Iterable[Mapping[str, Any]]) -> tuple[FileEntry, ...]:
            return tuple(FileEntry(str(f["name"]), int(f["size"]), int(f["crc32"])) for f in raw)

        kept_for = data.get("kept_for")
        return cls(rank, int(data.get("node", 0)), entries(data.get("files", ())),
                   None if kept_for is None else int(kept_for), entries(data.get("kept", ())),
                   int(data.get("cursor", 0)), float(data.get("lr_scale", 1.0)),
                   None if data.get("samples") is None else int(data["samples"]),
                   float(data.get("stall_s", 0.0)), float(data.get("write_s", 0.0)),
                   None if data.get("timeline") is None else str(data["timeline"]))


def holders(parts: Mapping[int, Part]) -> dict[str, list[int]]:
    """Which nodes hold each file of a copy: its writer's, and the node of the rank that keeps
    its replica."""
    held: dict[str, set[int]] = {}
    for part in parts.values():
        for entry in part.files:
            held.setdefault(entry.name, set()).add(part.node)
        for entry in part.kept:  # the replica of another rank's, on this rank's node
            held.setdefault(entry.name, set()).add(part.node)
    return {name: sorted(nodes) for name, nodes in sorted(held.items())}


def missing(manifest: Manifest, live: Collection[int]) -> list[str]:
    """The files of a memory copy that no live node holds (empty: it can be loaded)."""
    held = (manifest.memory or {}).get("holders", {})
    return [e.name for e in manifest.files if not set(held.get(e.name, ())) & set(live)]


@dataclass(frozen=True, slots=True)
class Place:
    """Where the supervisor stands among the nodes' memory: its node, its node's folder, and
    which nodes are alive now (a lost node's copies are gone with it)."""

    node: int
    folder: Path
    live: Callable[[], Collection[int]]


def commit(root: str | Path, step: int, parts: Mapping[int, Part], world_size: int,
           node_folder: str | Path) -> Manifest:
    """The supervisor's commit of the memory copy of ``step`` once every rank's ``parts`` are
    in: a manifest in ``<root>/step_<step>/`` (only the manifest: the files are in the nodes'
    shared memory, ``node_folder`` being the committing node's), replacing an uncommitted
    folder of that step."""
    first = parts[min(parts)]
    files = merge_entries(part.files for part in parts.values())
    manifest = Manifest(
        step, first.cursor, first.lr_scale, world_size, files, kind=KIND_DCP,
        samples=first.samples, origin=ORIGIN_MEMORY, format_version=FORMAT_MEMORY,
        external_path=str(copy_dir(node_folder, step, first.timeline)), owned=False,
        timeline=first.timeline,
        memory={"holders": holders(parts),
                "nodes": sorted({p.node for p in parts.values()}),
                "stall_s": round(max(p.stall_s for p in parts.values()), 6),
                "write_s": round(max(p.write_s for p in parts.values()), 6)})
    target = step_dir(root, step)
    uncommit_and_remove(target)
    target.mkdir(parents=True, exist_ok=True)
    write_manifest(target, manifest)
    return manifest


def event_fields(files: Iterable[FileEntry], kept_for: int | None,
                 kept: Iterable[FileEntry]) -> dict[str, Any]:
    """A rank's ``memory_copy`` event's file fields (``Part.from_event`` reads them back)."""
    return {"files": [asdict(f) for f in files], "kept_for": kept_for,
            "kept": [asdict(f) for f in kept]}
