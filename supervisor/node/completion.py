"""When a step is complete: the emission rule that the node's two aggregators share.

``aggregate.StepAggregator`` (every rank's report of a step) and ``sketch.SummaryAggregator``
(a constant-size summary of it) hold a step differently and emit it by the same rule, which lives
here, below both, so that neither imports the other for it. Pure logic.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from babysit.policies.types import RankStep

Pending = TypeVar("Pending")
Out = TypeVar("Out")


class Completion(Generic[Pending, Out]):
    """Collects each step's reports until all ``world_size`` ranks are in.

    Each rank's reports arrive in order on its own connection, so once every rank has reported
    step *s*, a pending step before *s* will never get more reports (they were dropped): it is
    emitted then, with the ranks it has, in step order. The intake drains one rank's connection
    after another, so a lag rule ("emit when a report N steps newer arrives") would split steps
    whenever one rank's backlog is read before the others'. ``max_pending`` only bounds memory
    when a rank stops reporting while the others go on.

    Subclasses say how a pending step holds its reports (``_open``, ``_add``, ``_count``) and
    what it becomes when emitted (``_close``).
    """

    def __init__(self, world_size: int, max_pending: int = 1024) -> None:
        self.world_size = world_size
        self.max_pending = max_pending
        self._pending: dict[int, Pending] = {}

    def add(self, sample: RankStep) -> list[Out]:
        bucket = self._pending.get(sample.step)
        if bucket is None:
            bucket = self._pending[sample.step] = self._open(sample.step)
        self._add(bucket, sample)
        if self._count(bucket) >= self.world_size:
            return [self._emit(s) for s in sorted(self._pending) if s <= sample.step]
        if len(self._pending) > self.max_pending:
            return [self._emit(min(self._pending))]
        return []

    def flush(self) -> list[Out]:
        """Emit everything pending (the attempt ended)."""
        return [self._emit(s) for s in sorted(self._pending)]

    def reset(self) -> None:
        """Forget pending steps (a new attempt starts; a rollback may reuse step numbers)."""
        self._pending.clear()

    def _emit(self, step: int) -> Out:
        return self._close(step, self._pending.pop(step))

    def _open(self, step: int) -> Pending:
        raise NotImplementedError

    def _add(self, bucket: Pending, sample: RankStep) -> None:
        raise NotImplementedError

    def _count(self, bucket: Pending) -> int:
        raise NotImplementedError

    def _close(self, step: int, bucket: Pending) -> Out:
        raise NotImplementedError
