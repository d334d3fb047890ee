"""The report's three figures, drawn with matplotlib's Agg backend (no display needed).

Each ``plot_*`` function takes a ``RunData`` and a PNG path, writes the file and returns True, or
returns False when the run has nothing to draw (no metrics: a script without the worker API).
Legends sit outside the axes so they never cover data; every axis says what and in which unit.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # before pyplot: never look for a display

import matplotlib.pyplot as plt
import matplotlib.transforms as mtransforms
import numpy as np

from supervisor.report.data import Curve, Floats, RunData

DPI = 110
WIDTH = 11.0
MAX_POINTS = 20_000  # per line; more only slows drawing, a 1,100-pixel-wide figure can't show it
SMOOTH_FROM = 300  # points per line beyond which a rolling median is drawn over the raw values
HEATMAP_RANKS = 9  # from this many ranks on, lines per rank are unreadable: draw a heatmap
ACTION_COLOURS = {"ignore": "#b0b0b0", "set_aside": "#d9d9d9", "alert": "#ff9f1c",
                  "skip_step": "#e9c46a", "relaunch": "#1f77b4", "rollback": "#9b5de5",
                  "stop": "#d62828"}
# The tab10 palette: ten colours that stay apart for colour-blind readers too.
ATTEMPT_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
                   "#7f7f7f", "#bcbd22", "#17becf")


def _colour(attempt: int) -> Any:
    return ATTEMPT_COLOURS[attempt % len(ATTEMPT_COLOURS)]


def _stride(n: int) -> int:
    return max(1, math.ceil(n / MAX_POINTS))


def _wants_log(values: Floats) -> bool:
    """Log scale when the positive finite values span more than a decade and a half."""
    v = values[np.isfinite(values) & (values > 0)]
    return len(v) > 1 and bool(np.log10(v.max()) - np.log10(v.min()) > 1.5)


def _time_axis(seconds: float) -> tuple[float, str]:
    """Divisor and label for a time axis that spans ``seconds``."""
    if seconds > 3 * 3600:
        return 3600.0, "time since start (h)"
    if seconds > 600:
        return 60.0, "time since start (min)"
    return 1.0, "time since start (s)"


def _save(fig: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def _attempt_label(data: RunData, attempt: int) -> str:
    a = next((x for x in data.history.attempts if x.attempt == attempt), None)
    label = f"attempt {attempt}"
    if a is not None and a.lr_scale != 1.0:
        label += f" (LR x{a.lr_scale:g})"
    return label


# -- (a) loss, grad norm, LR over steps -----------------------------------------------------------


def plot_training(data: RunData, path: Path) -> bool:
    """Loss (top), grad norm and LR (below, when reported) over steps, one colour per attempt,
    with relaunch/rollback lines, skipped-batch shading and non-finite markers."""
    curves = [c for c in data.curves if len(c.step)]
    if not curves:
        return False
    panels: list[tuple[str, str]] = [("loss", "loss")]
    if any(np.isfinite(c.grad_norm).any() or c.grad_bad.any() for c in curves):
        panels.append(("grad_norm", "grad norm"))
    if any(np.isfinite(c.lr).any() for c in curves):
        panels.append(("lr", "learning rate"))
    ratios = [3.0] + [1.4] * (len(panels) - 1)
    fig, axes = plt.subplots(len(panels), 1, sharex=True, squeeze=False, layout="constrained",
                             figsize=(WIDTH, 3.2 + 1.6 * (len(panels) - 1)),
                             gridspec_kw={"height_ratios": ratios})
    axs = list(axes[:, 0])
    for ax, (key, label) in zip(axs, panels, strict=True):
        _draw_series(ax, curves, key, data)
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        if _wants_log(np.concatenate([getattr(c, key) for c in curves])):
            ax.set_yscale("log")
    for ax in axs:
        _draw_skips(ax, data, first=ax is axs[0])
        _draw_interventions(ax, data, first=ax is axs[0])
    axs[-1].set_xlabel("optimizer step")
    name = data.history.name or data.history.run_dir.name
    axs[0].set_title(f"{name}: training curves by attempt", loc="left", pad=16)
    handles, labels = axs[0].get_legend_handles_labels()
    order = sorted(range(len(labels)), key=lambda i: not labels[i].startswith("attempt "))
    axs[0].legend([handles[i] for i in order], [labels[i] for i in order], loc="upper left",
                  bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    _save(fig, path)
    return True


def _draw_series(ax: Any, curves: list[Curve], key: str, data: RunData) -> None:
    edge = mtransforms.blended_transform_factory(ax.transData, ax.transAxes)
    bad_label = f"non-finite {key.replace('_', ' ')}"
    newest = curves[-1].attempt
    for c in curves:
        s = _stride(len(c.step))
        values: Floats = getattr(c, key)
        # Earlier attempts wide and pale: a relaunch that retraces them shows as a halo, not as
        # one line hiding the other.
        old = c.attempt != newest
        x, y = c.step[::s], values[::s]
        label = _attempt_label(data, c.attempt) if key == "loss" else None
        if len(x) > SMOOTH_FROM:
            # Thousands of noisy points draw a solid band; the trend is what a reader wants,
            # with the raw values faint behind it so spikes still show.
            ax.plot(x, y, color=_colour(c.attempt), lw=0.6, alpha=0.25)
            y = _rolling_median(y, max(5, len(x) // 100))
        ax.plot(x, y, color=_colour(c.attempt), lw=2.6 if old else 1.2,
                alpha=0.55 if old else 1.0, label=label)
        bad = c.loss_bad if key == "loss" else c.grad_bad if key == "grad_norm" else None
        if bad is not None and bad.any():
            steps = c.step[bad][:: _stride(int(bad.sum()))]
            # Pinned to the top edge: a NaN has no height, but where it happened matters.
            ax.scatter(steps, np.full(len(steps), 0.96), transform=edge, marker="x", s=28,
                       color="#d62828", zorder=5, clip_on=False, label=bad_label)
            bad_label = "_nolegend_"


def _draw_skips(ax: Any, data: RunData, first: bool) -> None:
    seen: set[tuple[int, int]] = set()
    for a in data.history.attempts:
        for start, end in a.skip:
            if (start, end) in seen:
                continue  # directives repeat earlier skips; shade each range once
            seen.add((start, end))
            label = f"batches {start}-{end - 1}: skipped from attempt {a.attempt} on"
            span = data.step_of_cursor(start, end, a.attempt)
            if span is not None:
                ax.axvspan(span[0] - 0.5, span[1] + 0.5, color="#888888", alpha=0.18, lw=0,
                           hatch="//", label=label if first else None)
            jump = data.skip_jump(start, end, a.attempt)
            if jump is not None:
                ax.axvline(jump - 0.5, color=_colour(a.attempt), lw=2.5, alpha=0.35,
                           label=f"attempt {a.attempt} jumps past {start}-{end - 1}"
                           if first else None)


def _draw_interventions(ax: Any, data: RunData, first: bool) -> None:
    """A dashed line where an incident stopped the workers (relaunch, rollback, stop), labelled
    once per step on the top panel; a dotted line where an attempt resumed from a checkpoint."""
    top = mtransforms.blended_transform_factory(ax.transData, ax.transAxes)
    caused = {id(a.cause): a.attempt for a in data.history.attempts if a.cause is not None}
    labels: dict[int, list[str]] = {}
    colours: dict[int, str] = {}
    for i in data.history.incidents:
        if i.step is None or i.action not in ("relaunch", "rollback", "stop"):
            continue
        then = f" -> #{caused[id(i)]}" if id(i) in caused else ""
        labels.setdefault(i.step, []).append(f"{i.incident}: {i.action}{then}")
        colours[i.step] = ACTION_COLOURS.get(i.action, "black")
    for step, texts in labels.items():
        ax.axvline(step, color=colours[step], ls="--", lw=1.2)
        if first:
            ax.text(step, 1.01, "; ".join(dict.fromkeys(texts)), transform=top, fontsize=8,
                    color=colours[step], ha="center", va="bottom")
    for a in data.history.attempts:
        if a.resume_step is not None:
            ax.axvline(a.resume_step, color=_colour(a.attempt), ls=":", lw=1.2,
                       label=f"attempt {a.attempt} resumes at step {a.resume_step}"
                       if first else None)


# -- (b) per-rank step time -----------------------------------------------------------------------


def plot_step_times(data: RunData, path: Path) -> bool:
    """Per-rank step time over wall time (rolling median lines, or a heatmap of each rank's time
    relative to the step's median when there are many ranks) and each rank's median as bars."""
    ranks = {r: t for r, t in data.ranks.items() if t.step_time}
    if not ranks:
        return False
    span = max(max(t.time) for t in ranks.values()) - data.t0
    div, xlabel = _time_axis(span)
    fig, (ax, bars) = plt.subplots(1, 2, figsize=(WIDTH, 3.8), layout="constrained",
                                   gridspec_kw={"width_ratios": [4, 1]})
    if len(ranks) < HEATMAP_RANKS:
        for i, (rank, t) in enumerate(ranks.items()):
            attempts = np.array(t.attempt)
            for n, attempt in enumerate(dict.fromkeys(t.attempt)):
                # One line per attempt: a line across the relaunch gap would invent data.
                take = attempts == attempt
                x = (np.array(t.time)[take] - data.t0) / div
                y = _rolling_median(np.array(t.step_time)[take] * 1000.0, 9)
                s = _stride(len(x))
                ax.plot(x[::s], y[::s], lw=1.2, color=ATTEMPT_COLOURS[i % 10],
                        label=f"rank {rank}" if n == 0 else None)
        ax.set_ylabel("step time (ms), rolling median of 9")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
        ax.set_ylim(bottom=0)
    else:
        _heatmap(fig, ax, ranks, data.t0, div)
    _mark_launches(ax, data, div, "#", "#555555", ":")
    ax.set_xlabel(xlabel)
    ax.grid(True, alpha=0.3)
    ax.set_title("step time per rank (launches marked #n)", loc="left", pad=14)
    medians = [float(np.median(t.step_time)) * 1000.0 for t in ranks.values()]
    overall = float(np.median(medians))
    colours = ["#d62828" if m > 1.3 * overall else "#1f77b4" for m in medians]
    bars.barh([str(r) for r in ranks], medians, color=colours)
    for row, m in enumerate(medians):
        bars.text(m, row, f" {m:.3g}", va="center", fontsize=8)
    bars.axvline(overall, color="black", lw=0.8, ls="--")
    bars.invert_yaxis()
    bars.set_xlabel("median step time (ms)")
    bars.set_ylabel("rank")
    bars.set_title("red: >1.3x the median", fontsize=9, loc="left", pad=14)
    _save(fig, path)
    return True


def _rolling_median(values: Floats, window: int) -> Floats:
    if len(values) < window:
        return values
    windows = np.lib.stride_tricks.sliding_window_view(values, window)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN windows stay NaN, quietly
        medians = np.nanmedian(windows, axis=1)
    out: Floats = np.concatenate([values[: window - 1], medians])
    return out


def _heatmap(fig: Any, ax: Any, ranks: dict[int, Any], t0: float, div: float) -> None:
    t_min = min(min(t.time) for t in ranks.values())
    t_max = max(max(t.time) for t in ranks.values())
    bins = 200
    grid = np.full((len(ranks), bins), np.nan)
    for i, t in enumerate(ranks.values()):
        idx = np.minimum(((np.array(t.time) - t_min) / max(t_max - t_min, 1e-9) * bins)
                         .astype(int), bins - 1)
        sums = np.bincount(idx, weights=np.array(t.step_time), minlength=bins)
        counts = np.bincount(idx, minlength=bins)
        with np.errstate(invalid="ignore", divide="ignore"):
            grid[i] = sums / counts
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # time bins no rank reported in
        relative = grid / np.nanmedian(grid, axis=0, keepdims=True)
    # White is "as fast as the median rank", red is slower; faster ranks are no one's problem.
    image = ax.imshow(relative, aspect="auto", cmap="Reds", vmin=1.0, vmax=2.0,
                      interpolation="nearest",
                      extent=((t_min - t0) / div, (t_max - t0) / div, len(ranks) - 0.5, -0.5))
    ax.set_yticks(range(len(ranks)), [str(r) for r in ranks])
    ax.set_ylabel("rank")
    fig.colorbar(image, ax=ax, label="step time / median of all ranks", pad=0.01,
                 extend="max")


def _mark_launches(ax: Any, data: RunData, div: float, prefix: str, colour: str,
                   style: str) -> None:
    """A vertical line per launch on a time axis; labels of launches close together are merged
    ("#3,#4") instead of printed over each other."""
    top = mtransforms.blended_transform_factory(ax.transData, ax.transAxes)
    xs = [((a.time - data.t0) / div, a.attempt) for a in data.history.attempts]
    lo, hi = ax.get_xlim()  # call after the data is drawn: the axis span decides "close"
    span = max(hi, *(x for x, _ in xs)) - min(lo, *(x for x, _ in xs)) if xs else 1.0
    groups: list[list[tuple[float, int]]] = []
    for x, n in xs:
        ax.axvline(x, color=colour, ls=style, lw=1.1)
        if groups and x - groups[-1][0][0] < 0.04 * max(span, 1e-9):
            groups[-1].append((x, n))
        else:
            groups.append([(x, n)])
    for g in groups:
        ax.text(g[0][0], 1.01, prefix + ",#".join(str(n) for _, n in g), fontsize=8,
                color=colour, ha="center", va="bottom", transform=top)


# -- (c) incident timeline ------------------------------------------------------------------------


def plot_timeline(data: RunData, path: Path) -> bool:
    """One row per incident kind over wall time, markers coloured by the policy's action, with
    the launches and the run's end marked. Drawn for every run (launches alone are a timeline)."""
    h = data.history
    findings = sorted(h.incidents + h.ignored, key=lambda i: i.time)
    kinds = sorted({i.incident for i in findings})
    end = float(h.finished.get("time", 0.0)) if h.finished else None
    times = [i.time for i in findings] + [a.time for a in h.attempts] + ([end] if end else [])
    div, xlabel = _time_axis(max(times, default=data.t0) - data.t0)
    fig, ax = plt.subplots(figsize=(WIDTH, 1.9 + 0.45 * max(1, len(kinds))),
                           layout="constrained")
    done: set[str] = set()
    for i in findings:
        row = kinds.index(i.incident)
        ignored = i.action in ("ignore", "set_aside")
        ax.scatter((i.time - data.t0) / div, row, s=18 if ignored else 70,
                   marker="o" if ignored else "D", color=ACTION_COLOURS.get(i.action, "black"),
                   edgecolor="none" if ignored else "black", lw=0.6, zorder=3,
                   label=None if i.action in done else i.action)
        done.add(i.action)
    _mark_launches(ax, data, div, "launch #", "#2a9d8f", "-")
    if h.finished and end:
        state = str(h.finished.get("state"))
        ax.axvline((end - data.t0) / div, color="black", lw=1.5)
        ax.text((end - data.t0) / div, 1.01, state, fontsize=8, ha="left",
                transform=mtransforms.blended_transform_factory(ax.transData, ax.transAxes))
    ax.set_yticks(range(len(kinds)), kinds)
    ax.set_ylim(-0.6, max(1, len(kinds)) - 0.4)
    if not kinds:
        ax.text(0.5, 0.5, "no findings: nothing went wrong that babysit could see",
                transform=ax.transAxes, ha="center", va="center", color="#555555")
    ax.set_xlabel(xlabel)
    ax.set_xlim(left=min(0.0, *[(t - data.t0) / div for t in times]) if times else 0.0)
    ax.grid(True, axis="x", alpha=0.3)
    ax.set_title("incidents (marker colour: the policy's action; small dots: not acted on)",
                 loc="left", pad=14)
    if done:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False,
                  title="action", title_fontsize=8)
    _save(fig, path)
    return True
