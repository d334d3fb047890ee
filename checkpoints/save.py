"""Saving a checkpoint from the training processes (worker side; torch is imported lazily).

What one save writes into ``<root>/step_<step>/`` (see ``layout.py``): the model and optimizer
through ``torch.distributed.checkpoint`` (DCP, sharded: each rank writes ``__<rank>_*.distcp``,
rank 0 also ``.metadata``), one ``rank_<r>.pt`` per rank (its RNG streams, the scheduler, the
user's ``extra``), and last ``manifest.json``, which is what makes it a checkpoint.

How the manifest is committed:

- Each rank hashes the files it wrote itself (CRC-32, in parallel across ranks) into a *part*:
  its file list, or the error that stopped it. Rank 0 merges the parts, hashes what no rank
  claimed (DCP's ``.metadata``; any file a future DCP names differently, so correctness never
  depends on DCP's naming, only the parallelism does) and writes the manifest atomically.
- Sync: parts travel by ``gather_object`` to rank 0, and rank 0 broadcasts the outcome, so every
  rank returns after the commit, or every rank raises the same ``CheckpointError``.
- Async: no collective of babysit's may run outside the training thread, so parts travel as
  files. When a rank's DCP write finishes, a done-callback (the writer thread: file I/O
  only) hashes its files and writes ``.part_rank<r>.json``. Rank 0's ``SaveHandle.poll()``,
  which the training loop calls each step, commits once all parts are there and deletes them.
  Until then the checkpoint does not exist, so a crash at any point leaves only an incomplete
  directory.

Async saves work as DCP's ``async_save`` with its thread executor does: the state is copied to
host memory in the training thread, then a thread of each rank writes it with ``dcp.save``
while training goes on, its collectives in a gloo process group of their own
(``_writer_group``), as torchtitan does; the thread is babysit's and kept for the process
(``_write_in_background``), where ``async_save`` starts one per save. DCP's process executor was
the first choice and measured worse here: each attempt's first save spawned a process per rank
that imported torch again (0.3-1.3 s of stall on a 2-core machine, and its CPU slowed the steps
after it enough to stretch the hang allowance from 2 s to 4 s), and ``spawn`` re-imports the
training script, which must then keep its top level under ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

from babysit.checkpoints import lineage
from babysit.checkpoints._atomic import atomic_write_json, uncommit_and_remove
from babysit.checkpoints.errors import CheckpointError
from babysit.checkpoints.layout import part_marker_name, rank_state_name, step_dir
from babysit.checkpoints.manifest import (
    KIND_DCP,
    FileEntry,
    Manifest,
    hash_file,
    list_content_files,
    merge_entries,
    write_manifest,
)
from babysit.checkpoints.rng import capture_rng
from babysit.policies.wording import said_ranks

RANK_STATE_FORMAT = 1

# One async save at a time per process: commits must land in step order. ``save`` waits for
# this one before starting the next.
_pending: SaveHandle | None = None


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) of the default process group, or (0, 1) when there is none."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class SaveHandle:
    """A save in flight (async) or finished (sync). ``path`` is the checkpoint's directory.

    Calling rules: call ``poll()`` once per training step on every rank (it never blocks and
    issues no collective) until it returns True; call ``wait()`` before the process exits.
    ``committed`` is known on rank 0 only; other ranks are done once their part is written.
    """

    def __init__(
        self,
        path: Path,
        step: int,
        rank: int,
        world_size: int,
        meta: dict[str, Any],
        future: Future[Any] | None,
    ) -> None:
        self.path = path
        self.step = step
        self.rank = rank
        self.world_size = world_size
        self._meta = meta
        self._future = future
        self._part_written = threading.Event()
        self._own_error: str | None = None
        self._seen_parts: dict[int, dict[str, Any]] = {}
        self.committed = future is None
        self._done = future is None
        if future is None:
            self._part_written.set()

    @property
    def is_async(self) -> bool:
        return self._future is not None

    def poll(self) -> bool:
        """True once this rank has nothing left to do for this save (rank 0: it is committed).

        Raises ``CheckpointError`` if this rank's write failed, or (rank 0) any rank's did; the
        checkpoint is then not committed and the previous one remains the newest.
        """
        if self._done:
            return True
        if not self._part_written.is_set():
            return False
        if self._own_error is not None:
            self._done = True
            raise CheckpointError(_failed_msg(self.path, self.step, {self.rank: self._own_error}))
        if self.rank != 0:
            self._done = True
            return True
        # Rank 0: stat only the markers not seen yet, so a poll costs little at many ranks.
        for r in range(self.world_size):
            if r in self._seen_parts:
                continue
            marker = self.path / part_marker_name(r)
            if not marker.exists():
                return False
            import json

            self._seen_parts[r] = json.loads(marker.read_text())
        self._done = True
        commit(self.path, [self._seen_parts[r] for r in range(self.world_size)], self._meta)
        self.committed = True
        return True

    def wait(self, timeout_s: float | None = None) -> Path:
        """Block until ``poll()`` is True; return ``path``. Raises ``CheckpointError`` on failure
        or after ``timeout_s`` seconds (None: no limit)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self.poll():
            if deadline is not None and time.monotonic() > deadline:
                missing = [r for r in range(self.world_size) if r not in self._seen_parts]
                raise CheckpointError(
                    f"the async save of step {self.step} to {self.path} did not finish within "
                    f"{timeout_s} s on rank {self.rank} (waiting for ranks {missing}). Check those "
                    "ranks' logs and free disk space; the checkpoint is not committed."
                )
            time.sleep(0.01)
        return self.path

    # Runs on the writer thread when this rank's write finished: file I/O only, no collective.
    def _on_written(self, future: Future[str | None]) -> None:
        part: dict[str, Any]
        try:
            rank_state_error = future.result()
            if rank_state_error is not None:
                raise CheckpointError(rank_state_error)
            part = hash_part(self.path, self.rank)
        except BaseException as e:  # reported through the part, not lost in a thread
            self._own_error = _said(e)
            part = {"rank": self.rank, "ok": False, "error": self._own_error}
        try:
            atomic_write_json(self.path / part_marker_name(self.rank), part)
        except OSError as e:
            self._own_error = self._own_error or f"could not write the part marker: {e}"
        self._part_written.set()


def save(
    root: str | Path,
    step: int,
    cursor: int,
    lr_scale: float,
    model: Any,
    optimizer: Any = None,
    scheduler: Any = None,
    extra: dict[str, Any] | None = None,
    async_save: bool = False,
    samples: int | None = None,
    rng: dict[str, Any] | None = None,
    timeline: str | None = None,
) -> SaveHandle:
    """Save a checkpoint of the state after optimizer step ``step``; collective.

    Calling rules: every rank calls it at the same step with the same ``root``, ``step``,
    ``cursor`` (global batches consumed) and ``lr_scale``. ``model`` may be wrapped (DDP, FSDP);
    ``optimizer`` and ``scheduler`` are optional. ``extra`` is this rank's own picklable dict
    (it is stored per rank and handed back to the same rank by ``load``). Each rank's RNG streams
    are captured at the call, or are ``rng`` (``checkpoints.rng.capture_rng``'s form, taken
    earlier by the caller: at the end of step ``step``, where a loop without ``run.batches()``
    has drawn its next batch by the time every rank can save). ``samples``: the samples of the
    data stream consumed at ``cursor``, when the loader counts them (``ElasticSampler``).
    ``timeline``: the run's timeline the state belongs to (the directive's; default: the one
    recorded under ``root``, ``checkpoints/lineage.py``). Sync
    (default): returns once the checkpoint is committed on every rank. Async: returns after the
    state is staged in memory; keep training and call ``handle.poll()`` each step (see
    ``SaveHandle``). A previous async save still in flight is waited for first. An existing
    ``step_<step>`` directory (e.g. from before a rollback) is replaced.
    """
    import torch
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    global _pending
    wait_pending()
    rank, world = rank_and_world()
    path = step_dir(root, step)
    group = _writer_group() if async_save else _writer_pg
    _prepare_dir(path, rank, world, group)
    state = _dcp_state(model, optimizer)
    buf = io.BytesIO()
    torch.save(_rank_state(step, cursor, lr_scale, scheduler, extra, rank, rng), buf)
    meta = {"step": step, "cursor": cursor, "lr_scale": lr_scale, "world_size": world,
            "samples": samples,
            "timeline": timeline if timeline is not None else lineage.current(root)}

    if not async_save:
        try:
            dcp_save(state, checkpoint_id=str(path))
        # DCP gathers write errors into a CheckpointException (a BaseException) raised on every
        # rank together, so every rank raises ours here together.
        except (Exception, CheckpointException) as e:
            raise CheckpointError(
                _failed_msg(path, step, {rank: _said(e)})
            ) from e
        try:
            (path / rank_state_name(rank)).write_bytes(buf.getvalue())
            part = hash_part(path, rank)
        except OSError as e:
            part = {"rank": rank, "ok": False, "error": _said(e)}
        _commit_collectively(path, part, meta, rank, world)
        return SaveHandle(path, step, rank, world, meta, None)

    try:
        future = _write_in_background(state, path, group,
                                      (rank_state_name(rank), buf.getvalue()))
    except (Exception, CheckpointException) as e:
        raise CheckpointError(_failed_msg(path, step, {rank: _said(e)})) from e
    handle = SaveHandle(path, step, rank, world, meta, future)
    future.add_done_callback(handle._on_written)
    _pending = handle
    return handle


def _write_in_background(state: dict[str, Any], path: Path, group: Any,
                         rank_state: tuple[str, bytes]) -> Future[str | None]:
    """What ``dcp.async_save`` with its thread executor does, on one writer thread kept for the
    process: stage a host copy of ``state`` here, in the training thread (DCP's own stager, a
    fresh one per save as DCP makes it), then write the copy with ``dcp.save`` on the writer
    thread, its collectives in ``group`` (``_writer_group``). ``async_save`` starts and ends a
    thread pool for every save and logs each call twice: 1.5 of its 2.1 ms here, beside 0.6 ms
    of copy.

    The rank's own state file (``rank_state``: its name and bytes) is written on the writer
    thread too, after the DCP write (0.5 ms of file creation taken off the step; the directory
    exists: rank 0 made it before the collective every rank passed). The future's result is
    why that file could not be written, or None."""
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    stager = _stager()
    close = getattr(stager, "close", None) or (lambda: None)
    try:
        staged = stager.stage(state)
    except BaseException:
        close()
        raise

    def write() -> str | None:
        try:
            # Every rank's writer takes part in the DCP write's collectives, whatever happens
            # to its own file after.
            dcp_save(staged, checkpoint_id=str(path), process_group=group)
        finally:
            close()
        name, data = rank_state
        try:
            (path / name).write_bytes(data)
        except OSError as e:
            return f"could not write {path / name}: {e}"
        return None

    return _writer().submit(write)


def _stager() -> Any:
    """The stager ``async_save`` makes for a save: ``DefaultStager`` with every option off (a
    blocking copy into fresh host memory), or, in a torch from before it, the
    ``BlockingAsyncStager`` that torch's ``async_save`` used then (not run here: CI pins 2.13)."""
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError:
        from torch.distributed.checkpoint.staging import BlockingAsyncStager

        return BlockingAsyncStager()
    return DefaultStager(StagingOptions(False, False, False, False))


_writer_pool: ThreadPoolExecutor | None = None


def _writer() -> ThreadPoolExecutor:
    """This process's checkpoint writer thread, started at its first asynchronous save. Saves
    never overlap (``save`` waits for the one in flight), so one thread serves them in order."""
    global _writer_pool
    if _writer_pool is None:
        _writer_pool = ThreadPoolExecutor(max_workers=1,
                                          thread_name_prefix="babysit-checkpoint-writer")
    return _writer_pool


_writer_pg: Any = None


def _writer_group() -> Any:
    """The process group of the background writer's collectives and of the directory agreement
    of the saves after its first (``_prepare_dir``): gloo, and its own, so that the writer's
    never interleave with the training's in the default group (torchtitan writes its async
    checkpoints the same way), and a CPU tensor serves whatever the default group's backend.
    Created at this process's first asynchronous save, which every rank reaches at the same
    step; None without ``torch.distributed``. The training thread uses it only between saves,
    once this rank's writer is done with the one before (``save`` waits for that first)."""
    import torch.distributed as dist

    global _writer_pg
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if _writer_pg is None:
        _writer_pg = dist.new_group(backend="gloo")
    return _writer_pg


def wait_pending(timeout_s: float | None = None) -> None:
    """Wait for this process's async save in flight, if any (call before exiting). One that
    did not finish within ``timeout_s`` stays in flight: the next ``save`` waits for it before
    its own collectives (its writer may still be in the checkpoint group's)."""
    global _pending
    if _pending is not None:
        _pending.wait(timeout_s)
        _pending = None


def hash_part(path: Path, rank: int) -> dict[str, Any]:
    """The part record of ``rank``: size and CRC-32 of the files it wrote into ``path``."""
    prefix = f"__{rank}_"  # DCP's FileSystemWriter names each rank's files __<rank>_<n>.distcp
    names = [n for n in list_content_files(path) if n.startswith(prefix)]
    names.append(rank_state_name(rank))
    return {"rank": rank, "ok": True, "files": [asdict(hash_file(path, n)) for n in names]}


def commit(path: Path, parts: Sequence[dict[str, Any]], meta: dict[str, Any]) -> Manifest:
    """Rank 0: merge every rank's part, hash the unclaimed files, write the manifest atomically.

    Raises ``CheckpointError`` (and commits nothing) if any part reports a failure or a rank's
    state file is missing.
    """
    errors = {int(p["rank"]): str(p["error"]) for p in parts if not p["ok"]}
    if errors:
        raise CheckpointError(_failed_msg(path, meta["step"], errors))
    claimed = merge_entries(
        [FileEntry(str(f["name"]), int(f["size"]), int(f["crc32"])) for f in p["files"]]
        for p in parts
    )
    names = {e.name for e in claimed}
    missing = [r for r in range(meta["world_size"]) if rank_state_name(r) not in names]
    if missing:
        raise CheckpointError(_failed_msg(path, meta["step"], dict.fromkeys(missing, "no part")))
    leftovers = [hash_file(path, n) for n in list_content_files(path) if n not in names]
    manifest = Manifest(files=merge_entries([claimed, leftovers]), kind=KIND_DCP, **meta)
    write_manifest(path, manifest)
    for r in range(meta["world_size"]):
        (path / part_marker_name(r)).unlink(missing_ok=True)
    return manifest


def _commit_collectively(
    path: Path, part: dict[str, Any], meta: dict[str, Any], rank: int, world: int
) -> None:
    import torch.distributed as dist

    error: str | None = None
    if world == 1:
        parts: list[Any] = [part]
    else:
        parts = [None] * world if rank == 0 else []
        dist.gather_object(part, parts if rank == 0 else None, dst=0)
    if rank == 0:
        try:
            commit(path, parts, meta)
        except (CheckpointError, OSError) as e:
            error = str(e)
    if world > 1:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise CheckpointError(error)


def _prepare_dir(path: Path, rank: int, world: int, group: Any) -> None:
    """Rank 0 replaces any old ``path`` with an empty directory; every rank learns the outcome.

    With ``group`` (``_writer_group``, gloo: a CPU tensor whatever the training's backend) the
    outcome travels as one integer all-reduce, where ``broadcast_object_list`` pickles and
    broadcasts twice (with the writer thread below, a save's stall went from 5.1 to 3.5 ms:
    ``benchmarks/save_stall.py``); rank 0's message follows only when it failed. Without one
    (a run that only ever saved synchronously, and so needs no gloo group), the default
    group's ``broadcast_object_list`` carries it, on whatever device that group's backend
    uses."""
    error: str | None = None
    if rank == 0:
        try:
            uncommit_and_remove(path)
            path.mkdir(parents=True)
        except OSError as e:
            error = (
                f"cannot create the checkpoint directory {path} for step {path.name} "
                f"(rank 0): {e}. Point the checkpoint root at a writable directory with free space."
            )
    if world > 1:
        import torch
        import torch.distributed as dist

        box = [error]
        if group is None:
            dist.broadcast_object_list(box, src=0)
        else:
            failed = torch.tensor([int(error is not None)])
            dist.all_reduce(failed, group=group)
            if failed.item():
                dist.broadcast_object_list(box, src=0, group=group)
        error = box[0]
    if error is not None:
        raise CheckpointError(error)


def _dcp_state(model: Any, optimizer: Any) -> dict[str, Any]:
    # get_state_dict unwraps DDP/FSDP and gives optimizer state FQN keys, so a checkpoint loads
    # into the same model however it is wrapped.
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def state_bytes(model: Any, optimizer: Any) -> int:
    """This rank's bytes of model and optimizer state (a DTensor's local shard only)."""
    import torch

    def local(t: Any) -> int:
        t = getattr(t, "_local_tensor", t)
        return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0

    total = sum(local(t) for t in model.state_dict().values())
    if optimizer is not None:
        total += sum(local(t) for state in optimizer.state.values() for t in state.values())
    return total


def _rank_state(
    step: int, cursor: int, lr_scale: float, scheduler: Any, extra: Any, rank: int,
    rng: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A rank's own file: its random streams (``rng``, or captured now), the scheduler and the
    user's ``extra``."""
    return {
        "format": RANK_STATE_FORMAT,
        "rank": rank,
        "step": step,
        "cursor": cursor,
        "lr_scale": lr_scale,
        "scheduler": None if scheduler is None else scheduler.state_dict(),
        "rng": capture_rng() if rng is None else rng,
        "extra": extra,
    }


def _said(e: BaseException) -> str:
    """``e`` in one line for a person. DCP's ``CheckpointException`` gathers every rank's error,
    and its text is every rank's traceback: it is said by those errors instead, each once with
    the ranks it struck ("OSError: [Errno 28] No space left on device (on ranks 0 and 1)")."""
    failures = getattr(e, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return f"{type(e).__name__}: {e}"
    causes: dict[str, list[int]] = {}
    for rank, failure in sorted(failures.items()):
        error = failure[0] if isinstance(failure, tuple) and failure else failure
        causes.setdefault(f"{type(error).__name__}: {error}", []).append(int(rank))
    return "; ".join(f"{what} (on {said_ranks(ranks)})" for what, ranks in causes.items())


def _failed_msg(path: Path, step: int, errors: dict[int, str]) -> str:
    where = "; ".join(f"rank {r}: {msg}" for r, msg in sorted(errors.items()))
    return (
        f"saving the checkpoint of step {step} to {path} failed ({where}). It was not committed, "
        "so the previous checkpoint remains the newest. Check free space and permissions under "
        "the checkpoint root on the ranks named."
    )
