"""The run's one history of states: every kept state belongs to a timeline, and timelines fork.

A step number alone does not name a state: after a rollback to step 200 the run trains steps
201, 202, ... again, and the states the abandoned run kept past 200 carry the same numbers as
the ones the new run keeps. So each launch begins a **timeline**, forked from the state it
resumes from (that state's timeline, at its step; from scratch: a root), and every state babysit
keeps records the timeline it was made in (``Manifest.timeline``): periodic checkpoints, the
final one, just-in-time state, memory copies and a framework's own checkpoints alike.

The current timeline's **chain** is the path back to its root: ``(current, None), (parent,
fork of current), (grandparent, fork of parent), ...``. A state ``(timeline t, step s)`` is
**live** when a link of the chain holds it: ``t`` is that link's timeline and ``s`` is at or
before the link's limit (the current timeline has none). Every other state is **fenced**: a
rollback abandoned it (its timeline forked off before it), so it is never chosen, by a relaunch
or a takeover, it goes first in retention, and its memory copies are swept from the nodes'
shared memory at the next launch (``memory_copy.sweep``).

Two kinds of states stand apart: one that records no timeline (written by a babysit that had
none, or by a script's own ``register_external`` outside any run) is taken as live, as before;
one whose timeline this record does not know was made by another run sharing the folder: never
chosen, never deleted.

The record is ``<checkpoint root>/lineage.json``, written atomically by the supervisor at each
launch (the only writer), before the launch's ranks start; ranks and the supervisor's own
commits read the current timeline from it, or from the directive. Torch-free.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from babysit.checkpoints._atomic import atomic_write_json
from babysit.checkpoints.layout import LINEAGE_NAME

_FORMAT = 1

Chain = tuple[tuple[str, "int | None"], ...]
"""The current timeline's path to its root: ``(timeline, limit)`` links, the current first
(limit None: all of it), each next one its parent up to the step it forked at."""


@dataclass(frozen=True, slots=True)
class Timeline:
    """One launch's history: the timeline it forked from (None: a root, trained from scratch
    or from a state of unknown lineage) and the step of the state it resumed from."""

    id: str
    parent: str | None
    fork_step: int
    attempt: int
    created: float = field(default_factory=time.time)


@dataclass(frozen=True, slots=True)
class Lineage:
    """Every timeline of the run, oldest first, and the current one (None: no launch recorded,
    every state is live)."""

    timelines: tuple[Timeline, ...] = ()
    current: str | None = None

    def get(self, timeline: str | None) -> Timeline | None:
        return next((t for t in self.timelines if t.id == timeline), None)

    def chain(self) -> Chain:
        """The current timeline's links back to its root (empty: no lineage recorded)."""
        links: list[tuple[str, int | None]] = []
        limit: int | None = None
        seen: set[str] = set()
        at = self.get(self.current)
        while at is not None and at.id not in seen:
            seen.add(at.id)
            links.append((at.id, limit))
            limit = at.fork_step if limit is None else min(limit, at.fork_step)
            at = self.get(at.parent)
        return tuple(links)

    def live(self, timeline: str | None, step: int) -> bool:
        """Whether the state ``(timeline, step)`` is on the current timeline's chain."""
        return live(self.chain(), timeline, step)

    def known(self, timeline: str | None) -> bool:
        """Whether ``timeline`` is this run's (a state of an unknown one is another run's)."""
        return timeline is None or not self.timelines or self.get(timeline) is not None

    def begin(self, parent: str | None, fork_step: int, attempt: int) -> Lineage:
        """A new timeline, forked from ``parent`` at ``fork_step``, made current."""
        tid = uuid.uuid4().hex[:12]
        if parent is not None and self.get(parent) is None:
            parent = None  # a state of unknown lineage: the new timeline is a root
        new = Timeline(tid, parent, max(0, fork_step), attempt)
        return Lineage((*self.timelines, new), tid)


def live(chain: Chain, timeline: str | None, step: int) -> bool:
    """Whether the state ``(timeline, step)`` is live on ``chain`` (empty: all are). A state
    that records no timeline is live; see the module docstring."""
    if not chain or timeline is None:
        return True
    for tid, limit in chain:
        if tid == timeline:
            return limit is None or step <= limit
    return False


def read(root: str | Path) -> Lineage:
    """The lineage recorded under ``root`` (an empty one when there is none, or it is
    unreadable: then every state is live, as before lineage was kept)."""
    try:
        raw = json.loads((Path(root) / LINEAGE_NAME).read_text())
    except (OSError, ValueError):
        return Lineage()
    if not isinstance(raw, dict) or raw.get("format") != _FORMAT:
        return Lineage()
    try:
        timelines = tuple(Timeline(str(t["id"]), None if t.get("parent") is None
                                   else str(t["parent"]), int(t["fork_step"]),
                                   int(t.get("attempt", 0)), float(t.get("created", 0.0)))
                          for t in raw.get("timelines", ()))
    except (KeyError, TypeError, ValueError):
        return Lineage()
    current = raw.get("current")
    return Lineage(timelines, None if current is None else str(current))


def write(root: str | Path, lineage: Lineage) -> None:
    Path(root).mkdir(parents=True, exist_ok=True)
    atomic_write_json(Path(root) / LINEAGE_NAME, {
        "format": _FORMAT, "current": lineage.current,
        "timelines": [asdict(t) for t in lineage.timelines]})


def begin(root: str | Path, parent: str | None, fork_step: int, attempt: int) -> Lineage:
    """Record a new timeline under ``root`` (see ``Lineage.begin``); the lineage now."""
    lineage = read(root).begin(parent, fork_step, attempt)
    write(root, lineage)
    return lineage


def current(root: str | Path | None) -> str | None:
    """The current timeline recorded under ``root`` (None: none recorded)."""
    return None if root is None else read(root).current
