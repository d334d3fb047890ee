"""Marks the report's time plots share: when a hang stalled the run and when a crash struck, and
spreading markers that would be drawn over each other.

A hang is drawn as a band from the attempt's last merged step before it to the moment babysit
acted on it (stacks dumped, finding journaled); a crash as a line at the moment it was found.
Both come from the journal's ``finding`` entries, so every time plot shows them the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import matplotlib.transforms as mtransforms
import numpy as np

from babysit.supervisor.commands.report.data import RunData

HANG_COLOUR = "#d62828"
CRASH_COLOUR = "#6a040f"


@dataclass(frozen=True, slots=True)
class Trouble:
    """A hang (``start`` < ``end``) or a crash (``start == end``), in Unix seconds."""

    kind: str
    start: float
    end: float
    label: str


def troubles(data: RunData) -> list[Trouble]:
    """The run's hangs and crashes, in time order, from its journal."""
    out = []
    for e in data.history.events:
        if e.get("event") != "finding" or not isinstance(e.get("time"), (int, float)):
            continue
        finding = e.get("finding") or {}
        kind = finding.get("incident")
        ranks = finding.get("ranks") or []
        who = f" (rank {', '.join(map(str, ranks))})" if ranks else ""
        t = float(e["time"])
        if kind == "hang":
            since = _last_progress(data, e.get("attempt"), finding.get("step"))
            if since is None:  # no metrics: the stall the detector measured
                stalled = (finding.get("evidence") or {}).get("stalled") or {}
                since = t - max((float(v.get("stalled_s", 0.0)) for v in stalled.values()
                                 if isinstance(v, dict)), default=0.0)
            out.append(Trouble("hang", min(since, t), t, f"hang{who}"))
        elif kind == "crash":
            out.append(Trouble("crash", t, t, f"crash{who}"))
    return sorted(out, key=lambda x: x.start)


def _last_progress(data: RunData, attempt: Any, step: Any) -> float | None:
    """When ``attempt`` merged its last step at or before ``step`` (Unix s), if it did."""
    for c in data.curves:
        if c.attempt == attempt and isinstance(step, int):
            times = c.time[(c.step <= step) & np.isfinite(c.time)]
            if len(times):
                return float(times.max())
    return None


def mark_troubles(ax: Any, data: RunData, div: float, legend: bool = True) -> None:
    """Shade each hang and draw a line at each crash on a time axis (seconds since ``data.t0``
    divided by ``div``), with their names at the bottom edge of the axes."""
    bottom = mtransforms.blended_transform_factory(ax.transData, ax.transAxes)
    named: set[str] = set()
    for t in troubles(data):
        a, b = (t.start - data.t0) / div, (t.end - data.t0) / div
        colour = HANG_COLOUR if t.kind == "hang" else CRASH_COLOUR
        name = None if (not legend or t.kind in named) else t.kind
        named.add(t.kind)
        if b > a:
            ax.axvspan(a, b, color=colour, alpha=0.12, lw=0, label=name)
        else:
            ax.axvline(a, color=colour, lw=1.6, ls="-.", label=name)
        ax.text(b, 0.02, t.label + " ", transform=bottom, fontsize=8, color=colour, ha="right",
                va="bottom")


def spread(xs: list[float], span: float, gap: float = 0.012,
           step: float = 0.2) -> list[float]:
    """Vertical offsets (in row units, centred on 0) for markers at ``xs`` on one row, so that
    markers closer than ``gap`` x ``span`` to their neighbour stack instead of overlapping."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    offsets = [0.0] * len(xs)
    group: list[int] = []
    for i in [*order, None]:
        if i is not None and group and xs[i] - xs[group[-1]] < gap * max(span, 1e-9):
            group.append(i)
            continue
        if len(group) > 1:
            limit = min(step, 0.7 / (len(group) - 1))  # a big group stays inside its row
            for k, j in enumerate(group):
                offsets[j] = (k - (len(group) - 1) / 2) * limit
        group = [i] if i is not None else []
    return offsets
