"""Silent data corruption: ranks that must compute the same bits disagree.

Every few steps each rank sends digests of things that are identical on every healthy replica,
as a ``dict[str, str]`` of hex digests, e.g. ``{"params": "9f..", "probe": "31.."}`` (the worker
side is ``supervisor/rank/fingerprint.py``): the parameters after the optimizer step (data parallel
replicas hold the same bits) and a probe, a fixed computation on fixed inputs that a healthy
device always answers the same way. This module only compares them; it never sees a tensor.

How a check is decided, once every rank of ``world_size`` has reported its step:

- only keys that every rank sent are compared across ranks (some models send fewer);
- per key, the value held by a strict majority of ranks is the truth, and the ranks outside it
  are named (rule ``majority``);
- keys in ``self_check_keys`` (the probe) must also never change on one device: a rank whose
  value differs from its first one is named, majority or not (rule ``self``). That is how a
  two-rank job names its bad GPU. A rank's first value is the first it shared with a strict
  majority of the ranks, so a device wrong from its first probe on is named by the vote
  instead, and a healthy replacement for it is not mistaken for a changed probe;
- a key split with no strict majority (two ranks that differ; 2 against 2) that the ``self``
  rule does not explain names every rank (rule ``no_majority``): with two ranks the faulty one
  cannot be told apart by vote, and the message says so.

A check that names nobody, having compared at least one key across ranks, is an agreeing check.
A check that names ranks is one CRITICAL finding with ``step`` = the check's step and
``onset_step`` = the newest agreeing check before it + 1 (1 when none agreed): the corruption
happened after the last moment the replicas were known to agree, so rollback must go to a
checkpoint no newer than that. Further disagreeing checks of the same attempt that name no new
rank are not reported again (the first one already asked for the remedy); an agreeing check or
``new_attempt()`` re-arms.

Memory is bounded: a check completes when all ranks reported its step; incomplete checks older
than the newest complete one are dropped (a rank that died mid-check will never send it), and at
most ``max_pending`` incomplete checks are kept.

Calling rules: call ``observe`` for every rank's digests as they arrive, in any order across
ranks but in step order per rank; call ``new_attempt()`` when the workers are relaunched (the
new attempt replays steps the old one already checked, and its checks must not be mixed with
the old attempt's). Pure: no I/O, no clock. Digests are opaque strings, compared for equality
and shown by their first 16 characters.
"""

from __future__ import annotations

import bisect
from collections import Counter
from typing import Any

from pydantic import Field

from babysit.policies.detectors._base import DetectorConfig
from babysit.policies.types import Finding, Incident, Severity
from babysit.policies.wording import ranks_doing

_SHORT = 16
"""Characters of a digest shown in evidence and messages (64 bits: plenty to tell them apart)."""
_AGREED_MEMORY = 1024
"""Agreeing check steps remembered, to find the last agreement before a disagreement."""


class SdcConfig(DetectorConfig):
    self_check_keys: tuple[str, ...] = ("probe",)
    """Digest keys that must never change on a healthy device (a fixed computation on fixed
    inputs): a rank whose value differs from its first one (the first it shared with a strict
    majority of the ranks) is named even without a majority."""
    max_pending: int = Field(default=8, ge=1, le=1000)
    """Incomplete checks kept while waiting for every rank's digests; older ones are dropped."""


def _short(digest: str) -> str:
    return digest[:_SHORT]


class SdcDetector:
    """Compares per-rank digests and names the ranks that disagree; see the module docstring."""

    name = "sdc"

    def __init__(self, config: SdcConfig | None = None) -> None:
        self.config = config or SdcConfig()
        self._world: int | None = None
        self._pending: dict[int, dict[int, dict[str, str]]] = {}
        self._first: dict[int, dict[str, str]] = {}
        self._agreed: list[int] = []
        self._checked: int | None = None
        self._named: set[int] | None = None
        self._fresh = False

    @property
    def last_agreeing_step(self) -> int | None:
        """The newest check step at which every rank agreed (None before the first)."""
        return self._agreed[-1] if self._agreed else None

    @property
    def checked_step(self) -> int | None:
        """The step of the newest completed check of this attempt (None before the first): it
        changes exactly when an ``observe`` call completed a check."""
        return self._checked

    def new_attempt(self) -> None:
        """The workers were relaunched: drop incomplete checks, re-arm, and forget agreements
        at or after the first step the new attempt checks (that future was abandoned). Each
        rank's first probe is kept: it belongs to the device, not to the attempt."""
        self._pending.clear()
        self._checked = None
        self._named = None
        self._fresh = True

    def observe(self, rank: int, step: int, digests: dict[str, str],
                world_size: int) -> Finding | None:
        """One rank's digests for the check at ``step``; a finding once the check is complete
        and some rank disagrees."""
        if world_size != self._world:
            # Another world means other devices behind the ranks: first probes no longer apply.
            self._world = world_size
            self._pending.clear()
            self._first.clear()
            self._checked = None
            self._named = None
        if not 0 <= rank < world_size:
            return None
        if self._fresh:
            self._fresh = False
            del self._agreed[bisect.bisect_left(self._agreed, step):]
        if self._checked is not None and step <= self._checked:
            return None  # a check already decided, or dropped as incomplete
        check = self._pending.setdefault(step, {})
        check[rank] = {str(k): str(v) for k, v in digests.items()}
        while len(self._pending) > self.config.max_pending:
            del self._pending[min(self._pending)]
        if len(check) < world_size:
            return None
        for s in [s for s in self._pending if s <= step]:
            del self._pending[s]
        self._checked = step
        return self._compare(step, check, world_size)

    def _compare(self, step: int, check: dict[int, dict[str, str]],
                 world_size: int) -> Finding | None:
        ranks = sorted(check)
        common = sorted(set.intersection(*(set(check[r]) for r in ranks)))
        changed = self._self_check(check)
        named: set[int] = set(changed)
        rules: list[str] = ["self"] if changed else []
        split: list[str] = []
        why: list[str] = []
        for key in common:
            values = {r: check[r][key] for r in ranks}
            counts = Counter(values.values())
            if len(counts) == 1:
                continue
            split.append(key)
            top, n = counts.most_common(1)[0]
            if 2 * n > len(ranks):
                minority = [r for r in ranks if values[r] != top]
                named.update(minority)
                rules.append("majority")
                why.append(f"{key}: {ranks_doing(minority, 'differs', 'differ')} from the "
                           f"majority of {n}/{len(ranks)}")
                continue
            rest = {values[r] for r in ranks if r not in changed}
            if changed and len(rest) <= 1:
                why.append(f"{key}: no majority, explained by the ranks whose own probe "
                           "changed")
                continue
            named.update(ranks)
            rules.append("no_majority")
            msg = f"{key}: no majority among {len(ranks)} ranks"
            if len(ranks) == 2:
                msg += "; with 2 ranks the faulty one cannot be told apart by vote"
            why.append(msg)
        why[:0] = [f"rank {r}'s {key} {_short(now)} differs from its own first {_short(was)}: "
                   "a fixed computation gave another answer"
                   for r, keys in sorted(changed.items()) for key, (was, now) in keys.items()]
        if not named:
            if common:
                self._agree(step)
            return None
        if self._named is not None and named <= self._named:
            return None
        self._named = (self._named or set()) | named
        before = [s for s in self._agreed if s < step]
        last = before[-1] if before else None
        self_keys = {k for keys in changed.values() for k in keys}
        shown = sorted(set(common) | self_keys)
        return Finding(
            incident=Incident.SDC,
            detector=self.name,
            severity=Severity.CRITICAL,
            step=step,
            onset_step=(last or 0) + 1,
            ranks=tuple(sorted(named)),
            message=f"silent data corruption suspected at check step {step}: "
            f"{ranks_doing(named, 'disagrees', 'disagree')} ({'; '.join(why)}); last agreeing "
            f"check: {'none' if last is None else f'step {last}'}",
            evidence={
                "check_step": step,
                "last_agreeing_step": last,
                "rules": sorted(set(rules)),
                "keys": sorted(set(split) | self_keys),
                "digests": {k: {str(r): _short(check[r][k]) for r in ranks if k in check[r]}
                            for k in shown},
                "self_changed": {str(r): {k: {"first": _short(was), "now": _short(now)}
                                          for k, (was, now) in keys.items()}
                                 for r, keys in sorted(changed.items())},
                "world_size": world_size,
            },
        )

    def _self_check(self, check: dict[int, dict[str, str]]
                    ) -> dict[int, dict[str, tuple[str, str]]]:
        """Ranks whose self-check keys changed: ``{rank: {key: (first, now)}}``.

        A rank's first value is learnt only from a check where it matched the strict majority
        of the ranks that sent the key, so a device that was wrong from its first probe on does
        not make its wrong answer the reference (the vote names it instead), and a healthy
        replacement for it after a relaunch is not taken for a changed probe."""
        changed: dict[int, dict[str, tuple[str, str]]] = {}
        for key in self.config.self_check_keys:
            values = {r: d[key] for r, d in check.items() if key in d}
            if not values:
                continue
            top, n = Counter(values.values()).most_common(1)[0]
            for r, value in values.items():
                first = self._first.setdefault(r, {})
                was = first.get(key)
                if was is None:
                    if 2 * n > len(values) and value == top:
                        first[key] = value
                elif value != was:
                    changed.setdefault(r, {})[key] = (was, value)
        return changed

    def _agree(self, step: int) -> None:
        self._named = None
        agreed = self._agreed
        if not agreed or step > agreed[-1]:
            agreed.append(step)
        elif step not in agreed:
            bisect.insort(agreed, step)
        del agreed[:-_AGREED_MEMORY]

    def state_dict(self) -> dict[str, Any]:
        return {
            "world": self._world,
            "pending": {str(s): {str(r): dict(d) for r, d in c.items()}
                        for s, c in self._pending.items()},
            "first": {str(r): dict(d) for r, d in self._first.items()},
            "agreed": list(self._agreed),
            "checked": self._checked,
            "named": None if self._named is None else sorted(self._named),
            "fresh": self._fresh,
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self._world = d["world"]
        self._pending = {int(s): {int(r): dict(dg) for r, dg in c.items()}
                         for s, c in d["pending"].items()}
        self._first = {int(r): dict(dg) for r, dg in d["first"].items()}
        self._agreed = [int(s) for s in d["agreed"]]
        self._checked = d["checked"]
        self._named = None if d["named"] is None else {int(r) for r in d["named"]}
        self._fresh = bool(d["fresh"])
