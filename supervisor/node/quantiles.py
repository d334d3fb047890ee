"""Quantiles of a step's values over thousands of ranks, in memory that does not grow with them:
a relative-error sketch (DDSketch). ``node.sketch.StepStats`` keeps one per signal.

Pure logic, stdlib only.
"""

from __future__ import annotations

import math
from typing import Any

DEFAULT_ALPHA = 0.005
DEFAULT_MAX_BUCKETS = 2048
DEFAULT_MIN_VALUE = 1e-9
MAX_RANKS = 1 << 20
"""Largest rank a summary read from the network may name (a summary holds a byte per rank)."""


class QuantileSketch:
    """A relative-error quantile sketch (DDSketch: Masson, Rim and Lee, VLDB 2019).

    **Guarantee.** Let ``x_q`` be the exact q-quantile of the values added, defined as the
    element of rank ``floor(q * (n - 1))`` (0-based) in sorted order. Then
    ``|quantile(q) - x_q| <= alpha * |x_q|``, for every q, whatever the distribution, as long as
    (a) ``|x_q| >= min_value`` (smaller magnitudes share the zero bucket: absolute error below
    ``min_value``) and (b) ``x_q`` lies above the collapsed low tail (see memory below).
    Exact quantiles that interpolate between neighbours (numpy's default) can differ from
    ``x_q`` by the gap between two neighbouring values; on a few hundred values or more of a
    continuous signal that gap is far below alpha.

    **How.** A positive value ``x`` goes to bucket ``i = ceil(log(x) / log(gamma))`` with
    ``gamma = (1 + alpha) / (1 - alpha)``; the bucket covers ``(gamma**(i-1), gamma**i]`` and
    answers ``2 * gamma**i / (gamma + 1)``, within ``alpha`` of anything in it. Negative values
    mirror the positive ones; near-zero values have one bucket. Buckets hold counts only.

    **Memory.** At most ``max_buckets`` buckets: with alpha = 0.005 that covers values spread
    over a factor ``gamma ** 2048`` (about 8e8) before anything is lost, where step times spread
    over a factor of a few and use a few hundred. Past the cap the lowest buckets (in value
    order) are folded into the lowest bucket kept, so the high quantiles, the ones an operator
    asks about (p99 step time), keep the guarantee and the folded low tail reads high.
    ``collapsed`` says whether that ever happened. Folding keeps the sketch mergeable:
    the kept buckets are always the ``max_buckets`` highest ever seen, whatever the order.

    Calling rules: ``add`` finite values only (``ValueError`` otherwise; ``StepStats`` counts
    non-finite values for you). ``merge`` needs the same ``alpha``, ``max_buckets`` and
    ``min_value``.
    """

    __slots__ = ("_buckets", "_floor", "_gamma", "_inv_log_gamma", "_offset", "alpha",
                 "collapsed", "count", "max_buckets", "min_value")

    def __init__(self, alpha: float = DEFAULT_ALPHA, max_buckets: int = DEFAULT_MAX_BUCKETS,
                 min_value: float = DEFAULT_MIN_VALUE) -> None:
        if not 0.0 < alpha < 1.0:
            raise ValueError(f"alpha must be in (0, 1), got {alpha}")
        if max_buckets < 2:
            raise ValueError(f"max_buckets must be at least 2, got {max_buckets}")
        if not min_value > 0.0:
            raise ValueError(f"min_value must be positive, got {min_value}")
        self.alpha = alpha
        self.max_buckets = max_buckets
        self.min_value = min_value
        self._gamma = (1.0 + alpha) / (1.0 - alpha)
        self._inv_log_gamma = 1.0 / math.log(self._gamma)
        # Keys are ordered like values: 0 is the zero bucket, k > 0 positive buckets, -k their
        # mirror. ``_offset`` makes the smallest positive bucket key 1.
        self._offset = 1 - math.ceil(math.log(min_value) * self._inv_log_gamma)
        self._buckets: dict[int, int] = {}
        self._floor: int | None = None  # set once folded: keys below go to this bucket
        self.count = 0
        self.collapsed = False

    def _key(self, value: float) -> int:
        if value > self.min_value:
            return math.ceil(math.log(value) * self._inv_log_gamma) + self._offset
        if value < -self.min_value:
            return -(math.ceil(math.log(-value) * self._inv_log_gamma) + self._offset)
        return 0

    def _value(self, key: int) -> float:
        if key == 0:
            return 0.0
        index = abs(key) - self._offset
        magnitude = 2.0 * self._gamma ** index / (self._gamma + 1.0)
        return magnitude if key > 0 else -magnitude

    def add(self, value: float, count: int = 1) -> None:
        """Count ``value`` (``count`` times). Raises ``ValueError`` if it is NaN or infinite."""
        # The positive branch of ``_key`` inlined: step times are positive, and this runs once
        # per rank, signal and step.
        if value > self.min_value and value != math.inf:
            key = math.ceil(math.log(value) * self._inv_log_gamma) + self._offset
        elif math.isfinite(value):
            key = self._key(value)
        else:
            raise ValueError(f"QuantileSketch.add takes finite values, got {value}")
        if self._floor is not None and key < self._floor:
            key = self._floor
        buckets = self._buckets
        buckets[key] = buckets.get(key, 0) + count
        self.count += count
        if len(buckets) > self.max_buckets:
            self._fold()

    def _fold(self) -> None:
        keys = sorted(self._buckets)
        excess = len(keys) - self.max_buckets
        floor = keys[excess]
        for key in keys[:excess]:
            self._buckets[floor] += self._buckets.pop(key)
        self._floor = floor
        self.collapsed = True

    def merge(self, other: QuantileSketch) -> None:
        """Add everything ``other`` counted. Equal to having added its values here."""
        if (other.alpha, other.max_buckets, other.min_value) != (
                self.alpha, self.max_buckets, self.min_value):
            raise ValueError("cannot merge sketches with different alpha, max_buckets or "
                             "min_value")
        floors = [f for f in (self._floor, other._floor) if f is not None]
        floor = max(floors) if floors else None
        merged = dict(self._buckets)
        for key, n in other._buckets.items():
            merged[key] = merged.get(key, 0) + n
        if floor is not None:
            for key in [k for k in merged if k < floor]:
                merged[floor] = merged.get(floor, 0) + merged.pop(key)
        self._buckets = merged
        self._floor = floor
        self.count += other.count
        self.collapsed = self.collapsed or other.collapsed
        if len(merged) > self.max_buckets:
            self._fold()

    def quantile(self, q: float) -> float | None:
        """The q-quantile (0 <= q <= 1) within the guarantee above; ``None`` when empty."""
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"q must be in [0, 1], got {q}")
        if self.count == 0:
            return None
        rank = math.floor(q * (self.count - 1))
        seen = 0
        for key in sorted(self._buckets):
            seen += self._buckets[key]
            if seen > rank:
                return self._value(key)
        raise AssertionError("unreachable: bucket counts add up to count")

    @property
    def buckets(self) -> int:
        """Number of buckets in use (never more than ``max_buckets``)."""
        return len(self._buckets)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready state; ``from_dict`` restores an equal sketch."""
        return {
            "alpha": self.alpha, "max_buckets": self.max_buckets, "min_value": self.min_value,
            "count": self.count, "collapsed": self.collapsed, "floor": self._floor,
            "buckets": [[k, n] for k, n in sorted(self._buckets.items())],
        }

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> QuantileSketch:
        sketch = cls(state["alpha"], state["max_buckets"], state["min_value"])
        sketch._buckets = {int(k): int(n) for k, n in state["buckets"]}
        sketch._floor = state["floor"]
        sketch.count = int(state["count"])
        sketch.collapsed = bool(state["collapsed"])
        return sketch

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, QuantileSketch):
            return NotImplemented
        return self.to_dict() == other.to_dict()

    __hash__ = None  # type: ignore[assignment]
