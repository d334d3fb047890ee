"""A bounded window of recent values kept sorted, for O(window) medians and quantiles.

Detectors keep a few hundred numbers at most, so a sorted list with ``bisect`` beats anything
cleverer: insertion and eviction are a ``memmove`` of at most ``size`` floats, and every order
statistic is an index away. No numpy, so the worker can use it in its training loop.
"""

from __future__ import annotations

import bisect
from collections import deque
from typing import Any


class SortedWindow:
    """The last ``size`` values pushed, in arrival order and in sorted order.

    Only finite floats may be pushed; callers filter non-finite values first (they are findings,
    not baseline).
    """

    __slots__ = ("_fifo", "_sorted", "size")

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"window size must be >= 1, got {size}")
        self.size = size
        self._fifo: deque[float] = deque()
        self._sorted: list[float] = []

    def __len__(self) -> int:
        return len(self._fifo)

    def push(self, value: float) -> None:
        fifo, srt = self._fifo, self._sorted
        if len(fifo) == self.size:
            del srt[bisect.bisect_left(srt, fifo.popleft())]
        fifo.append(value)
        bisect.insort(srt, value)

    def clear(self) -> None:
        self._fifo.clear()
        self._sorted.clear()

    def last(self) -> float:
        return self._fifo[-1]

    def quantile(self, q: float) -> float:
        """Linear-interpolated quantile, ``q`` in [0, 1]. The window must not be empty."""
        s = self._sorted
        pos = q * (len(s) - 1)
        lo = int(pos)
        if lo + 1 >= len(s):
            return s[-1]
        frac = pos - lo
        return s[lo] + (s[lo + 1] - s[lo]) * frac

    def median(self) -> float:
        s = self._sorted
        n = len(s)
        mid = n // 2
        return s[mid] if n % 2 else 0.5 * (s[mid - 1] + s[mid])

    def iqr_sigma(self) -> float:
        """Robust standard deviation from the interquartile range (exact for a normal law).

        Cheaper than the MAD (no second sort) and as robust for the < 25 % contamination that a
        baseline which already keeps flagged values out will see.
        """
        return (self.quantile(0.75) - self.quantile(0.25)) / 1.3489795

    def state_dict(self) -> dict[str, Any]:
        return {"size": self.size, "values": list(self._fifo)}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.size = int(d["size"])
        self.clear()
        for v in d["values"]:
            self.push(float(v))
