"""How long a rank's model spends in its training forward passes: its own compute.

Under data parallelism every rank's *step* takes as long as the slowest rank's, because the
fast ones wait for it inside the gradient all-reduce; so a slow machine is invisible in step
times. The forward pass of a DDP model runs no collective (DDP reduces gradients in the
backward), so its duration is the rank's own work: a node with a throttled CPU or a slow GPU
shows up there, and only there. Under FSDP the forward all-gathers every layer's parameters,
the fast ranks wait for the slow one inside it, and the signal is shared by all: it names
nobody (``docs/multinode.md``).

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
        self._pending: list[tuple[Any, Any]] = []
        self._timed = False
        # Run as plain Python under torch.compile: a clock is no part of the model's graph.
        eager: Any = torch.compiler.disable
        self._handles = [module.register_forward_pre_hook(eager(self._start)),
                         module.register_forward_hook(eager(self._stop))]

    def take(self) -> float | None:
        """Seconds of training forward since the last call, or None when none was timed."""
        if self._pending:
            waiting = []
            for start, end in self._pending:
                if end.query():
                    self._seconds += start.elapsed_time(end) / 1000.0
                else:
                    waiting.append((start, end))
            self._pending = waiting
        if not self._timed:
            return None
        seconds, self._seconds, self._timed = self._seconds, 0.0, False
        return seconds

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _start(self, module: Any, args: Any) -> None:
        if not self._torch.is_grad_enabled():
            self._started = None
            return
        if self._cuda:
            event = self._torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            event.record()
            self._started = event
        else:
            self._started = time.perf_counter()

    def _stop(self, module: Any, args: Any, output: Any) -> None:
        started, self._started = self._started, None
        if started is None:
            return
        self._timed = True
        if self._cuda:
            end = self._torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end.record()
            self._pending.append((started, end))
        else:
            self._seconds += time.perf_counter() - started


def _unwrapped(model: Any) -> Any:
    """The module DDP wraps (its own forward broadcasts buffers, a collective), else ``model``."""
    inner = getattr(model, "module", None)
    if type(model).__name__ == "DistributedDataParallel" and inner is not None:
        return inner
    return model


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
