"""Just-in-time state: the last completed step, written after a fault by the ranks still alive.

When a rank hangs or dies, the others usually still hold the model and optimizer of the last
completed step: DDP, FSDP and ZeRO change them only inside ``optimizer.step()``. Written then,
a relaunch loses one step instead of everything since the last periodic checkpoint. What makes
a just-in-time checkpoint, and how it is read back:

- **Who writes.** Every live rank says what it holds (``RankView``): replicated state (DDP: one
  shard, everyone's) or its shard of sharded state (FSDP2's DTensors: its coordinate on the
  sharded mesh dimensions). ``plan`` picks the lowest consistent live rank of each shard; a
  shard with no such rank (its ranks died, or were stopped) means no just-in-time state, and
  says which. A writer also writes its own ``rank_<r>.pt`` (its random streams as they were
  when the step started, from its mark, and the scheduler); every other rank's streams, dead
  or alive, come from its mark file, which its node copies in as ``mark_<r>.bin``
  (``checkpoints.mark``).
- **No collectives.** A writer saves with ``torch.distributed.checkpoint`` in DCP's own
  uncoordinated layout (``use_collectives=False``): ``__<rank>_0.distcp`` and
  ``__<rank>.metadata``, one pair per writer, from a thread of its own while its main thread
  may sit in a collective that will never finish (``rank/keeper.py``).
- **Read back** by ``load`` like any checkpoint (``read_metadata`` below merges the writers'
  metadata into one), so DCP reshards it to whatever world size the relaunch has.
- **Committed** like any checkpoint: a manifest with every file's CRC-32, written last by the
  supervisor (``commit``), with ``origin: just_in_time``. It is pending until the resumed run
  proves it, and never a rollback target for a spike or a NaN (``catalog.py``).
- **Or in a framework's format.** A rank whose loop a framework owns (the Trainer's,
  Lightning's: ``supervisor/rank/integrations``) writes the framework's own checkpoint instead,
  from the same thread and without a collective, and says so (``Format``). The commit then makes
  it an external checkpoint, as ``register_external`` does a framework's periodic one: the
  relaunch hands its path to the framework's own resume (``Resume.external``).
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from babysit.checkpoints import lineage
from babysit.checkpoints._atomic import fsync_dir, uncommit_and_remove
from babysit.checkpoints.layout import MANIFEST_NAME, rank_state_name, step_dir
from babysit.checkpoints.manifest import (
    FORMAT_JUST_IN_TIME,
    KIND_DCP,
    KIND_EXTERNAL,
    ORIGIN_JUST_IN_TIME,
    FileEntry,
    Manifest,
    hash_file,
    list_content_files,
    write_manifest,
)

STAGING_PREFIX = ".just_in_time-"
"""A just-in-time checkpoint is written into ``<root>/.just_in_time-<step>/`` and renamed to its
step directory once committed: an asynchronous save of the same step may still be writing
there (``commit``)."""
_METADATA = re.compile(r"^__(\d+)\.metadata$")


def mark_name(rank: int) -> str:
    """A dead rank's mark, copied in by its node: its random streams at the step's start."""
    return f"mark_{rank:05d}.bin"


def staging_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"{STAGING_PREFIX}{step:08d}"


# -- who writes (pure) ---------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class RankView:
    """What one live rank says of its state (its answer to ``GET /state``)."""

    rank: int
    consistent: bool
    """Its model and optimizer are those of a completed step: no ``optimizer.step()`` in
    progress, the scheduler not stepped past it (``why`` says what is wrong otherwise)."""
    step: int
    cursor: int
    samples: int | None = None
    lr_scale: float = 1.0
    shard: int = 0
    """Which shard of the state it holds (0..shards-1); replicated state is one shard."""
    shards: int = 1
    why: str | None = None

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> RankView:
        return cls(int(obj["rank"]), bool(obj["consistent"]), int(obj["step"]),
                   int(obj["cursor"]), None if obj.get("samples") is None else int(obj["samples"]),
                   float(obj.get("lr_scale", 1.0)), int(obj.get("shard", 0)),
                   int(obj.get("shards", 1)), obj.get("why"))


@dataclass(frozen=True, slots=True)
class Plan:
    """A just-in-time checkpoint to write: of ``step`` (the data at ``cursor``)."""

    step: int
    cursor: int
    samples: int | None
    lr_scale: float
    writers: tuple[int, ...]
    """One rank per shard: it writes the model and optimizer state it holds, and its own
    ``rank_<r>.pt`` (its streams, the scheduler)."""
    marks: tuple[int, ...] = ()
    """Every other rank whose mark is of ``step``: its node copies the mark in, and the resumed
    rank takes its streams from there (and the scheduler from the lowest writer's file)."""
    streams_lost: tuple[int, ...] = ()
    """Ranks with neither (a mark torn, or its node lost): resumed with fresh random streams,
    so not bit-exact, and said so."""

    def to_json(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Plan:
        return cls(int(obj["step"]), int(obj["cursor"]),
                   None if obj.get("samples") is None else int(obj["samples"]),
                   float(obj["lr_scale"]), tuple(int(r) for r in obj["writers"]),
                   tuple(int(r) for r in obj.get("marks", ())),
                   tuple(int(r) for r in obj.get("streams_lost", ())))


@dataclass(frozen=True, slots=True)
class NoPlan:
    """Why there is no just-in-time state: the newest checkpoint is resumed instead."""

    why: str
    step: int | None = None
    nothing: bool = False
    """Nothing was there to keep (no step since the attempt began, or a checkpoint of that very
    step is saved): nothing lost either."""


def plan(world_size: int, views: Mapping[int, RankView], marks: Mapping[int, int],
         absent: Mapping[int, str]) -> Plan | NoPlan:
    """Who writes the just-in-time state of a job of ``world_size`` ranks.

    ``views``: the live ranks' answers; ``marks``: the step each readable mark file starts from
    (every rank's, live or dead, that its node could read); ``absent``: why each rank without a
    view gave none, as what the rank is ("dead", "stopped (SIGSTOP) ...", "not answering ...",
    "on a lost node": the reason follows "rank 3 is"). A shard
    needs a consistent live holder; a live rank that is not consistent (inside
    ``optimizer.step()``) only keeps its streams, from its mark."""
    consistent = {r: v for r, v in views.items() if v.consistent}
    if not consistent:
        if not views:
            return NoPlan("no rank is alive and running to write it")
        if all(v.step < 0 for v in views.values()):
            return NoPlan("no step started in this attempt", nothing=True)
        rank, view = min(views.items())
        return NoPlan(f"rank {rank}'s state is not that of a completed step ({view.why})")
    steps = {v.step for v in consistent.values()}
    if len(steps) > 1:
        return NoPlan(f"the live ranks stand at different steps ({sorted(steps)}): their "
                      "states are not of one step")
    (step,) = steps
    first = consistent[min(consistent)]
    shards = max(v.shards for v in views.values())
    holders: dict[int, int] = {}
    for rank in sorted(consistent):
        holders.setdefault(consistent[rank].shard, rank)
    missing = sorted(set(range(shards)) - set(holders))
    if missing:
        return NoPlan(_missing_why(missing, views, absent), step)
    writers = tuple(sorted(holders.values()))
    others = [r for r in range(world_size) if r not in writers]
    from_marks = tuple(r for r in others if marks.get(r) == step)
    lost = tuple(r for r in others if marks.get(r) != step)
    return Plan(step, first.cursor, first.samples, first.lr_scale, writers, from_marks, lost)


def with_marks(the_plan: Plan, names: Collection[str]) -> Plan:
    """``the_plan`` as its nodes carried it out: a rank whose mark is not among the staged files
    ``names`` (its node lost, or silent, before it copied it) resumes with fresh streams."""
    copied = tuple(r for r in the_plan.marks if mark_name(r) in names)
    lost = tuple(sorted({*the_plan.streams_lost, *(set(the_plan.marks) - set(copied))}))
    return replace(the_plan, marks=copied, streams_lost=lost)


def _missing_why(missing: list[int], views: Mapping[int, RankView],
                 absent: Mapping[int, str]) -> str:
    """Whose shard is gone, in words: the ranks that held it and why they cannot write it."""
    of = ", ".join(str(s) for s in missing[:8]) + (" ..." if len(missing) > 8 else "")
    held = [f"rank {r} is {why}" for r, why in sorted(absent.items())][:4]
    held += [f"rank {r}'s state is not of a completed step ({v.why})"
             for r, v in sorted(views.items()) if not v.consistent][:4]
    return (f"shard{'s' if len(missing) > 1 else ''} {of} of the sharded state "
            f"{'have' if len(missing) > 1 else 'has'} no live holder ({'; '.join(held)})")


# -- the rank's write (torch) --------------------------------------------------------------------

def shard_of(model: Any, rank: int) -> tuple[int, int]:
    """(which shard, how many): replicated parameters (DDP, or none distributed) are one shard;
    FSDP2's DTensors a shard per coordinate on their mesh's sharded dimensions. Parameters on
    several meshes, or sharded along different dimensions, count every rank as its own shard:
    each then writes what it holds."""
    from math import prod

    params = getattr(model, "parameters", None)
    layouts = set()
    mesh = None
    for p in params() if params is not None else ():
        placements = getattr(p, "placements", None)
        if placements is None:
            continue
        mesh = p.device_mesh
        layouts.add((id(mesh), tuple(i for i, pl in enumerate(placements) if pl.is_shard())))
    if not layouts:
        return 0, 1
    if len(layouts) > 1 or mesh is None:
        import torch.distributed as dist

        return rank, dist.get_world_size()
    (_, dims), = layouts
    coordinate = mesh.get_coordinate() or []
    sizes = [mesh.size(d) for d in dims]
    shard = 0
    for d, size in zip(dims, sizes, strict=True):
        shard = shard * size + coordinate[d]
    return shard, prod(sizes)


def write_part(dest: Path, rank: int, *, model: Any, optimizer: Any, scheduler: Any,
               rng: dict[str, Any], step: int, cursor: int, lr_scale: float,
               with_model: bool) -> list[dict[str, Any]]:
    """Write this rank's part into ``dest`` without any collective: with ``with_model`` the
    model and optimizer state it holds (DCP, uncoordinated: ``__<rank>_0.distcp`` and
    ``__<rank>.metadata``), and always its ``rank_<r>.pt`` with ``rng`` (its streams as the
    step started). Returns the files written, as manifest entries."""
    import io

    import torch
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    from babysit.checkpoints.save import _dcp_state, _rank_state

    dest.mkdir(parents=True, exist_ok=True)
    names = [rank_state_name(rank)]
    if with_model:
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp_save(_dcp_state(model, optimizer), storage_writer=_writer(dest, rank),
                     no_dist=True, use_collectives=False)
        names += [n for n in list_content_files(dest)
                  if n.startswith(f"__{rank}_") or n == f"__{rank}.metadata"]
    buf = io.BytesIO()
    torch.save(_rank_state(step, cursor, lr_scale, scheduler, None, rank, rng), buf)
    tmp = dest / f".{rank_state_name(rank)}.tmp"
    tmp.write_bytes(buf.getvalue())
    os.replace(tmp, dest / rank_state_name(rank))
    return [asdict(hash_file(dest, n)) for n in names]


def _writer(path: Path, rank: int) -> Any:
    """DCP's file writer in its uncoordinated layout under this rank's number: ``save`` with
    ``no_dist`` would name every writer rank 0, and without it DCP ends with a barrier."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    class RankedWriter(FileSystemWriter):
        def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
            super().set_up_storage_writer(is_coordinator, rank=rank, use_collectives=False)

    return RankedWriter(path, single_file_per_rank=True, sync_files=True, thread_count=1)


def reader(path: Path) -> Any:
    """A DCP reader of a just-in-time checkpoint: every writer's metadata merged into one, so
    the collective load reads (and reshards) it as if one coordinated save had written it."""
    import pickle

    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

    class MergingReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            parts = sorted((int(m.group(1)), name) for name in os.listdir(path)
                           if (m := _METADATA.match(name)))
            merged: Metadata | None = None
            for _, name in parts:
                with open(path / name, "rb") as f:
                    part = pickle.load(f)
                if merged is None:
                    merged = part
                    merged.storage_data = dict(part.storage_data)
                    merged.planner_data = dict(part.planner_data or {})
                    continue
                for key, meta in part.state_dict_metadata.items():
                    have = merged.state_dict_metadata.get(key)
                    if have is None:
                        merged.state_dict_metadata[key] = meta
                    elif isinstance(have, TensorStorageMetadata):
                        seen = {(tuple(c.offsets), tuple(c.sizes)) for c in have.chunks}
                        have.chunks += [c for c in meta.chunks
                                        if (tuple(c.offsets), tuple(c.sizes)) not in seen]
                for index, info in part.storage_data.items():
                    merged.storage_data.setdefault(index, info)
                merged.planner_data.update(part.planner_data or {})
            if merged is None:
                raise FileNotFoundError(f"{path} holds no writer's metadata (__<rank>.metadata)")
            meta = getattr(merged, "storage_meta", None) or StorageMeta()
            meta.load_id = self.load_id
            merged.storage_meta = meta
            return merged

    return MergingReader(path)


# -- the supervisor's commit (torch-free) --------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Format:
    """A writer's part in a framework's own checkpoint format rather than babysit's (DCP and
    ``rank_<r>.pt``), as the writer's answer says: ``name`` the format (``"transformers"``,
    ``"lightning"``), ``resume`` what that framework resumes from: the checkpoint folder itself
    (``"."``, as the Trainer's ``resume_from_checkpoint`` takes it) or a file directly in it
    (as Lightning's ``ckpt_path``), so that every file, the marks its node copied too, is
    named from the folder."""

    name: str
    resume: str

    def to_json(self) -> dict[str, str]:
        return {"name": self.name, "resume": self.resume}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Format:
        resume = str(obj["resume"])
        if len(Path(resume).parts) > 1 or resume in ("..", "/"):
            raise ValueError(f"a format resumes from its folder or a file in it, not {resume!r}")
        return cls(str(obj["name"]), resume)


def commit(root: str | Path, the_plan: Plan, files: list[FileEntry], world_size: int,
           fault: str, form: Format | None = None) -> Path:
    """Commit the staged just-in-time checkpoint of ``the_plan`` under ``root``: ``files`` are
    every staged file's entry (the writers' parts and the marks copied, each hashed by the node
    that put it there), the manifest is written (the checkpoint now exists, atomically), and
    the folder renamed to its step directory, replacing an uncommitted one of the same step (an
    asynchronous save of that step the fault interrupted). Returns the step directory.

    ``form``: the writers wrote a framework's format; the checkpoint is then an external one
    whose ``external_path`` is what the framework resumes from, in the step directory."""
    staging = staging_dir(root, the_plan.step)
    entries = list(files)
    names = {e.name for e in entries}
    leftovers = [n for n in list_content_files(staging) if n not in names]
    for name in leftovers:  # a writer's files that no answer listed (it timed out): not ours
        (staging / name).unlink(missing_ok=True)
    final = step_dir(root, the_plan.step)
    story: dict[str, Any] = {"fault": fault, **the_plan.to_json()}
    if form is not None:
        story["format"] = form.name
    manifest = Manifest(the_plan.step, the_plan.cursor, the_plan.lr_scale, world_size,
                        tuple(sorted(entries, key=lambda e: e.name)),
                        kind=KIND_DCP if form is None else KIND_EXTERNAL,
                        external_path=None if form is None else
                        os.path.normpath(final.absolute() / form.resume),
                        external_is_file=form is not None and (staging / form.resume).is_file(),
                        samples=the_plan.samples, origin=ORIGIN_JUST_IN_TIME,
                        format_version=FORMAT_JUST_IN_TIME, just_in_time=story,
                        timeline=lineage.current(root))
    write_manifest(staging, manifest)
    if final.exists():
        uncommit_and_remove(final)
    os.rename(staging, final)
    fsync_dir(Path(root))
    return final


def discard(root: str | Path) -> list[Path]:
    """Remove staging folders a fault left behind (none is ever resumed from)."""
    import shutil

    gone = []
    try:
        names = os.listdir(root)
    except OSError:
        return []
    for name in names:
        if name.startswith(STAGING_PREFIX):
            shutil.rmtree(Path(root) / name, ignore_errors=True)
            gone.append(Path(root) / name)
    return gone


def is_committed(path: Path) -> bool:
    return (path / MANIFEST_NAME).exists()
