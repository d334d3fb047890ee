"""The numbers a script reports besides the step's own (``run.step(scalars={...})``: eval loss,
accuracy...), read from the journal's ``worker_scalars`` entries and drawn by step.

Values of one name at one step are averaged over the ranks that sent them (rank 0 alone is the
usual case). One panel per name, the first ``MAX_PANELS`` names in the order they first came.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

from babysit.supervisor.commands.report import plots
from babysit.supervisor.commands.report.data import RunData

MAX_PANELS = 6

Series = dict[str, dict[int, dict[int, float]]]
"""name -> attempt -> step -> value."""


def series(data: RunData) -> Series:
    """Every reported scalar, by name, attempt and step (mean over the ranks that sent it)."""
    sums: dict[str, dict[int, dict[int, list[float]]]] = {}
    for e in data.history.events:
        if e.get("event") != "worker_scalars":
            continue
        body = e.get("data") or {}
        step, values, attempt = body.get("step"), body.get("values"), e.get("attempt")
        if not isinstance(step, int) or not isinstance(values, dict):
            continue
        for name, value in values.items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                per = sums.setdefault(str(name), {}).setdefault(
                    attempt if isinstance(attempt, int) else -1, {})
                per.setdefault(step, []).append(float(value))
    return {name: {a: {s: sum(v) / len(v) for s, v in sorted(steps.items())}
                   for a, steps in sorted(by_attempt.items())}
            for name, by_attempt in sums.items()}


def plot_scalars(data: RunData, path: Path) -> bool:
    """The script's extra scalars by step, one colour per attempt, with the incidents that
    ended attempts and the skipped batches marked as on the training plot."""
    found = series(data)
    if not found:
        return False
    names = list(found)[:MAX_PANELS]
    fig, axes = plt.subplots(len(names), 1, sharex=True, squeeze=False, layout="constrained",
                             figsize=(plots.WIDTH, 1.4 + 2.0 * len(names)))
    axs: list[Any] = list(axes[:, 0])
    for ax, name in zip(axs, names, strict=True):
        for attempt, points in found[name].items():
            ax.plot(list(points), list(points.values()), marker="o", ms=3, lw=1.2,
                    color=plots._colour(attempt),
                    label=plots._attempt_label(data, attempt) if ax is axs[0] else None)
        ax.set_ylabel(name.replace("_", " "))
        ax.grid(True, alpha=0.3)
        plots._draw_skips(ax, data, first=ax is axs[0])
        plots._draw_interventions(ax, data, first=ax is axs[0])
    axs[-1].set_xlabel("optimizer step")
    shown = "" if len(found) <= MAX_PANELS else f" (first {MAX_PANELS} of {len(found)})"
    axs[0].set_title(f"{plots._name(data)}: scalars the script reported{shown}", loc="left",
                     pad=16)
    axs[0].legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    plots._save(fig, path)
    return True

