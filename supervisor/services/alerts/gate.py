"""Which alerts a sink lets through: de-duplication and rate limiting, as pure logic.

No threads, no clock of its own, no I/O: the caller passes ``now`` (seconds on any monotonic
clock), so every rule here is tested by stepping a number instead of sleeping.

The rules, in the order they apply to one alert on one sink:

1. Duplicate: the same key was *sent* less than ``dedup_window_s`` ago -> suppressed and counted.
   The window runs from the last send, not the last sighting, so a condition that keeps firing
   is re-announced once per window (a reminder) instead of being silenced for good.
2. Rate limit: ``max_alerts`` were already sent within the last ``window_s`` (sliding) -> dropped
   and counted. A rate-limited alert does not mark its key as sent, so it is not then also treated
   as a duplicate: the human never saw it.
3. Otherwise it is sent. The decision carries the counts suppressed since the previous send, so the
   sender can add "N alerts suppressed" to the message that finally goes out.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass


class GateVerdict(str, enum.Enum):
    """What the gate decided for one alert."""

    SEND = "send"
    DUPLICATE = "suppressed"
    RATE_LIMITED = "rate_limited"


@dataclass(frozen=True, slots=True)
class GateDecision:
    """The gate's answer for one alert.

    For ``SEND``: ``duplicates`` is how many alerts with this key were suppressed since this key's
    previous send, ``rate_limited`` how many alerts of any key were dropped by the rate limit since
    the sink's previous send. For ``DUPLICATE``: ``duplicates`` counts this one too. For
    ``RATE_LIMITED``: ``rate_limited`` counts this one too.
    """

    verdict: GateVerdict
    duplicates: int = 0
    rate_limited: int = 0


class SinkGate:
    """Dedup and rate-limit state for one sink. Not thread-safe: one owner thread calls ``admit``.

    ``dedup_window_s <= 0`` disables de-duplication. Calls must pass non-decreasing ``now``.
    Memory stays bounded: the rate window holds at most ``max_alerts`` timestamps, and keys are
    pruned of expired ones past ``_MAX_KEYS`` (unexpired keys are few: each one was a send, and
    sends are rate limited).
    """

    _MAX_KEYS = 4096
    """Above this many remembered keys, expired ones are forgotten (with their counts)."""

    def __init__(self, *, dedup_window_s: float, max_alerts: int, window_s: float) -> None:
        if max_alerts < 1:
            raise ValueError(f"max_alerts must be at least 1, got {max_alerts}")
        self._dedup_window_s = dedup_window_s
        self._max_alerts = max_alerts
        self._window_s = window_s
        # An expired entry is kept (until the table grows past _MAX_KEYS) so that the key's next
        # send can report how many repeats were suppressed.
        self._keys: dict[str, _Seen] = {}
        self._recent: deque[float] = deque()  # send times within the rate window
        self._rate_limited = 0  # dropped since the last send

    def admit(self, key: str, now: float) -> GateDecision:
        """Decide one alert with dedup key ``key`` arriving at ``now``; updates the state."""
        while self._recent and self._recent[0] <= now - self._window_s:
            self._recent.popleft()
        entry = self._keys.get(key)
        if entry is not None and now - entry.sent_at < self._dedup_window_s:
            entry.suppressed += 1
            return GateDecision(GateVerdict.DUPLICATE, duplicates=entry.suppressed)
        if len(self._recent) >= self._max_alerts:
            self._rate_limited += 1
            return GateDecision(GateVerdict.RATE_LIMITED, rate_limited=self._rate_limited)
        duplicates = entry.suppressed if entry is not None else 0
        rate_limited, self._rate_limited = self._rate_limited, 0
        self._recent.append(now)
        if self._dedup_window_s > 0:
            self._keys.pop(key, None)  # re-insert last: the table stays ordered by send time
            self._keys[key] = _Seen(sent_at=now)
            if len(self._keys) > self._MAX_KEYS:
                self._forget_expired(now)
        return GateDecision(GateVerdict.SEND, duplicates=duplicates, rate_limited=rate_limited)

    def _forget_expired(self, now: float) -> None:
        window = self._dedup_window_s
        for key in [k for k, seen in self._keys.items() if now - seen.sent_at >= window]:
            del self._keys[key]


@dataclass(slots=True)
class _Seen:
    sent_at: float
    """When this key was last sent (the caller's clock)."""
    suppressed: int = 0
    """Duplicates of it suppressed since then."""
