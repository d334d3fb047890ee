"""The worker side of checkpoints: resume at ``attach()``, save on the directive's cadence.

Two modes, chosen by what the script does:

- babysit saves: the config sets ``checkpoints.every_steps``; the worker API saves model,
  optimizer, scheduler, every rank's RNG state, the data cursor, the step and the LR scale with
  ``torch.distributed.checkpoint`` (sharded), and restores them when a directive says so.
- bring your own: the script saves and loads itself, calls ``run.checkpoint_saved(path)`` after
  each save, and on a relaunch reads ``run.resume`` to know which of its checkpoints to load.

A save happens at the top of the next ``batches()`` iteration, not inside ``step()``: the
script's ``opt.step()``, ``zero_grad()`` and ``sched.step()`` for step *k* have all run by
then, and batch *k+1* has not been drawn, so the checkpoint holds exactly "after step k, cursor
k". Saving inside ``step()`` would capture the weights before that step's update.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from supervisor.directive import Directive

Emit = Callable[..., None]


class Checkpointer:
    """Owned by a ``Run``; every method is collective (all ranks call it at the same point)."""

    def __init__(self, directive: Directive, rank: int, model: Any, optimizer: Any,
                 scheduler: Any, emit: Emit) -> None:
        self.directive = directive
        self.rank = rank
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self._emit = emit
        self._pending: Any = None  # an async SaveHandle not yet committed
        self._last_saved = -1
        self.control: Path | None = None
        """The supervisor's control file (set by ``attach()`` when babysit runs)."""
        self._control_seen: int | None = None
        self._control_step: int | None = None

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
        import checkpoints

        if self.model is None:
            raise checkpoints.CheckpointError(
                f"babysit asked rank {self.rank} to resume from {resume.path} (step "
                f"{resume.step}), but attach() got no model to restore into. Pass "
                f"model=..., optimizer=... and scheduler=... to attach().")
        restored = checkpoints.load(resume.path, self.model, self.optimizer, self.scheduler)
        self._last_saved = restored.step
        return restored.step, restored.cursor

    def maybe_save(self, step: int, cursor: int, lr_scale: float,
                   phase: Callable[[str], contextlib.AbstractContextManager[None]]) -> None:
        """Save if the cadence, or the supervisor's request for a final checkpoint, says so.
        Call between steps, on every rank."""
        if not self.enabled or step == 0 or step == self._last_saved:
            return
        if step % self.directive.checkpoint_every and step != self._requested_step():
            return
        import checkpoints

        self._last_saved = step
        try:
            with phase("checkpoint"):
                handle = checkpoints.save(
                    str(self.directive.checkpoint_dir), step, cursor, lr_scale, self.model,
                    self.optimizer, self.scheduler, async_save=self.directive.checkpoint_async)
        except checkpoints.CheckpointError as exc:
            # Every rank raises together (the save is collective), so every rank trains on: a
            # full disk must cost a checkpoint, never the run. The last good one still stands.
            self._failed(step, exc)
            return
        if handle.committed:
            self._announce(handle)
        else:
            self._pending = handle

    def _requested_step(self) -> int | None:
        """The step the supervisor asked every rank to checkpoint at (preemption), if any.

        It is a file beside the directive: one ``stat`` per step (about 2.6 us here when absent;
        between steps, never in ``step()``), read only when its mtime changes. Every rank reads
        the same step, chosen ahead of the newest one reported, so all ranks meet in the same
        collective save.
        """
        if self.control is None:
            return None
        try:
            mtime = os.stat(self.control).st_mtime_ns
        except OSError:
            return None
        if mtime != self._control_seen:  # read and parse only when the request changed
            self._control_seen = mtime
            try:
                self._control_step = int(
                    json.loads(self.control.read_text())["checkpoint_at_step"])
            except (OSError, ValueError, KeyError, TypeError):
                self._control_step = None
        return self._control_step

    def poll(self) -> None:
        """Finish an async save when its writes are done (cheap; call once per step)."""
        if self._pending is None:
            return
        import checkpoints

        try:
            done = self._pending.poll()
        except checkpoints.CheckpointError as exc:
            handle, self._pending = self._pending, None
            self._failed(handle.step, exc)
            return
        if done:
            handle, self._pending = self._pending, None
            self._announce(handle)

    def close(self) -> None:
        if self._pending is not None:
            handle, self._pending = self._pending, None
            handle.wait()
            self._announce(handle)

    def saved_externally(self, path: str | os.PathLike[str], step: int, cursor: int,
                         lr_scale: float) -> None:
        """The script saved ``path`` itself; make it a babysit checkpoint (collective)."""
        import checkpoints

        root = self.directive.checkpoint_dir
        if root is None:
            return
        _barrier()
        if self.rank == 0:
            checkpoints.register_external(root, os.fspath(path), step, cursor, lr_scale)
            self._emit("checkpoint", step=step, cursor=cursor, path=str(path), external=True)
        _barrier()

    def _failed(self, step: int, exc: Exception) -> None:
        if self.rank == 0:
            self._emit("checkpoint_failed", step=step, error=str(exc)[:2000])

    def _announce(self, handle: Any) -> None:
        if self.rank == 0:
            self._emit("checkpoint", step=handle.step, path=str(handle.path), external=False,
                       asynchronous=handle.is_async)


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
