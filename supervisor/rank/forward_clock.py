"""How long a rank's model spends in its training forward passes: its own compute.

Under data parallelism every rank's *step* takes as long as the slowest rank's, because the
fast ones wait for it inside the gradient all-reduce; so a slow machine is invisible in step
times. The forward pass of a DDP model runs no collective (DDP reduces gradients in the
backward), so its duration is the rank's own work: a node with a throttled CPU or a slow GPU
shows up there, and only there. Under FSDP2 (``fully_shard``) the forward all-gathers each
unit's parameters and the fast ranks wait there for the slow one; the time each unit's own
pre-forward hook takes (its all-gather, and the wait for it) is measured with a hook on either
side of it and left out, so what remains is again the rank's own compute.

Only forwards run with autograd on are timed (training, not an eval under ``no_grad``); several
in one step (gradient accumulation) add up. On a CUDA model the time is the GPU's, read from a
pair of CUDA events per forward once they have completed (never waiting for them); on the CPU,
the wall time of the call. Two hooks per forward, a few microseconds; ``torch.compile`` runs
them eagerly (``torch.compiler.disable``), outside the model's graph.
"""

from __future__ import annotations

import time
from typing import Any


class ForwardClock:
    """Hooks on ``model``'s forward; ``take()`` the seconds spent since the last take."""

    def __init__(self, model: Any) -> None:
        import torch

        self._torch = torch
        module = _unwrapped(model)
        self._cuda = _on_cuda(module)
        self._seconds = 0.0
        self._started: Any = None
        self._waiting: Any = None
        self._pending: list[tuple[Any, Any, float]] = []
        self._timed = False
        # Run as plain Python under torch.compile: a clock is no part of the model's graph.
        eager: Any = torch.compiler.disable
        self._handles = [module.register_forward_pre_hook(eager(self._start)),
                         module.register_forward_hook(eager(self._stop))]
        for unit in _sharded_units(module):
            # FSDP2 put its own pre-forward hook (the all-gather) first; one hook before it and
            # one after it bracket the time the rank spent there, not computing.
            self._handles += [unit.register_forward_pre_hook(eager(self._wait_start), prepend=True),
                              unit.register_forward_pre_hook(eager(self._wait_stop))]

    def take(self) -> float | None:
        """Seconds of training forward since the last call, or None when none was timed."""
        if self._pending:
            waiting = []
            for start, end, sign in self._pending:
                if end.query():
                    self._seconds += sign * start.elapsed_time(end) / 1000.0
                else:
                    waiting.append((start, end, sign))
            self._pending = waiting
        if not self._timed:
            return None
        seconds, self._seconds, self._timed = max(self._seconds, 0.0), 0.0, False
        return seconds

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _start(self, module: Any, args: Any) -> None:
        self._started = self._now() if self._torch.is_grad_enabled() else None

    def _stop(self, module: Any, args: Any, output: Any) -> None:
        started, self._started = self._started, None
        if started is not None:
            self._timed = True
            self._add(started, self._now(), 1.0)

    def _wait_start(self, module: Any, args: Any) -> None:
        self._waiting = self._now() if self._started is not None else None

    def _wait_stop(self, module: Any, args: Any) -> None:
        waiting, self._waiting = self._waiting, None
        if waiting is not None and self._started is not None:
            self._add(waiting, self._now(), -1.0)

    def _now(self) -> Any:
        if not self._cuda:
            return time.perf_counter()
        event = self._torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record()
        return event

    def _add(self, start: Any, end: Any, sign: float) -> None:
        if self._cuda:  # read in take(), once the GPU has got there
            self._pending.append((start, end, sign))
        else:
            self._seconds += sign * (end - start)


def _unwrapped(model: Any) -> Any:
    """The module DDP wraps (its own forward broadcasts buffers, a collective), else ``model``."""
    inner = getattr(model, "module", None)
    if type(model).__name__ == "DistributedDataParallel" and inner is not None:
        return inner
    return model


def _sharded_units(module: Any) -> list[Any]:
    """The FSDP2 (``fully_shard``) units in ``module``, the root among them; none without."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a build without distributed
        return []
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def _on_cuda(module: Any) -> bool:
    try:
        return bool(next(module.parameters()).is_cuda)
    except (StopIteration, AttributeError):
        return False


def forward_clock(model: Any) -> ForwardClock | None:
    """A clock on ``model``'s forward, or None for something that is not a torch module."""
    if not callable(getattr(model, "register_forward_hook", None)):
        return None
    return ForwardClock(model)
