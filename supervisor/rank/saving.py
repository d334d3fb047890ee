"""The worker side of checkpoints: resume at ``attach()``, save on the directive's cadence.

Two modes, chosen by what the script does:

- babysit saves: the config sets ``checkpoints.every_steps``; the worker API saves model,
  optimizer, scheduler, every rank's RNG state, the data cursor, the step and the LR scale with
  ``torch.distributed.checkpoint`` (sharded), and restores them when a directive says so.
- bring your own: the script saves and loads itself, calls ``run.checkpoint_saved(path)`` after
  each save, and on a relaunch reads ``run.resume`` to know which of its checkpoints to load.

A save happens between steps, never inside ``step()`` (which comes before the step's update
in most loops, so it would capture the weights before it). Where, depends on the loop:

- with ``run.batches()``, at the top of its next iteration: the script's ``opt.step()``,
  ``zero_grad()`` and ``sched.step()`` for step *k* have all run by then, and batch *k+1* has
  not been drawn, so the checkpoint holds exactly "after step k, cursor k" (``maybe_save``).
- in a loop of its own (``while``, an iterator drawn with ``next()``), the save is decided at
  step *k*'s end (its ``run.step()`` and its optimizer update both came: ``rank.boundary``)
  and made at step *k+1*'s start (its first training forward, its optimizer's pre-hook or its
  ``run.step()``), where the scheduler has stepped and every rank arrives at the same step
  still holding step *k*'s model and optimizer; the random streams written are those taken at
  the end (``due`` then ``save``), since the next batch has been drawn by then.

The supervisor can steer a running attempt through its control file (``CONTROL_FILE`` beside the
directive, contract in ``babysit.supervisor.contract.directive``): a one-off checkpoint at a given
step (before a preemption) and a new cadence from a given step on
(``babysit.supervisor.run.cadence``). Rank 0 reports each save's blocking seconds, the stall
training paid, so the supervisor can weigh the cost of a checkpoint against the work an interruption
loses.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from babysit.supervisor.contract.directive import Directive

Emit = Callable[..., None]


@dataclass(frozen=True, slots=True)
class Due:
    """A checkpoint owed of the state of ``step`` (the data at ``cursor``)."""

    step: int
    cursor: int
    final: bool = False
    """The final checkpoint the supervisor asked for before a preemption: waited for."""
    wait: bool = False
    """A rerun's save where the data's remedy would resume (``save_at``): waited for."""
    memory: bool = False
    """A memory copy (``checkpoints.memory``) rather than a checkpoint on disk: its step is
    not one the disk's cadence saves."""


class Checkpointer:
    """Owned by a ``Run``; every method is collective (all ranks call it at the same point)."""

    def __init__(self, directive: Directive, rank: int, model: Any, optimizer: Any,
                 scheduler: Any, emit: Emit) -> None:
        self.directive = directive
        self.rank = rank
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self._emit = emit
        self._pending: Any = None  # an async SaveHandle not yet committed
        self._pending_blocking = 0.0  # seconds its staging stalled training; sent on commit
        self._pending_started = 0.0  # when it started (perf_counter): its write_s on commit
        self._last_saved = -1
        self.control: Path | None = None
        """The supervisor's control file (set by ``attach()`` when babysit runs)."""
        self._control_seen: tuple[int, int, int] | None = None
        self._control_step: int | None = None
        self._final: str | None = None
        """The supervisor's ``final_checkpoint`` request being agreed on (its id), if any."""
        self._final_done: set[str] = set()
        self._final_step: int | None = None
        """The step the ranks agreed to save the final checkpoint at."""
        self._final_counted = False
        """This rank counted itself in as having read the final request (``_final_target``)."""
        self._background: bool | None = None
        """Async saves, decided by every rank together at the first save (``_in_background``)."""
        self.samples_at: Callable[[int], int] | None = None
        """The samples of the data stream consumed at a cursor, when the loader counts them
        (``Run.batches`` sets it for an ``ElasticSampler``); saved with each checkpoint."""
        self._cadence: list[tuple[int, int]] = [(0, directive.checkpoint_every)]
        """``(from_step, every)`` pieces in step order: the directive's cadence, then each
        change the control file made. Pieces wholly in the past are dropped as steps go by."""
        self.copier = _copier(directive, rank, model, optimizer, scheduler, emit) \
            if self.enabled and model is not None else None
        """This rank's memory copies, every few steps between the checkpoints on disk
        (``checkpoints.memory_copy``), when the directive asks for them."""

    @property
    def enabled(self) -> bool:
        return bool(self.directive.checkpoint_every and self.directive.checkpoint_dir)

    def resume(self) -> tuple[int, int] | None:
        """Restore the directive's checkpoint if babysit made it; returns (step, cursor).

        A checkpoint the script registered itself is left for the script to load (``run.resume``
        says where); the step and cursor still come from the directive.
        """
        resume = self.directive.resume
        if resume is None:
            return None
        if resume.external:
            return resume.step, resume.cursor
        from babysit import checkpoints

        if self.model is None:
            raise checkpoints.CheckpointError(
                f"babysit asked rank {self.rank} to resume from {resume.path} (step "
                f"{resume.step}), but attach() got no model to restore into. Pass "
                f"model=..., optimizer=... and scheduler=... to attach().")
        restored = checkpoints.load(resume.path, self.model, self.optimizer, self.scheduler,
                                    reshard=self.directive.reshard, memory=resume.memory,
                                    checked=resume.verified_on is not None
                                    and resume.verified_on == self.directive.memory.get("node"))
        self._last_saved = restored.step
        return restored.step, restored.cursor

    def maybe_save(self, step: int, cursor: int, lr_scale: float,
                   phase: Callable[[str], contextlib.AbstractContextManager[None]]) -> None:
        """Save if the cadence, or the supervisor's request for a final checkpoint, says so.
        Call between steps, on every rank (the top of ``run.batches()``: exact)."""
        due = self.due(step, cursor)
        if due is not None:
            self.save(due, lr_scale, phase)

    def due(self, step: int, cursor: int) -> Due | None:
        """Whether the state of ``step`` (the data at ``cursor``) is to be saved: the cadence,
        the supervisor's requests (the control file: a one-off step, the final checkpoint's
        agreed step) or a rerun's ``save_at``. Call once at the end of every step, on every
        rank (each step's end counts in the final checkpoint's agreement); a save it returns
        is owed, by ``save``, before the next step changes the state."""
        if not self.enabled or self.model is None or step == 0 or step == self._last_saved:
            return None  # without attach(model=...) there is nothing of babysit's to save
        requested = self._read_control(step)
        final = self._final_target(step)
        # A rerun's save where the data's remedy would resume: waited for, like a final one.
        wait = cursor == self.directive.save_at
        if step % self.every(step) and step != requested and step != final and not wait:
            if self.copier is not None and self.copier.due(step):
                return Due(step, cursor, memory=True)
            return None
        if final is not None and step >= final:
            self._final, self._final_step = None, None
        self._last_saved = step
        return Due(step, cursor, final=step == final, wait=wait)

    def save(self, due: Due, lr_scale: float,
             phase: Callable[[str], contextlib.AbstractContextManager[None]],
             rng: dict[str, Any] | None = None) -> None:
        """Save the checkpoint ``due`` asked for (collective): the model, optimizer and
        scheduler as they are now, which must still be those of ``due.step``; this rank's
        random streams as they are now, or ``rng`` (taken at the step's end, where a loop
        without ``run.batches()`` saves only once it has drawn the next batch)."""
        from babysit import checkpoints

        step, cursor = due.step, due.cursor
        if due.memory and self.copier is not None:  # only its copy into host memory stalls
            self.copier.copy(step, cursor, lr_scale, self._samples(cursor), rng=rng)
            return
        started = time.perf_counter()
        try:
            with phase("checkpoint"):
                # save() would wait for an async save still writing anyway; waiting here lets
                # that one be announced (or its failure reported) under its own step.
                self._finish_pending()
                handle = checkpoints.save(
                    str(self.directive.checkpoint_dir), step, cursor, lr_scale, self.model,
                    self.optimizer, self.scheduler, async_save=self._in_background(),
                    samples=self._samples(cursor), rng=rng, timeline=self.directive.timeline)
        except checkpoints.CheckpointError as exc:
            # Every rank raises together (the save is collective), so every rank trains on: a
            # full disk must cost a checkpoint, never the run. The last good one still stands.
            self._failed(step, exc)
            return
        # The stall training paid: the whole save when synchronous, the staging copy (and any
        # wait for the previous async save) when asynchronous; the writes overlap training.
        blocking = time.perf_counter() - started
        if due.final or due.wait:
            # The supervisor waits for this one; a final checkpoint is never left in flight.
            try:
                handle.wait()
            except checkpoints.CheckpointError as exc:
                self._failed(step, exc)
                return
            self._announce(handle, time.perf_counter() - started, final=due.final)
        elif handle.committed:
            self._announce(handle, blocking)
        else:
            self._pending, self._pending_blocking = handle, blocking
            self._pending_started = started

    def _samples(self, cursor: int) -> int | None:
        """The samples of the data stream consumed at ``cursor``, when the loader counts them."""
        return self.samples_at(cursor) if self.samples_at is not None else None

    def _in_background(self) -> bool:
        """Save asynchronously: the directive allows it and, checked once at the first save,
        every node's ranks can hold a copy of their state in half their host's free memory
        (each save stages one there, freed once written). One rank short of it
        makes every rank save synchronously: the save is collective, and a host run out of
        memory would cost more than the stalls."""
        if not self.directive.checkpoint_async:
            return False
        if self._background is None:
            import psutil

            from babysit.checkpoints.save import state_bytes

            need = state_bytes(self.model, self.optimizer) * _local_ranks()
            free = psutil.virtual_memory().available
            self._background = _every_rank(need <= free / 2)
            if not self._background and self.rank == 0:
                self._emit("checkpoint_sync", reason=(
                    f"the ranks' copies of the state for asynchronous saves (about "
                    f"{need / 2**30:.1f} GiB on a host, rank 0's) do not fit in half the free "
                    f"host memory on every node ({free / 2**30:.1f} GiB free here): saving "
                    "synchronously"))
        return self._background

    def every(self, step: int) -> int:
        """The cadence in force at ``step``: a save at each step that is a multiple of it."""
        every = self._cadence[0][1]
        for start, value in self._cadence:
            if start > step:
                break
            every = value
        return every

    def _read_control(self, step: int) -> int | None:
        """Apply the supervisor's control file; return the step it asks a checkpoint at, if any.

        One ``stat`` per step (about 2.6 us here when absent; between steps, never in
        ``step()``); the file is read and parsed only when it changed. The supervisor replaces
        it atomically, so a new version has a new inode even within one mtime tick. Every rank
        reads the same requests, chosen ahead of the newest step reported, so all ranks meet in
        the same collective save.
        """
        if self.control is None:
            return None
        try:
            st = os.stat(self.control)
        except OSError:
            return None
        seen = (st.st_mtime_ns, st.st_ino, st.st_size)
        if seen != self._control_seen:
            self._control_seen = seen
            try:
                request = json.loads(self.control.read_text())
            except (OSError, ValueError):
                request = None
            self._apply_control(request if isinstance(request, dict) else {}, step)
        while len(self._cadence) > 1 and self._cadence[1][0] <= step:
            self._cadence.pop(0)  # a piece wholly in the past
        return self._control_step

    def _final_target(self, step: int) -> int | None:
        """The step the ranks agreed to save the supervisor's final checkpoint at (before a
        preemption), once they have; None otherwise.

        The supervisor asks for "the next step boundary you can all reach"; it cannot name
        the step itself (its count lags the ranks by a tick or more), and the ranks do not read
        the request at the same step: on several nodes each node's file is written when its
        babysitter hears of it, which can be steps after the leader's. So, in the job's c10d
        store: each rank, at the first boundary where it has read the request, counts itself
        in (``.../seen``); rank 0, at each boundary, names the step after it once all ranks
        are counted. From then on every rank looks the name up (a non-blocking ``check``) at
        each boundary, and finds it by that step at the latest: none can finish a step
        without rank 0, which names it before it starts the next one. Without a process group,
        this step."""
        if self._final is None:
            return self._final_step
        if self._final_step is not None:
            return self._final_step
        store = _store()
        key = f"babysit/final_checkpoint/{self._final}"
        if store is None:
            self._final_step = step
            return step
        if not self._final_counted:
            store.add(f"{key}/seen", 1)
            self._final_counted = True
        if self.rank == 0:
            if store.add(f"{key}/seen", 0) >= _world_size():
                self._final_step = step + 1
                store.set(key, str(step + 1))
        elif store.check([key]):
            self._final_step = int(store.get(key).decode())
        if self._final_step is not None and self._final_step < step:
            # Cannot happen with synchronous steps; never save out of step with the others.
            if self.rank == 0:
                self._emit("checkpoint_failed", step=self._final_step, final=True,
                           error=f"rank {self.rank} was already at step {step}")
            self._final, self._final_step = None, None
        return self._final_step

    def _apply_control(self, request: dict[str, Any], step: int) -> None:
        """``checkpoint_at_step`` is what the current file asks (absent: nothing);
        ``checkpoint_every`` changes the cadence from ``from_step`` on (absent: the next step)
        and stays in force when a later version of the file leaves it out."""
        self._control_step = _as_int(request.get("checkpoint_at_step"))
        memory_every = _as_int(request.get("memory_every"))
        if memory_every is not None and self.copier is not None:
            start = _as_int(request.get("memory_from_step"))
            self.copier.set_every(memory_every, step + 1 if start is None else start)
        final = request.get("final_checkpoint")
        if final is not None and str(final) not in self._final_done:
            self._final_done.add(str(final))
            self._final, self._final_step, self._final_counted = str(final), None, False
        every = _as_int(request.get("checkpoint_every"))
        if every is None or every < 1:
            return
        start = _as_int(request.get("from_step"))
        start = step + 1 if start is None else start
        if self._cadence[-1] == (start, every):
            return  # the same change, rewritten beside a new checkpoint_at_step
        self._cadence = [piece for piece in self._cadence if piece[0] < start] + [(start, every)]
        if self.rank == 0:
            self._emit("cadence", every_steps=every, from_step=start)

    def poll(self) -> None:
        """Finish an async save when its writes are done (cheap; call once per step)."""
        if self._pending is None:
            return
        from babysit import checkpoints

        try:
            done = self._pending.poll()
        except checkpoints.CheckpointError as exc:
            handle, self._pending = self._pending, None
            self._failed(handle.step, exc)
            return
        if done:
            handle, self._pending = self._pending, None
            self._announce(handle, self._pending_blocking, started=self._pending_started)

    def close(self) -> None:
        self._finish_pending()
        if self.copier is not None:
            self.copier.close()

    def _finish_pending(self) -> None:
        """Wait for the async save in flight, if any, and announce it or report its failure."""
        if self._pending is None:
            return
        from babysit import checkpoints

        handle, self._pending = self._pending, None
        try:
            handle.wait()
        except checkpoints.CheckpointError as exc:
            self._failed(handle.step, exc)
            return
        self._announce(handle, self._pending_blocking, started=self._pending_started)

    def saved_externally(self, path: str | os.PathLike[str], step: int, cursor: int,
                         lr_scale: float) -> None:
        """The script saved ``path`` itself; make it a babysit checkpoint (collective)."""
        from babysit import checkpoints

        root = self.directive.checkpoint_dir
        if root is None:
            return
        _barrier()
        if self.rank == 0:
            checkpoints.register_external(root, os.fspath(path), step, cursor, lr_scale,
                                          samples=self._samples(cursor),
                                          timeline=self.directive.timeline)
            self._emit("checkpoint", step=step, cursor=cursor, path=str(path), external=True)
        _barrier()

    def _failed(self, step: int, exc: Exception) -> None:
        if self.rank == 0:
            self._emit("checkpoint_failed", step=step, error=str(exc)[:2000])

    def _announce(self, handle: Any, blocking_s: float, final: bool = False,
                  started: float | None = None) -> None:
        """``blocking_s``: seconds rank 0's training stalled for this save (see maybe_save);
        ``final``: the checkpoint the supervisor asked for before a preemption; ``started``:
        when an asynchronous save began (its ``write_s``, start to commit, as seen when it is
        noticed: what a just-in-time save of the same state may take)."""
        if self.rank == 0:
            write_s = blocking_s if started is None else time.perf_counter() - started
            self._emit("checkpoint", step=handle.step, path=str(handle.path), external=False,
                       asynchronous=handle.is_async, blocking_s=round(blocking_s, 6),
                       write_s=round(write_s, 6), **({"final": True} if final else {}))


def _copier(directive: Directive, rank: int, model: Any, optimizer: Any, scheduler: Any,
            emit: Emit) -> Any:
    """This rank's memory copier when the directive asks for copies (``memory``), else None."""
    settings = directive.memory
    if not settings or not settings.get("every"):
        return None
    from babysit.checkpoints.memory_copy import Copier

    every = settings["every"]
    return Copier(Path(settings["root"]), rank=rank,
                  world_size=int(os.environ.get("WORLD_SIZE", "1")),
                  local_world_size=_local_ranks(), node=int(settings.get("node", 0)),
                  every=every if every == "auto" else int(every), model=model,
                  optimizer=optimizer, scheduler=scheduler, emit=emit, chain=directive.lineage)


def _as_int(value: Any) -> int | None:
    """A JSON integer (an integral float too), else None: a malformed field asks nothing."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def _store() -> Any:
    """The job's c10d store (torchrun's rendezvous store), or None without a process group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size()


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _local_ranks() -> int:
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def _every_rank(yes: bool) -> bool:
    """``yes`` on every rank (a collective where a process group is up)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return yes
    answers: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(answers, yes)
    return all(bool(a) for a in answers)
