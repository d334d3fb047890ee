"""Mergeable per-step statistics for large world sizes: memory that does not grow with ranks.

At 8 ranks the intake can keep every rank's report of a step (``StepAggregator``); at 8,000 it
should keep a summary whose size does not depend on the number of ranks, and only a short ring
of raw reports for incidents. The pieces, smallest first::

    QuantileSketch   values -> log buckets; any quantile within a relative error alpha
                     (``node.quantiles``)
    StepStats        one signal of one step over ranks: count, sum, min/max + their ranks,
                     non-finite count + ranks, and a QuantileSketch of the finite values
    StepSummary      one step: StepStats for loss, step_time, data_wait, compute, grad_norm,
                     forward,
                     plus lr, tokens, samples, cursor, skipped count, which ranks reported;
                     to_dict / from_dict: the JSON a node sends the leader
    SummaryAggregator  RankSteps in, StepSummaries out (same emission rule as StepAggregator),
                     plus RawRing, the raw reports of the last few steps, packed
    SummaryRecord    a job's StepSummary read as a ``JobStep``, for the job-level detectors

Everything is mergeable: a node's supervisor can summarise its ranks and a leader merges the
summaries, and the result equals summarising all ranks in one place (exactly, not approximately:
the tests check it, up to the order in which floats are summed). The JSON round trip is exact
too. Pure logic, stdlib only (and ``RankStep``); values keep the units the worker reported.

Where it is used:

- ``babysit.supervisor.node.aggregate.metrics_row`` writes ``StepSummary.to_row`` instead of
  per-rank lists above ``PER_RANK_LIMIT`` ranks: the metrics file is what grows with the run, and a
  row of 8,192 ranks' values is 508 KiB a step.
- ``SummaryAggregator`` shares ``StepAggregator``'s emission rule (``completion.Completion``)
  and holds a step in constant memory: the shape a node's supervisor can send a leader.
- A multi-node run: each node sends its steps' ``to_dict()``; the leader's ``NodeMerger``
  merges them (``cluster.merge.NodeMerger``), and ``Pipeline(policy, scope="job")`` observes
  ``SummaryRecord(summary)``.

Detectors of job-wide signals read a ``JobStep`` (``policies.types``): ``StepRecord`` or
``SummaryRecord``, where ``loss`` is ``summary.mean_loss``, ``grad_norm`` is ``max_grad_norm``,
``step_time`` is ``slowest_step_time``; ``step``, ``time``, ``cursor``, ``tokens``,
``world_size`` are the same. Per-rank detectors could get what they need from the stats instead
of ``record.ranks``: the straggler rule "a rank's compute > factor x the peers' median" becomes
``compute.max`` against ``compute.quantile(0.5)``, naming ``compute.max_rank`` (and the same
for ``data_wait``); the non-finite detector names ``loss.nonfinite_ranks`` and
``grad_norm.nonfinite_ranks``. An incident writes ``ring.records()``: every rank's raw report of
the last K steps.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from babysit.policies import types
from babysit.policies.types import RankStep
from babysit.supervisor.contract import protocol
from babysit.supervisor.node.completion import Completion
from babysit.supervisor.node.quantiles import DEFAULT_ALPHA, MAX_RANKS, QuantileSketch

_MAX_NONFINITE_RANKS = 64


def _json_float(x: float) -> float | str:
    """``x`` as strict JSON can carry it: non-finite floats as ``"inf"``, ``"-inf"``, ``"nan"``,
    which ``float()`` reads back."""
    return x if math.isfinite(x) else repr(x)


def _json_optional(x: float | None) -> float | str | None:
    return None if x is None else _json_float(x)


def _float_optional(x: float | str | None) -> float | None:
    return None if x is None else float(x)


class StepStats:
    """One signal of one step over ranks, in constant memory.

    ``min_rank``/``max_rank`` name the rank holding the extreme (the lowest rank on a tie, so
    the result does not depend on arrival order); the rank that departs from its peers is what
    an operator needs. Non-finite values are counted (and the lowest 64 such ranks kept) but
    never enter ``sum``, min/max or the sketch.

    Calling rules: ``add(rank, value)`` once per rank and step; ``merge`` the stats of disjoint
    sets of ranks (a node's and another node's).
    """

    __slots__ = ("count", "max", "max_rank", "min", "min_rank", "nonfinite", "nonfinite_ranks",
                 "sketch", "sum")

    def __init__(self, alpha: float = DEFAULT_ALPHA) -> None:
        self.count = 0
        """Finite values counted."""
        self.sum = 0.0
        self.min = math.inf
        self.min_rank = -1
        self.max = -math.inf
        self.max_rank = -1
        self.nonfinite = 0
        self.nonfinite_ranks: list[int] = []
        self.sketch = QuantileSketch(alpha)

    def add(self, rank: int, value: float) -> None:
        if not math.isfinite(value):
            self.nonfinite += 1
            self._note_nonfinite([rank])
            return
        self.count += 1
        self.sum += value
        if value < self.min or (value == self.min and rank < self.min_rank):
            self.min, self.min_rank = value, rank
        if value > self.max or (value == self.max and rank < self.max_rank):
            self.max, self.max_rank = value, rank
        self.sketch.add(value)

    def _note_nonfinite(self, ranks: Iterable[int]) -> None:
        merged = sorted(set(self.nonfinite_ranks).union(ranks))
        self.nonfinite_ranks = merged[:_MAX_NONFINITE_RANKS]

    def merge(self, other: StepStats) -> None:
        if other.count:
            if other.min < self.min or (other.min == self.min and other.min_rank < self.min_rank):
                self.min, self.min_rank = other.min, other.min_rank
            if other.max > self.max or (other.max == self.max and other.max_rank < self.max_rank):
                self.max, self.max_rank = other.max, other.max_rank
        self.count += other.count
        self.sum += other.sum
        self.nonfinite += other.nonfinite
        if other.nonfinite_ranks:
            self._note_nonfinite(other.nonfinite_ranks)
        self.sketch.merge(other.sketch)

    @property
    def mean(self) -> float | None:
        """Mean of the finite values; ``None`` if there are none."""
        return self.sum / self.count if self.count else None

    def quantile(self, q: float) -> float | None:
        return self.sketch.quantile(q)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (``allow_nan=False`` works): min/max are ``None`` while nothing finite was
        added, and a ``sum`` that overflowed is written as the string ``"inf"``."""
        return {
            "count": self.count, "sum": _json_float(self.sum),
            "min": self.min if self.count else None, "min_rank": self.min_rank,
            "max": self.max if self.count else None, "max_rank": self.max_rank,
            "nonfinite": self.nonfinite, "nonfinite_ranks": list(self.nonfinite_ranks),
            "sketch": self.sketch.to_dict(),
        }

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> StepStats:
        stats = cls()
        stats.count, stats.sum = int(state["count"]), float(state["sum"])
        if stats.count:
            stats.min, stats.max = float(state["min"]), float(state["max"])
        stats.min_rank, stats.max_rank = int(state["min_rank"]), int(state["max_rank"])
        stats.nonfinite = int(state["nonfinite"])
        stats.nonfinite_ranks = [int(r) for r in state["nonfinite_ranks"]]
        stats.sketch = QuantileSketch.from_dict(state["sketch"])
        return stats


_SIGNALS = ("loss", "step_time", "data_wait", "compute", "grad_norm", "forward")


def _runs(seen: bytearray) -> list[list[int]]:
    """The ranks marked in ``seen``, as runs ``[first, stop)``."""
    out: list[list[int]] = []
    first = seen.find(1)
    while first >= 0:
        stop = seen.find(0, first)
        if stop < 0:
            stop = len(seen)
        out.append([first, stop])
        first = seen.find(1, stop)
    return out


class StepSummary:
    """Every rank's report for one step, summarised; the large-world counterpart of
    ``StepRecord``. Memory: about 1 KiB per signal plus one byte per rank of the world (to
    refuse a rank's duplicate report), whatever the values.

    ``compute`` is ``step_time - data_wait`` (floored at 0) per rank, the straggler signal;
    ``forward`` each rank's ``forward_time``, its own compute (``slowest_forward``).
    ``lr`` is the lowest reporting rank's, as ``metrics_row`` reports it.
    """

    def __init__(self, step: int, world_size: int, alpha: float = DEFAULT_ALPHA) -> None:
        self.step = step
        self.world_size = world_size
        self.time = -math.inf
        self.cursor = 0
        self.n_ranks = 0
        self.duplicates = 0
        self._seen = bytearray(world_size)
        self.loss = StepStats(alpha)
        self.step_time = StepStats(alpha)
        self.data_wait = StepStats(alpha)
        self.compute = StepStats(alpha)
        self.grad_norm = StepStats(alpha)
        self.forward = StepStats(alpha)
        self.lr: float | None = None
        self._lr_rank = -1
        self.tokens: float | None = None
        self.samples: float | None = None
        self.skipped = 0

    @classmethod
    def of(cls, step: int, world_size: int, reports: Iterable[RankStep]) -> StepSummary:
        """The summary of ``reports``, every one of them of ``step``."""
        summary = cls(step, world_size)
        for r in reports:
            summary.add(r)
        return summary

    def add(self, r: RankStep) -> None:
        """Count one rank's report. A second report from the same rank is counted in
        ``duplicates`` and otherwise ignored (the per-rank aggregator keeps one per rank too)."""
        if r.rank >= len(self._seen):
            self._seen.extend(bytes(r.rank + 1 - len(self._seen)))
        if self._seen[r.rank]:
            self.duplicates += 1
            return
        self._seen[r.rank] = 1
        self.n_ranks += 1
        self.time = max(self.time, r.time)
        self.cursor = max(self.cursor, r.cursor)
        if r.loss is not None:
            self.loss.add(r.rank, r.loss)
        if r.grad_norm is not None:
            self.grad_norm.add(r.rank, r.grad_norm)
        if r.step_time is not None:
            self.step_time.add(r.rank, r.step_time)
            if r.data_wait is not None:
                self.compute.add(r.rank, max(r.step_time - r.data_wait, 0.0))
        if r.data_wait is not None:
            self.data_wait.add(r.rank, r.data_wait)
        if r.forward_time is not None:
            self.forward.add(r.rank, r.forward_time)
        if r.lr is not None and (self._lr_rank < 0 or r.rank < self._lr_rank):
            self.lr, self._lr_rank = r.lr, r.rank
        if r.tokens is not None:
            self.tokens = (self.tokens or 0.0) + r.tokens
        if r.samples is not None:
            self.samples = (self.samples or 0.0) + r.samples
        self.skipped += r.skipped

    def merge(self, other: StepSummary) -> None:
        """Add another set of ranks' summary of the same step (another node's). Raises
        ``ValueError``, changing nothing, for another step, a rank in both summaries, or stats
        sketched with another alpha."""
        if other.step != self.step:
            raise ValueError(f"cannot merge step {other.step} into step {self.step}")
        shared = self.shared_rank(other)
        if shared is not None:
            raise ValueError(f"rank {shared} is in both summaries of step {self.step}")
        for name in _SIGNALS:
            mine, theirs = getattr(self, name).sketch, getattr(other, name).sketch
            if (mine.alpha, mine.max_buckets, mine.min_value) != (
                    theirs.alpha, theirs.max_buckets, theirs.min_value):
                raise ValueError(f"cannot merge step {self.step}'s {name}: the summaries were "
                                 "sketched with different alpha, max_buckets or min_value")
        if len(other._seen) > len(self._seen):
            self._seen.extend(bytes(len(other._seen) - len(self._seen)))
        # Bytes are 0 or 1: OR-ing them as one integer is the union, at C speed (8,192 ranks).
        union = int.from_bytes(self._seen, "little") | int.from_bytes(other._seen, "little")
        self._seen = bytearray(union.to_bytes(len(self._seen), "little"))
        self.world_size = max(self.world_size, other.world_size)
        self.n_ranks += other.n_ranks
        self.duplicates += other.duplicates
        self.time = max(self.time, other.time)
        self.cursor = max(self.cursor, other.cursor)
        for name in _SIGNALS:
            getattr(self, name).merge(getattr(other, name))
        if other._lr_rank >= 0 and (self._lr_rank < 0 or other._lr_rank < self._lr_rank):
            self.lr, self._lr_rank = other.lr, other._lr_rank
        if other.tokens is not None:
            self.tokens = (self.tokens or 0.0) + other.tokens
        if other.samples is not None:
            self.samples = (self.samples or 0.0) + other.samples
        self.skipped += other.skipped

    def shared_rank(self, other: StepSummary) -> int | None:
        """The lowest rank counted in both summaries, or ``None`` (they can merge)."""
        both = int.from_bytes(self._seen, "little") & int.from_bytes(other._seen, "little")
        return None if not both else ((both & -both).bit_length() - 1) // 8

    def missing_ranks(self, limit: int = 16) -> list[int]:
        """The first ``limit`` ranks below ``world_size`` that did not report."""
        out: list[int] = []
        for rank in range(self.world_size):
            if rank >= len(self._seen) or not self._seen[rank]:
                out.append(rank)
                if len(out) >= limit:
                    break
        return out

    # The StepRecord properties, same meaning, so global-signal detectors can read either.

    @property
    def mean_loss(self) -> float | None:
        """Mean loss over reporting ranks; NaN if any rank reported a non-finite loss."""
        if self.loss.nonfinite:
            return math.nan
        return self.loss.mean

    @property
    def max_grad_norm(self) -> float | None:
        if self.grad_norm.nonfinite:
            return math.nan
        return self.grad_norm.max if self.grad_norm.count else None

    @property
    def slowest_step_time(self) -> float | None:
        """Slowest rank's step time: the step as the job experiences it; NaN if any rank's step
        time is non-finite (a broken clock: no rate can be measured from it)."""
        if self.step_time.nonfinite:
            return math.nan
        return self.step_time.max if self.step_time.count else None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (``json.dumps(..., allow_nan=False)`` works): what a node sends the
        leader. ``from_dict`` restores a summary that reads, merges and writes ``to_row``
        exactly like this one. Non-finite floats are written as ``"inf"``, ``"-inf"``,
        ``"nan"``; the ranks that reported as runs ``[first, stop)``, so a node's ranks (usually
        one run) cost a few bytes whatever the world size."""
        return {
            "step": self.step, "world_size": self.world_size, "time": _json_float(self.time),
            "cursor": self.cursor, "ranks": _runs(self._seen), "duplicates": self.duplicates,
            "lr": _json_optional(self.lr), "lr_rank": self._lr_rank,
            "tokens": _json_optional(self.tokens), "samples": _json_optional(self.samples),
            "skipped": self.skipped,
            "stats": {name: getattr(self, name).to_dict() for name in _SIGNALS},
        }

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> StepSummary:
        """The inverse of ``to_dict``. Raises ``ValueError`` naming what is wrong when ``state``
        is not a summary (it came over the network)."""
        try:
            if not 0 <= int(state["world_size"]) <= MAX_RANKS:
                raise ValueError(f"world_size {state['world_size']} is over {MAX_RANKS}")
            summary = cls(int(state["step"]), int(state["world_size"]))
            summary.time = float(state["time"])
            summary.cursor = int(state["cursor"])
            for first, stop in state["ranks"]:
                first, stop = int(first), int(stop)
                if not 0 <= first < stop <= MAX_RANKS:
                    raise ValueError(f"bad run of ranks [{first}, {stop})")
                if stop > len(summary._seen):
                    summary._seen.extend(bytes(stop - len(summary._seen)))
                summary._seen[first:stop] = b"\x01" * (stop - first)
            summary.n_ranks = summary._seen.count(1)
            summary.duplicates = int(state["duplicates"])
            summary.lr = _float_optional(state["lr"])
            summary._lr_rank = int(state["lr_rank"])
            summary.tokens = _float_optional(state["tokens"])
            summary.samples = _float_optional(state["samples"])
            summary.skipped = int(state["skipped"])
            stats = state["stats"]
            for name in _SIGNALS:
                setattr(summary, name, StepStats.from_dict(stats[name]))
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
            what = f"missing key {e}" if isinstance(e, KeyError) else str(e)
            raise ValueError(f"not a StepSummary ({what})") from None
        return summary

    def to_row(self, attempt: int) -> dict[str, Any]:
        """One ``metrics.jsonl`` line: ``metrics_row``'s summary keys (``loss_median`` is the
        sketch's, within alpha) with the per-rank lists replaced by quantiles and the ranks of
        the extremes. Non-finite floats may appear; the loop's ``journal.json_safe`` cleans them."""
        row: dict[str, Any] = {
            "step": self.step, "time": round(self.time, 6), "attempt": attempt,
            "cursor": self.cursor, "n_ranks": self.n_ranks, "world_size": self.world_size,
        }
        if self.n_ranks < self.world_size:
            row["missing_ranks"] = self.missing_ranks()
        loss = self.loss
        if loss.count or loss.nonfinite:
            row["loss"] = self.mean_loss
            if loss.count:
                row.update(loss_min=loss.min, loss_min_rank=loss.min_rank,
                           loss_median=loss.quantile(0.5), loss_max=loss.max,
                           loss_max_rank=loss.max_rank)
            if loss.nonfinite:
                row["loss_nonfinite_ranks"] = list(loss.nonfinite_ranks)
        if self.grad_norm.count or self.grad_norm.nonfinite:
            row["grad_norm"] = self.max_grad_norm
        if self.lr is not None:
            row["lr"] = self.lr
        if self.tokens is not None:
            row["tokens"] = self.tokens
        for name in ("step_time", "data_wait", "compute", "forward"):
            stats: StepStats = getattr(self, name)
            if stats.count:
                row.update({
                    name: stats.max if name == "step_time" else stats.mean,
                    f"{name}_p50": stats.quantile(0.5), f"{name}_p99": stats.quantile(0.99),
                    f"{name}_max": stats.max, f"{name}_max_rank": stats.max_rank,
                })
        if self.skipped:
            row["skipped"] = True
            row["skipped_ranks"] = self.skipped
        return row


class RawRing:
    """The raw reports of the last ``steps`` steps, packed (86 bytes a report, a third of a
    ``RankStep`` object), for an incident to write out. Memory: ``steps`` x ranks x 86 bytes,
    so 2.8 MiB for 4 steps of 8,192 ranks. A step older than the newest ``steps`` is dropped."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self._data: dict[int, bytearray] = {}

    def add(self, r: RankStep) -> None:
        if self.steps <= 0:
            return
        buf = self._data.get(r.step)
        if buf is None:
            if len(self._data) >= self.steps and r.step < min(self._data):
                return  # older than every step kept
            buf = self._data[r.step] = bytearray()
            if len(self._data) > self.steps:
                del self._data[min(self._data)]
        buf += protocol.STEP_BODY.pack(*protocol.step_body(r))

    def records(self) -> list[RankStep]:
        """Every kept report, by step, then arrival order."""
        out: list[RankStep] = []
        for step in sorted(self._data):
            out.extend(protocol.rank_step(body)
                       for body in protocol.STEP_BODY.iter_unpack(self._data[step]))
        return out

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self._data.values())

    def clear(self) -> None:
        self._data.clear()


class SummaryAggregator(Completion[StepSummary, StepSummary]):
    """``StepAggregator`` for large world sizes: the same calling and emission rules
    (``babysit.supervisor.node.completion.Completion``), but a step is held as a ``StepSummary``,
    never as a list of reports. The raw reports of the last ``keep_raw`` steps are kept in ``ring``.
    This is what a node's supervisor can send a leader: summaries merge exactly."""

    def __init__(self, world_size: int, max_pending: int = 1024, keep_raw: int = 4,
                 alpha: float = DEFAULT_ALPHA) -> None:
        super().__init__(world_size, max_pending)
        self.alpha = alpha
        self.ring = RawRing(keep_raw)

    def _open(self, step: int) -> StepSummary:
        return StepSummary(step, self.world_size, self.alpha)

    def _add(self, bucket: StepSummary, sample: RankStep) -> None:
        bucket.add(sample)
        self.ring.add(sample)

    def _count(self, bucket: StepSummary) -> int:
        return bucket.n_ranks

    def _close(self, step: int, bucket: StepSummary) -> StepSummary:
        return bucket

    def reset(self) -> None:
        """Forget pending steps and the ring (a new attempt starts)."""
        super().reset()
        self.ring.clear()


class SummaryRecord:
    """A merged ``StepSummary`` read as a ``policies.types.JobStep``: what the job-level
    detectors (``Pipeline(policy, scope="job")``: loss spike, grad norm, throughput) observe on a
    multi-node leader. Read-only; the same meanings and ``None`` rules as ``StepRecord``:

    ``loss`` the mean over reporting ranks (NaN if any is non-finite), ``grad_norm`` the
    largest (NaN if any is non-finite), ``step_time`` the slowest rank's, ``tokens`` the job's
    total, ``tokens_per_s`` and ``mfu`` computed from them exactly as ``StepRecord`` does.
    One difference, where ``StepRecord`` has no meaning to offer: a non-finite step time makes
    ``step_time`` NaN here (``StepRecord``'s ``max()`` answers inf, NaN or the other ranks' max,
    by rank order); no rate is measured from a step time that is not finite either way.

    ``flops_per_token`` and ``peak_flops`` (per device) are what the job declared, as on
    ``StepRecord``; ``mfu`` divides by ``peak_flops x world_size``. ``slowest_link`` is the
    leader's own measurement, which no summary holds.
    """

    __slots__ = ("flops_per_token", "peak_flops", "slowest_link", "summary")

    def __init__(self, summary: StepSummary, flops_per_token: float | None = None,
                 peak_flops: float | None = None,
                 slowest_link: types.Spread | None = None) -> None:
        self.summary = summary
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.slowest_link = slowest_link
        """The slowest node's network round trip against the nodes' median, as the leader
        measured it when the step was merged (``membership.Cluster.links``); None with fewer
        than two other nodes, or where the kernel does not say."""

    @property
    def step(self) -> int:
        return self.summary.step

    @property
    def time(self) -> float:
        """The latest reporting rank's wall clock (``-inf`` if no rank reported)."""
        return self.summary.time

    @property
    def cursor(self) -> int:
        return self.summary.cursor

    @property
    def world_size(self) -> int:
        return self.summary.world_size

    @property
    def loss(self) -> float | None:
        return self.summary.mean_loss

    @property
    def grad_norm(self) -> float | None:
        return self.summary.max_grad_norm

    @property
    def step_time(self) -> float | None:
        return self.summary.slowest_step_time

    @property
    def slowest_forward(self) -> types.Spread | None:
        """As ``StepRecord.slowest_forward``; the median is the sketch's (within alpha)."""
        forward = self.summary.forward
        median = forward.quantile(0.5)
        if forward.count < 2 or median is None:
            return None
        return types.Spread(rank=forward.max_rank, value=forward.max, median=median,
                            count=forward.count)

    @property
    def tokens(self) -> float | None:
        return self.summary.tokens

    @property
    def samples(self) -> float | None:
        summary = self.summary
        return summary.samples if summary.n_ranks == summary.world_size else None

    @property
    def tokens_per_s(self) -> float | None:
        return types.tokens_per_s(self.tokens, self.step_time)

    @property
    def mfu(self) -> float | None:
        return types.mfu(self.tokens_per_s, self.flops_per_token, self.peak_flops,
                         self.world_size)

    def __repr__(self) -> str:
        return (f"SummaryRecord(step={self.step}, n_ranks={self.summary.n_ranks}, "
                f"loss={self.loss}, step_time={self.step_time})")
