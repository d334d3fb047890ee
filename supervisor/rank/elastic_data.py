"""A data cursor in samples: one global order of the dataset that every world size splits.

babysit's cursor counts global batches. That is a position in the data only while a global
batch holds the same samples at every world size (each rank's batch = global / world size, the
contract ``detectors/resume_data.py`` checks). Scripts that keep each rank's own batch size
(``DistributedSampler`` and a ``DataLoader(batch_size=b)``, plain PyTorch's way) change the
global batch when a node is lost, evicted or back: resumed at the same cursor, they repeat
samples or skip them.

``ElasticSampler`` is a batch sampler for those scripts (Megatron's consumed-samples sampler,
in babysit's terms)::

    sampler = ElasticSampler(len(dataset), batch_size=8, seed=0)
    loader = DataLoader(dataset, batch_sampler=sampler, num_workers=2)
    for x, y in run.batches(loader):
        ...

The dataset's samples are one stream: epoch after epoch, each a permutation of the indices
(``seed + epoch``; in order without ``shuffle``). Global batch *k* of an attempt with *W* ranks
takes the next ``W x batch_size`` samples of the stream from where the attempt resumed; rank *r*
gets its *r*-th slice. So a position in the stream, the samples consumed, is the same for every
world size. ``run.batches()`` tells the sampler where the attempt resumed, global batch and
sample (``anchor``: the checkpoint records the samples consumed at its cursor), moves it for
skips (``seek``), and asks it the samples at each checkpoint's cursor (``samples_at``). A run
that resumes on fewer or more ranks goes on at the next sample: none skipped, none repeated.
(The global batch is still smaller or larger than the one the optimizer was tuned for: the
resume check says so.)

A global batch may span two epochs; the stream ends after ``epochs`` passes over the data when
given (the last partial global batch is dropped: every rank needs a full batch), else never.
The permutation of an epoch is built when the stream reaches it (``torch.randperm``: 8 bytes a
sample). A rollback's skip comes in samples when the attempt that met the bad batches drew
with an ``ElasticSampler`` (it reports its stream's place, ``run.batches()``); the rank skips the
global batches of its own world size that hold them (``batches_holding``), so the skip follows
the data across a resize, and places the rollback's LR re-warm the same way (``batch_of``,
``batch_from``). Without that report (a plain loader) both are in global batches.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any


class ElasticSampler:
    """Yields this rank's batches of indices (a ``DataLoader``'s ``batch_sampler``)."""

    def __init__(self, num_samples: int, batch_size: int, *, shuffle: bool = True,
                 seed: int = 0, epochs: int | None = None, rank: int | None = None,
                 world_size: int | None = None) -> None:
        """``rank``/``world_size``: this rank's place among the data-parallel ranks (default:
        ``torch.distributed``'s, or torchrun's ``RANK``/``WORLD_SIZE`` before the process group
        exists, else 0 of 1; under tensor or pipeline parallelism pass the data-parallel ones)."""
        if num_samples < 1 or batch_size < 1:
            raise ValueError(f"ElasticSampler needs num_samples >= 1 and batch_size >= 1, got "
                             f"{num_samples} and {batch_size}")
        if epochs is not None and epochs < 1:
            raise ValueError(f"ElasticSampler: epochs must be >= 1 or None, got {epochs}")
        if rank is None or world_size is None:
            rank, world_size = _place()
        if not 0 <= rank < world_size:
            raise ValueError(f"ElasticSampler: rank {rank} is not one of {world_size} ranks")
        self.num_samples, self.batch_size = num_samples, batch_size
        self.shuffle, self.seed, self.epochs = shuffle, seed, epochs
        self.rank, self.world_size = rank, world_size
        self._anchor = (0, 0)
        """(global batch, samples consumed before it) where this attempt's stream position is
        known: a fresh start, or the resume's checkpoint."""
        self.start = 0
        """Samples consumed before the first batch the next ``iter()`` yields."""
        self._perm: tuple[int, Any] | None = None

    @property
    def global_batch(self) -> int:
        """Samples in one global batch at this world size."""
        return self.world_size * self.batch_size

    def anchor(self, cursor: int, samples: int) -> None:
        """Global batch ``cursor`` of this attempt begins at sample ``samples`` of the stream
        (``run.batches()`` calls it with the resumed checkpoint's record); the next ``iter()``
        starts there."""
        if cursor < 0 or samples < 0:
            raise ValueError(f"ElasticSampler.anchor: cursor {cursor} and samples {samples} "
                             "must be >= 0")
        self._anchor = (cursor, samples)
        self.start = samples

    def samples_at(self, cursor: int) -> int:
        """Samples of the stream consumed before global batch ``cursor`` of this attempt."""
        at, samples = self._anchor
        return samples + (cursor - at) * self.global_batch

    def batches_holding(self, first: int, end: int) -> tuple[int, int]:
        """The global batches ``[start, stop)`` of this attempt that hold any of the stream's
        samples ``first <= sample < end``: a skip the supervisor gave in samples, in this world
        size's batches. Rounded outward, so a batch is never half skipped: where the global batch
        changed since the samples were met, up to a batch of this size's samples on either side
        goes with them (a rollback's skip has batches of margin around its onset anyway)."""
        return self.batch_of(first), self.batch_from(end)

    def batch_of(self, sample: int) -> int:
        """The global batch of this attempt that holds stream sample ``sample``."""
        at, samples = self._anchor
        return at + (sample - samples) // self.global_batch

    def batch_from(self, sample: int) -> int:
        """The first global batch of this attempt that begins at or after stream sample
        ``sample``."""
        at, samples = self._anchor
        return at - ((samples - sample) // self.global_batch)

    def seek(self, cursor: int) -> None:
        """babysit's loader protocol: the next ``iter()`` starts at global batch ``cursor``."""
        self.start = self.samples_at(cursor)

    def __iter__(self) -> Iterator[list[int]]:
        position = self.start
        end = None if self.epochs is None else self.epochs * self.num_samples
        while end is None or position + self.global_batch <= end:
            yield self._indices(position + self.rank * self.batch_size, self.batch_size)
            position += self.global_batch

    def __len__(self) -> int:
        """This rank's batches left from ``start`` (with ``epochs``; an endless stream has no
        length)."""
        if self.epochs is None:
            raise TypeError("an ElasticSampler without epochs is an endless stream: no len()")
        return max(0, (self.epochs * self.num_samples - self.start) // self.global_batch)

    def _indices(self, position: int, count: int) -> list[int]:
        """The dataset indices at ``count`` stream positions from ``position``."""
        out: list[int] = []
        while count:
            epoch, offset = divmod(position, self.num_samples)
            take = min(count, self.num_samples - offset)
            if self.shuffle:
                out += self._permutation(epoch)[offset:offset + take].tolist()
            else:
                out += range(offset, offset + take)
            position, count = position + take, count - take
        return out

    def _permutation(self, epoch: int) -> Any:
        if self._perm is None or self._perm[0] != epoch:
            import torch

            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._perm = (epoch, torch.randperm(self.num_samples, generator=generator))
        return self._perm[1]


def _place() -> tuple[int, int]:
    """This process's rank and world size: the process group's, else torchrun's environment
    (a sampler built before ``init_process_group`` must not take every rank for rank 0), else
    0 of 1."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def find(loader: object) -> ElasticSampler | None:
    """The ``ElasticSampler`` behind ``loader`` (itself, or a ``DataLoader``'s batch sampler)."""
    if isinstance(loader, ElasticSampler):
        return loader
    found = getattr(loader, "batch_sampler", None)
    return found if isinstance(found, ElasticSampler) else None
