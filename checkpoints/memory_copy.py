"""The ranks' side of memory copies (``checkpoints/memory.py``): copy, replicate, fetch.

Worker side; torch is imported inside the functions. Two things happen here:

- ``Copier.copy`` (the training thread, at a step boundary every K steps) stages a host copy of
  the state the rank writes, DCP's own stager as an asynchronous save's, and returns: that copy
  is all the training thread pays. A thread of the rank's then writes it into its node's shared
  memory in the uncoordinated layout of just-in-time state, sends the files to its peer on the
  next node and keeps the previous node's, all over a gloo group of the copier's own, hashes
  everything, tells its supervisor (``memory_copy``) and drops copies older than the last few.
  A copy still being written when the next is due is not waited for: the next is skipped and
  counted.
- ``fetch`` (every rank together, at ``attach()``, before a memory copy is loaded) brings into
  each node's folder what its ranks' load will read and the node lacks (a lost node's shards,
  kept by their peer): every rank says what its node holds and what it needs, the same list of
  transfers follows on every rank, and each is one gloo send and receive.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
import time
from collections.abc import Callable, Collection, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from babysit.checkpoints import just_in_time, lineage
from babysit.checkpoints.errors import CheckpointError
from babysit.checkpoints.layout import rank_state_name
from babysit.checkpoints.manifest import FileEntry, Manifest, hash_file, list_content_files
from babysit.checkpoints.memory import (
    KEEP,
    MEMORY_DIR,
    copy_dir,
    event_fields,
    parse_copy_dir,
    peers,
)

Emit = Callable[..., None]
AUTO_FIRST = 10
"""With ``memory_every_steps: auto``, the first copy's step: its measured stall is what the
supervisor's cost model chooses the interval from."""
_CHUNK = 1 << 30
"""A file goes over gloo in pieces of at most 1 GiB (views of one tensor, no copies): gloo's
sizes stay well inside 32 bits."""


class Copier:
    """One rank's memory copies. Calling rules: ``copy`` on every rank at the same steps (a
    step boundary, the training thread), ``close`` at the run's clean end."""

    def __init__(self, node_root: Path, *, rank: int, world_size: int, local_world_size: int,
                 node: int, every: int | str, model: Any, optimizer: Any, scheduler: Any,
                 emit: Emit, chain: lineage.Chain = ()) -> None:
        """``every``: the steps between copies, or "auto" (``AUTO_FIRST`` until the supervisor
        asks for the interval its cost model chose, ``set_every``). ``chain``: the attempt's
        timeline and its links back to the run's root (the directive's ``lineage``): the
        copies are made in the first, and a copy off the chain, abandoned by a rollback, is
        swept from the node now."""
        self.root = Path(node_root)
        self.rank, self.world_size, self.node = rank, world_size, node
        self.auto = every == "auto"
        self.every = AUTO_FIRST if self.auto else int(every)
        self._local_world_size = local_world_size
        self._from_step = 0
        self._asked: int | None = None
        """An interval the supervisor asked for, not yet agreed by every rank."""
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.peers = peers(rank, world_size, local_world_size)
        self._emit = emit
        self._writes_model: bool | None = None
        """This rank writes the state it holds: the lowest rank holding its shard (decided
        with the others at the first copy)."""
        self.chain = chain
        self.timeline = chain[0][0] if chain else None
        self._group: Any = None
        self._agree: Any = None
        """A gloo group of the training threads' own: the ranks agree on each copy in it (the
        copier's group is the writing threads')."""
        self._pool: ThreadPoolExecutor | None = None
        self._future: Future[None] | None = None
        self.skipped = 0
        """Copies not made because the one before was still being written on some rank."""
        _prune(self.root / MEMORY_DIR, None, chain=chain)

    def due(self, step: int) -> bool:
        """A copy is due after ``step`` (at the first one, the copies may turn out off)."""
        return self.every > 0 and step > self._from_step and step % self.every == 0

    def set_every(self, every: int, from_step: int) -> None:
        """The supervisor's interval (``memory_every_steps: auto``); ignored once the copies
        are off. The ranks read it at different steps, so none applies it alone: it takes
        effect after the first copy at which every rank has it (``_agreed``), counted from
        that copy's step (``from_step``, the supervisor's guess, is not waited for)."""
        if self.every > 0 and every > 0:
            self._asked = every

    def copy(self, step: int, cursor: int, lr_scale: float, samples: int | None,
             rng: dict[str, Any] | None = None) -> None:
        """The copy of the state after ``step`` (the data at ``cursor``; ``rng``: the random
        streams the next step starts from, by default this process's now)."""
        import torch

        from babysit.checkpoints.save import _dcp_state, _rank_state

        if self._writes_model is None:  # not what a copy costs: once, at the first
            self._set_up()
            if self.every == 0:
                return
            self._agree = _group_of_all()
        if not self._agreed(step, self._future is None or self._future.done()):
            return
        started = time.perf_counter()
        staged, close = None, None
        if self._writes_model:
            staged, close = _stage(_dcp_state(self.model, self.optimizer))
        buf = io.BytesIO()
        torch.save(_rank_state(step, cursor, lr_scale, self.scheduler, None, self.rank, rng), buf)
        stall = time.perf_counter() - started
        assert self._pool is not None
        self._future = self._pool.submit(self._write, step, staged, close, buf.getvalue(),
                                         {"cursor": cursor, "lr_scale": lr_scale,
                                          "samples": samples, "stall_s": round(stall, 6)},
                                         started)

    def close(self) -> None:
        """Wait for the copy being written (its peer waits for it too); idempotent."""
        if self._future is not None:
            self._future.result()
            self._future = None

    def _set_up(self) -> None:
        """At the first copy, every rank alike: with ``every`` "auto", whether any shard has a
        single holder (else the just-in-time state already covers a lost rank, and the copies
        are off: every rank sees it in its own model, no collective, no group made); then,
        together, the copier's gloo group, which ranks write the state they hold (one per
        shard: under DDP rank 0 alone), and whether each node's copies (``KEEP`` copies of its
        writers' state and of those it keeps a replica of) fit the room its node leaves them
        (``capacity``: /dev/shm's free space, half what the cgroup's memory limit and the
        host's memory leave). Off for any reason on any rank: off on every rank, said once by
        rank 0, with what to change."""
        import torch.distributed as dist

        from babysit.checkpoints import capacity
        from babysit.checkpoints.save import state_bytes

        shard, shards = just_in_time.shard_of(self.model, self.rank)
        if self.auto and shards < self.world_size:
            self._off("every shard of the state has live replicas (DDP)" if shards == 1 else
                      "every shard of the state has several holders", bytes_=None)
            return
        mine = (shard, self.node, state_bytes(self.model, self.optimizer),
                capacity.room(self.root, capacity.held_bytes(self.root / MEMORY_DIR)))
        if dist.is_available() and dist.is_initialized():
            self._group = dist.new_group(backend="gloo")
            everyone: list[Any] = [None] * self.world_size
            dist.all_gather_object(everyone, mine, group=self._group)
        else:
            everyone = [mine]
        holders = [e[0] for e in everyone]
        self._writes_model = holders.index(shard) == self.rank
        writers = [r for r, s in enumerate(holders) if holders.index(s) == r]
        need: dict[int, int] = {}
        for r in writers:
            need[everyone[r][1]] = need.get(everyone[r][1], 0) + KEEP * everyone[r][2]
            peer = peers(r, self.world_size, self._local_world_size).send_to
            if peer is not None:
                need[everyone[peer][1]] = need.get(everyone[peer][1], 0) + KEEP * everyone[r][2]
        room = {e[1]: e[3] for e in everyone}
        short = [why for n, b in sorted(need.items())
                 if (why := capacity.shortfall(b, room[n], n, KEEP)) is not None]
        if short:
            self._off(short[0], bytes_=need)
            return
        if self.rank == 0:
            self._emit("memory_copy_plan", every=self.every, auto=self.auto,
                       node_bytes={str(n): b for n, b in sorted(need.items())}, copies=KEEP)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="babysit-memory-copy")

    def _agreed(self, step: int, ready: bool) -> bool:
        """Every rank makes this copy, or none does: they agree on its step and timeline, and
        that none is still writing the one before (else every rank skips it, counted). An
        interval the supervisor asked for takes effect here once every rank has it, from
        this step on. A disagreement on the step or the timeline (which agreeing on the
        interval leaves no cause for) turns the copies off for the attempt, said once."""
        mine = (step, self.timeline, ready, self._asked)
        everyone = _all_gather(self._agree, mine, self.world_size)
        if len({e[3] for e in everyone}) == 1 and self._asked is not None:
            self.every, self._from_step, self._asked = self._asked, step, None
        if any(e[:2] != mine[:2] for e in everyone):
            self._off("the ranks disagreed on the step of a copy ("
                      + ", ".join(f"rank {r}: step {e[0]}" for r, e in enumerate(everyone))
                      + "): copies are off until the next attempt", bytes_=None)
            return False
        if all(e[2] for e in everyone):
            return True
        self.skipped += 1
        if self.rank == 0:
            busy = [r for r, e in enumerate(everyone) if not e[2]]
            self._emit("memory_copy_skipped", step=step, skipped=self.skipped, busy=busy)
        return False

    def _off(self, why: str, bytes_: dict[int, int] | None) -> None:
        """No memory copies in this attempt, and why (said once, by rank 0)."""
        self.every, self._writes_model = 0, False
        if self.rank == 0:
            if bytes_ is None and self.auto:
                why += ": the just-in-time state already keeps the step of a lost rank"
            self._emit("memory_copy_off", why=why)

    def _write(self, step: int, staged: Any, close: Any, rank_state: bytes,
               fields: dict[str, Any], started: float) -> None:
        """The copier's thread: write, replicate, hash, report, prune."""
        import warnings

        from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dest = copy_dir(self.root, step, self.timeline)
        _prune(self.root / MEMORY_DIR, KEEP, writing=step, chain=self.chain)
        try:
            dest.mkdir(parents=True, exist_ok=True)
            names = [rank_state_name(self.rank)]
            if staged is not None:
                dcp_save(staged, storage_writer=just_in_time._writer(dest, self.rank),
                         no_dist=True, use_collectives=False)
                names += [n for n in list_content_files(dest)
                          if n.startswith(f"__{self.rank}_") or n == f"__{self.rank}.metadata"]
            _write_atomically(dest / rank_state_name(self.rank), rank_state)
            files = [hash_file(dest, n) for n in names]
            kept = self._replicate(dest, files, step)
        except Exception as exc:  # a copy that failed costs that copy, never the run
            self._emit("memory_copy_failed", step=step, error=f"{type(exc).__name__}: {exc}"[:500])
            return
        finally:
            if close is not None:
                close()
        self._emit("memory_copy", step=step, node=self.node, timeline=self.timeline,
                   write_s=round(time.perf_counter() - started, 6), **fields,
                   **event_fields(files, self.peers.keep_for, kept))
        _prune(self.root / MEMORY_DIR, KEEP, chain=self.chain)

    def _replicate(self, dest: Path, files: list[FileEntry], step: int) -> list[FileEntry]:
        """Send this rank's files to its peer and keep the previous node's rank's, at once; the
        files kept, hashed as written here."""
        send_to, keep_for = self.peers.send_to, self.peers.keep_for
        if send_to is None or keep_for is None:
            return []
        return _swap(self._group, send_to, keep_for, dest, files, (step, self.timeline))


def _stage(state: dict[str, Any]) -> tuple[Any, Any]:
    """A host copy of ``state`` (a DCP state dict) and what to call once it is written: on the
    CPU a clone of each tensor (a DTensor's local shard, wrapped again as the DTensor it was),
    three to four times faster than DCP's stager on a small FSDP2 state (its per-tensor cost);
    a state on a device goes through DCP's stager, which copies it into host memory."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.utils._pytree import tree_flatten, tree_map

    from babysit.checkpoints.save import _stager

    leaves, _ = tree_flatten(state)
    if any(isinstance(t, torch.Tensor) and t.device.type != "cpu" for t in leaves):
        stager = _stager()
        return stager.stage(state), getattr(stager, "close", None)

    def one(t: Any) -> Any:
        if isinstance(t, DTensor):
            return DTensor.from_local(t._local_tensor.detach().clone(), t.device_mesh,
                                      t.placements, run_check=False, shape=t.shape,
                                      stride=t.stride())
        return t.detach().clone() if isinstance(t, torch.Tensor) else t

    return tree_map(one, state), None


def _swap(group: Any, send_to: int, receive_from: int, folder: Path,
          files: list[FileEntry], tag: tuple[int, str | None] = (0, None)) -> list[FileEntry]:
    """Send the ``files`` of ``folder`` to ``send_to`` while receiving ``receive_from``'s into
    ``folder``: first the copy's ``tag`` (its step and timeline) and the entries (name, size,
    CRC-32 as their writer hashed them), then each file, every exchange a pair of gloo
    ``isend``/``irecv`` (both directions at once: a ring of blocking sends would wait on
    itself). The bytes go from the file into one tensor and from one tensor into the file, no
    other copy. Returns the entries received, hashed here as written: what this node holds.
    A peer's copy of another step or timeline, or a file that arrived other than its writer
    hashed it, is refused (``CheckpointError``, the copy fails) once the exchange is over, so
    that no rank of the ring waits on one that left it."""
    import torch

    mine = [(f.name, f.size, f.crc32) for f in files]
    header = _tensor(pickle.dumps((tag, mine)))
    length = _pair(group, send_to, receive_from, torch.tensor([header.numel()]),
                   torch.zeros(1, dtype=torch.int64))
    their_tag, theirs = pickle.loads(_pair(group, send_to, receive_from, header,
                                           torch.empty(int(length.item()), dtype=torch.uint8))
                                     .numpy().tobytes())
    for index in range(max(len(mine), len(theirs))):
        out = _read(folder / mine[index][0]) if index < len(mine) and mine[index][1] else None
        size = int(theirs[index][1]) if index < len(theirs) else 0
        into = torch.empty(size, dtype=torch.uint8) if size else None
        for at in range(0, max(out.numel() if out is not None else 0, size), _CHUNK):
            _pair(group, send_to, receive_from,
                  out[at:at + _CHUNK] if out is not None and at < out.numel() else None,
                  into[at:at + _CHUNK] if into is not None and at < size else None)
        if index < len(theirs) and tuple(their_tag) == tag:
            _write_atomically(folder / str(theirs[index][0]), into)
    if tuple(their_tag) != tag:
        raise CheckpointError(
            f"rank {receive_from} sent its copy of step {their_tag[0]} (timeline "
            f"{their_tag[1]}) while this rank copies step {tag[0]} (timeline {tag[1]}): refused")
    held = [hash_file(folder, str(name)) for name, _size, _crc in theirs]
    for got, (name, size, crc) in zip(held, theirs, strict=True):
        if (got.size, got.crc32) != (int(size), int(crc)):
            raise CheckpointError(
                f"{name} from rank {receive_from} arrived as {got.size} bytes, CRC-32 "
                f"{got.crc32:08x}; its writer hashed {size} bytes, {int(crc):08x}: damaged on "
                "the way, refused")
    return held


def _pair(group: Any, send_to: int | None, receive_from: int | None, out: Any,
          into: Any) -> Any:
    """One ``isend`` of ``out`` and one ``irecv`` into ``into``, together (either may be
    None); ``into``."""
    import torch.distributed as dist

    ops = []
    if send_to is not None and out is not None:
        ops.append(dist.P2POp(dist.isend, out, send_to, group))
    if receive_from is not None and into is not None:
        ops.append(dist.P2POp(dist.irecv, into, receive_from, group))
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
    return into


def _tensor(data: bytes) -> Any:
    import torch

    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _read(path: Path) -> Any:
    """A file's bytes as one uint8 tensor (one copy, from the file into it)."""
    import numpy as np
    import torch

    return torch.from_numpy(np.fromfile(path, dtype=np.uint8))


def _write_atomically(path: Path, data: Any) -> None:
    """``data`` (bytes, or a uint8 tensor written straight from its memory) into ``path``,
    whole or not at all."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        if isinstance(data, bytes | bytearray):
            f.write(data)
        elif data is not None:
            data.numpy().tofile(f)
    os.replace(tmp, path)


def _prune(memory: Path, keep: int | None, writing: int | None = None,
           chain: lineage.Chain = ()) -> None:
    """Drop this node's copies off the attempt's ``chain`` (a rollback abandoned them), then
    those older than the newest ``keep`` (None: keep every live one; every rank of the node
    prunes the same ones; a copy another rank is still writing is among the newest).
    ``writing``: the step about to be written, counted among the ``keep`` before it exists, so
    that the node never holds more than ``keep`` copies (what the memory-fit check counted). A
    copy at a later step than ``writing`` goes too: the ranks copy at the same steps, in step
    order, so it is of a timeline a rollback left (one that records none, from before lineage
    was kept), and kept as "the newest" it would push out the copies of the run as it now
    goes."""
    try:
        names = os.listdir(memory)
    except OSError:
        return
    found = sorted(((*parsed, name) for name in names
                    if (parsed := parse_copy_dir(name)) is not None),
                   key=lambda copy: (copy[0], copy[2]))
    drop = [name for step, timeline, name in found if not lineage.live(chain, timeline, step)]
    live = [(step, name) for step, _timeline, name in found if name not in drop]
    if writing is not None:
        drop += [name for step, name in live if step > writing]
        live = [(step, name) for step, name in live if step < writing]
        keep = None if keep is None else keep - 1
    if keep is not None:
        drop += [name for _step, name in (live[:-keep] if keep else live)]
    for name in drop:
        shutil.rmtree(memory / name, ignore_errors=True)


def _group_of_all() -> Any:
    """A new gloo group of every rank (None without a process group)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.new_group(backend="gloo")
    return None


def _all_gather(group: Any, mine: Any, world_size: int) -> list[Any]:
    """Every rank's ``mine`` (a small picklable), in rank order (``[mine]`` alone)."""
    if group is None:
        return [mine]
    import torch.distributed as dist

    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, mine, group=group)
    return everyone


# -- loading ---------------------------------------------------------------------------------------

def fetch(data_dir: Path, manifest: Manifest, needs: Iterable[str], group: Any, *,
          checked: bool = False) -> list[str]:
    """Make every file of ``needs`` (this rank's load reads them) present in ``data_dir`` (its
    node's folder of the copy), fetching what the node lacks from a rank of a node that has it;
    collective over ``group`` (gloo). Every file this node got of ``needs``, and every one it
    had unless ``checked`` (its supervisor checked them), is checked against the manifest's
    CRC-32. Returns the names fetched. Raises ``CheckpointError`` on
    every rank alike when a needed file is on no node, and on this rank when one is corrupt."""
    import torch
    import torch.distributed as dist

    sizes = {e.name: e for e in manifest.files}
    wanted = sorted(set(needs))
    node = int(os.environ.get("GROUP_RANK", "0"))
    have = sorted(n for n in sizes if _intact_size(data_dir / n, sizes[n].size))
    distributed = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    everyone: list[Any] = [(node, have, wanted)] if not distributed else [None] * world
    if distributed:
        dist.all_gather_object(everyone, (node, have, wanted), group=group)
    transfers, lost = _transfers(everyone)
    if lost:
        raise CheckpointError(
            f"the memory copy of step {manifest.step} lacks {', '.join(lost[:4])}"
            f"{' ...' if len(lost) > 4 else ''} on every node: the node that held it and its "
            "peer are both gone. Resume from an older checkpoint.")
    fetched = []
    for source, dest, name in transfers:
        size = sizes[name].size
        if rank == source:
            data = _read(data_dir / name)
            for at in range(0, size, _CHUNK):
                dist.send(data[at:at + _CHUNK], dest, group=group)
        elif rank == dest:
            into = torch.empty(size, dtype=torch.uint8)
            for at in range(0, size, _CHUNK):
                dist.recv(into[at:at + _CHUNK], source, group=group)
            data_dir.mkdir(parents=True, exist_ok=True)
            _write_atomically(data_dir / name, into)
            fetched.append(name)
    if distributed:
        dist.barrier(group=group)  # this node's fetching rank wrote what its other ranks read
    unchecked = [n for n in wanted if n in fetched or not (checked and n in have)]
    corrupt = [f"{data_dir / n}: CRC-32 {got.crc32:08x}, the manifest says "
               f"{sizes[n].crc32:08x}" for n in unchecked
               if (got := hash_file(data_dir, n)).crc32 != sizes[n].crc32]
    if corrupt:
        raise CheckpointError(
            f"the memory copy of step {manifest.step} is corrupted ({'; '.join(corrupt[:2])}): "
            f"rank {rank} refused it. Resume from an older checkpoint.")
    return fetched


def _transfers(everyone: list[tuple[int, Collection[str], Collection[str]]]
               ) -> tuple[list[tuple[int, int, str]], list[str]]:
    """Every rank's (node, files its node holds, files it needs) -> the transfers, in the order
    every rank makes them: (from rank, to rank, file), one per file a node needs and lacks,
    from the lowest rank of a node that holds it to the lowest rank of the node that needs it;
    and the files no node holds."""
    nodes: dict[int, list[int]] = {}
    holds: dict[int, set[str]] = {}
    needs: dict[int, set[str]] = {}
    for rank, (node, have, wanted) in enumerate(everyone):
        nodes.setdefault(node, []).append(rank)
        holds.setdefault(node, set()).update(have)
        needs.setdefault(node, set()).update(wanted)
    transfers, lost = [], []
    for node in sorted(nodes):
        for name in sorted(needs[node] - holds[node]):
            source = next((min(nodes[n]) for n in sorted(nodes) if name in holds[n]), None)
            if source is None:
                lost.append(name)
            else:
                transfers.append((source, min(nodes[node]), name))
    return transfers, sorted(set(lost))


def needs(data_dir: Path, manifest: Manifest, state: dict[str, Any], rank: int) -> list[str]:
    """The files of a memory copy this rank's load reads: every writer's metadata, its own
    state file (rank 0's when the copy had no rank of its number), and the data files that
    hold the chunks of ``state`` DCP's planner assigns it. The metadata files must be in
    ``data_dir`` (fetched first)."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    names = {e.name for e in manifest.files}
    own = rank_state_name(rank if rank < manifest.world_size else 0)
    planner = DefaultLoadPlanner()
    metadata = just_in_time.reader(data_dir).read_metadata()
    planner.set_up_planner(state, metadata, False)
    plan = planner.create_local_plan()
    storage = metadata.storage_data
    data = {storage[item.storage_index].relative_path for item in plan.items}
    return sorted({own, *data, *metadata_files(names)} & names)


def metadata_files(names: Iterable[str]) -> list[str]:
    """The writers' metadata files among a copy's ``names``."""
    return sorted(n for n in names if n.startswith("__") and n.endswith(".metadata"))


def _intact_size(path: Path, size: int) -> bool:
    try:
        return path.stat().st_size == size
    except OSError:
        return False

