"""The report's goodput section: a stacked bar per attempt (``goodput.png``) and a table of the
ledger's categories, from ``snapshot()['goodput']`` (``babysit.supervisor.services.goodput``).
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

from babysit.supervisor.commands.report.plots import WIDTH, _save  # (sets the Agg backend)
from babysit.supervisor.commands.status import duration, goodput_line

COLOURS = {"productive": "#2a9d8f", "startup": "#8ecae6", "checkpoint": "#e9c46a",
           "restore": "#f4a261", "detection": "#d62828", "lost": "#9b5de5",
           "relaunch": "#1f77b4", "backoff": "#adb5bd", "down": "#343a40",
           "straggler": "#ff9f1c", "shutdown": "#90be6d", "other": "#dee2e6"}
MEANING = {
    "productive": "steps the final model builds on",
    "startup": "the run's start to its first step",
    "checkpoint": "training stalled on checkpoint saves",
    "restore": "loading the checkpoint a relaunch resumed from",
    "detection": "last step before a fault to babysit's finding",
    "lost": "steps a later attempt trained again (rollback, crash)",
    "relaunch": "stopping the workers and starting the next attempt",
    "backoff": "the policy's wait before a relaunch",
    "down": "no babysitter running (before a takeover)",
    "straggler": "one rank's slow loader or compute holding the step",
    "shutdown": "after the last step: closing, exiting, a stop on request",
    "other": "not attributed (a vanished supervisor's tail; live: the step running)",
}


def plot_goodput(ledger: dict[str, Any] | None, path: Path) -> bool:
    """One horizontal bar per attempt, its wall time stacked by category (seconds); False when
    the ledger covers no time."""
    if not ledger or not ledger.get("wall_s") or not ledger.get("attempts"):
        return False
    attempts = ledger["attempts"]
    fig, ax = plt.subplots(figsize=(WIDTH, 1.2 + 0.45 * len(attempts)))
    labels = [f"attempt {a['attempt']}" for a in attempts]
    left = [0.0] * len(attempts)
    for category, colour in COLOURS.items():
        widths = [max(0.0, a["seconds"].get(category, 0.0)) for a in attempts]
        if not any(w > 0 for w in widths):
            continue
        ax.barh(labels, widths, left=left, color=colour, label=category,
                edgecolor="white", linewidth=0.5)
        left = [x + w for x, w in zip(left, widths, strict=True)]
    ax.invert_yaxis()  # attempt 0 on top, as in the tables
    ax.set_xlabel("wall-clock seconds")
    ax.set_title(f"Where the time went: {100 * ledger['goodput']:.1f}% of "
                 f"{duration(ledger['wall_s'])} productive", fontsize=10, loc="left")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    _save(fig, path)
    return True


def section(ledger: dict[str, Any] | None, figure: str | None) -> str:
    """The page's "Goodput" section: the figure (its path relative to the page) and a table."""
    if not ledger or not ledger.get("wall_s"):
        return ""
    wall = ledger["wall_s"]
    rows = "\n".join(
        f"<tr><td>{html.escape(k)}</td><td>{duration(v)}</td><td>{100 * v / wall:.1f}%</td>"
        f"<td class='muted'>{html.escape(MEANING.get(k, ''))}</td></tr>"
        for k, v in ledger["seconds"].items() if v > 0 or k == "productive")
    img = (f"<figure><img src='{html.escape(figure)}' alt='goodput'><figcaption class='muted'>"
           f"Each attempt's wall time by category, from its launch to the next one (its "
           f"start-up, its steps, then the detection, stopping and backoff that ended it; the "
           f"run's start counts for the first). A step a later attempt trained again counts as "
           f"lost in the attempt that first ran it.</figcaption></figure>") if figure else ""
    return (f"<h2>Goodput</h2><p>{html.escape(goodput_line(ledger))}. The categories sum to "
            f"the wall time; see docs/monitoring.md for each one's exact rule.</p>{img}"
            f"<table><tr><th>category</th><th>time</th><th>share</th><th>what</th></tr>"
            f"{rows}</table>")
