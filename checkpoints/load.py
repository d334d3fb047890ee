"""Loading a checkpoint into the training processes (worker side; torch is imported lazily)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from babysit.checkpoints import just_in_time, mark
from babysit.checkpoints.errors import CheckpointError
from babysit.checkpoints.layout import rank_state_name
from babysit.checkpoints.manifest import KIND_DCP, read_manifest
from babysit.checkpoints.rng import restore_rng
from babysit.checkpoints.save import rank_and_world
from babysit.checkpoints.tiers import tier_of


@dataclass(frozen=True, slots=True)
class Restored:
    """What ``load`` restored besides the objects it was given.

    ``step``: optimizer steps taken when saved (resume at ``step + 1``); ``cursor``: global
    batches consumed (fast-forward the data to it); ``lr_scale``: the LR multiplier saved;
    ``extra``: this rank's own ``extra`` dict as passed to ``save``; ``samples``: the samples of
    the data stream consumed at ``cursor`` (None: the loader did not count them).
    """

    step: int
    cursor: int
    lr_scale: float
    path: Path
    extra: dict[str, Any] = field(default_factory=dict)
    samples: int | None = None


def load(path: str | Path, model: Any, optimizer: Any = None, scheduler: Any = None, *,
         reshard: bool = False, memory: str | Path | None = None,
         checked: bool = False) -> Restored:
    """Restore a checkpoint saved by ``save``; collective.

    Calling rules: every rank calls it with the same ``path`` (a step directory), after building
    the model (wrapped or not), optimizer and scheduler exactly as for a fresh start. It
    restores them in place and this rank's RNG streams last, so the next random draw is the one
    the saving run made next. Sizes are checked against the manifest (cheap); the supervisor does
    the full checksum verification before choosing a checkpoint. Raises ``CheckpointError`` for a
    missing or uncommitted checkpoint, another world size, or a key the checkpoint lacks.

    ``reshard`` accepts another world size (an elastic job relaunched on fewer or more nodes):
    DCP reshards the model and optimizer state; a rank the checkpoint had gets its own scheduler,
    ``extra`` and RNG streams back, a new rank gets rank 0's scheduler and ``extra`` and keeps
    its fresh RNG streams (sharing rank 0's would make two ranks draw the same dropout masks).
    The data each rank sees changes with the world size anyway, so such a resume continues the
    run without being bit-exact.

    A memory copy (``checkpoints/memory.py``): ``path`` is its step directory in the checkpoint
    root (its manifest), ``memory`` its folder in this node's shared memory; what the node
    lacks of what this rank reads is fetched from the other nodes first, and each file read is
    checked against its CRC-32 (``memory_copy.fetch``), but those already in the node's folder
    with ``checked`` (its supervisor checked them as it chose the copy).
    """
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    path = Path(path)
    rank, world = rank_and_world()
    manifest = read_manifest(path)
    if manifest.kind != KIND_DCP:
        raise CheckpointError(
            f"{path} (step {manifest.step}) is a checkpoint your own code saved and registered "
            "with register_external; babysit cannot load it. Load it with your own code from "
            f"{manifest.data_dir(path)}, then fast-forward to cursor {manifest.cursor}."
        )
    if manifest.world_size != world and not reshard:
        raise CheckpointError(
            f"{path} (step {manifest.step}) was saved by {manifest.world_size} ranks, but this "
            f"job has {world} (rank {rank} noticed). Per-rank RNG streams cannot be mapped "
            f"across world sizes: relaunch with {manifest.world_size} ranks, or start from a "
            "checkpoint saved at this world size."
        )
    data = Path(memory) if memory is not None else manifest.data_dir(path)
    tier = tier_of(manifest)
    if not tier.on_disk and memory is None:
        raise CheckpointError(
            f"{path} (step {manifest.step}) is a memory copy: its files are in the nodes' shared "
            "memory, and load needs this node's folder of it (memory=...).")
    problems = tier.verify_at_load(manifest, path)
    if problems:
        raise CheckpointError(
            f"{path} (step {manifest.step}) is damaged: {'; '.join(problems)}. Rank {rank} "
            "refused to load it; choose an older checkpoint (Catalog.choose_for_rollback does)."
        )

    if optimizer is None:
        state: dict[str, Any] = {"model": get_model_state_dict(model)}
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
    if not tier.on_disk:
        _fetch_memory(data, manifest, state, rank, checked)
    try:
        if tier.writers_layout:  # the writers' metadata, merged
            dcp_load(state, storage_reader=just_in_time.reader(data))
        else:
            dcp_load(state, checkpoint_id=str(path))
    # DCP gathers per-rank failures into a CheckpointException (a BaseException), raised on
    # every rank together, so raising ours keeps the ranks in step.
    except (Exception, CheckpointException) as e:
        raise CheckpointError(
            f"loading {path} (step {manifest.step}) on rank {rank} failed: {_first_line(e)}. "
            "The model or optimizer differs from the one saved (a renamed, added or removed "
            "parameter, or an optimizer passed now but not when saving). Build them as the "
            "saving run did, or start from a checkpoint saved with this model."
        ) from e
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )

    rank_state, own = _rank_state(data, manifest, rank)
    if scheduler is not None:
        if rank_state["scheduler"] is None:
            raise CheckpointError(
                f"{path} (step {manifest.step}) was saved without a scheduler, but rank {rank} "
                "passed one to load. Pass scheduler=None, or save with the scheduler."
            )
        scheduler.load_state_dict(rank_state["scheduler"])
    if own is not None:
        restore_rng(own)
    return Restored(
        step=manifest.step,
        cursor=manifest.cursor,
        lr_scale=manifest.lr_scale,
        path=path,
        extra=rank_state.get("extra") or {},
        samples=manifest.samples,
    )


def _fetch_memory(data: Path, manifest: Any, state: dict[str, Any], rank: int,
                  checked: bool) -> None:
    """Bring what this rank reads of a memory copy into its node's folder ``data``: the
    writers' metadata and its state file first, then the data files its part of ``state``
    lives in (``memory_copy``); collective."""
    from babysit.checkpoints import memory_copy
    from babysit.checkpoints.save import _writer_group

    group = _writer_group()
    names = {e.name for e in manifest.files}
    own = rank_state_name(rank if rank < manifest.world_size else 0)
    memory_copy.fetch(data, manifest, [*memory_copy.metadata_files(names), own], group,
                      checked=checked)
    memory_copy.fetch(data, manifest, memory_copy.needs(data, manifest, state, rank), group,
                      checked=checked)


def _rank_state(path: Path, manifest: Any, rank: int) -> tuple[dict[str, Any], Any]:
    """This rank's saved state (its scheduler and ``extra``) and the random streams to restore
    (None: keep this process's own). A rank the checkpoint had gets its own back; a new rank
    (a resize) rank 0's state and fresh streams, as sharing rank 0's would make two ranks
    draw the same dropout masks. In a just-in-time checkpoint a rank that was dead when it was
    written has its streams from its mark (``mark_<r>.bin``) and its scheduler from the lowest
    rank that wrote one; one with neither keeps fresh streams (the manifest lists it)."""
    import torch

    names = {f.name for f in manifest.files}
    source = rank if rank < manifest.world_size else 0
    if tier_of(manifest).streams_from_marks and rank_state_name(source) not in names:
        written = sorted(f.name for f in manifest.files if f.name.startswith("rank_"))
        if not written:
            raise CheckpointError(f"{path} (step {manifest.step}) holds no rank's state file")
        own = None
        if source == rank and just_in_time.mark_name(rank) in names:
            try:
                own = mark.read(path / just_in_time.mark_name(rank)).rng()
            except mark.MarkError as e:
                raise CheckpointError(f"{e} (rank {rank}, step {manifest.step})") from e
        return _load_rank_file(path / written[0], rank, manifest.step, torch), own
    state = _load_rank_file(path / rank_state_name(source), rank, manifest.step, torch)
    return state, state["rng"] if source == rank else None


def _load_rank_file(rank_file: Path, rank: int, step: int, torch: Any) -> dict[str, Any]:
    try:
        # weights_only=False: the file holds Python and numpy RNG tuples and the user's extra;
        # it was written by this job's own ranks and its CRC-32 sits in the manifest.
        state: dict[str, Any] = torch.load(rank_file, weights_only=False)
    except (OSError, RuntimeError, ValueError) as e:
        raise CheckpointError(
            f"cannot read {rank_file} (rank {rank}, step {step}): {e}. Choose an older "
            "checkpoint."
        ) from e
    return state


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    # DCP wraps per-rank failures in a long report with tracebacks; the cause is the key line.
    for line in reversed(text.splitlines()):  # the raised message comes after its source line
        if "Missing key" in line or "Unexpected key" in line or "size mismatch" in line:
            return line.strip()
    return text.splitlines()[0] if text else type(e).__name__
