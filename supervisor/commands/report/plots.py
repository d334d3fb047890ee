"""The report's figures, drawn with matplotlib's Agg backend (no display needed).

Each ``plot_*`` function takes a ``RunData`` and a PNG path, writes the file and returns True, or
returns False when the run has nothing to draw (no metrics: a script without the worker API; no
tokens/s or MFU: a script that did not give tokens, FLOPs per token and peak FLOP/s).
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
import matplotlib.ticker as mticker
import matplotlib.transforms as mtransforms
import numpy as np

from babysit.supervisor.commands.report import marks
from babysit.supervisor.commands.report.data import Curve, Floats, RankTimes, RunData

DPI = 110
WIDTH = 11.0
MAX_POINTS = 20_000  # per line; more only slows drawing, a 1,100-pixel-wide figure can't show it
SMOOTH_FROM = 300  # points per line beyond which a rolling median is drawn over the raw values
HEATMAP_RANKS = 9  # from this many ranks on, lines per rank are unreadable: draw a heatmap
DEPARTURE_LABELS = 20  # rank_departure markers beyond this many are drawn without their text
SLOWEST_SHARE = 0.2  # a rank slowest in more than this share of steps is marked a straggler
SI = mticker.EngFormatter(sep="")  # 120k tokens/s, 1.5M: the digits a reader compares
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


def _name(data: RunData) -> str:
    return data.history.name or data.history.run_dir.name


def _attempt_label(data: RunData, attempt: int) -> str:
    a = next((x for x in data.history.attempts if x.attempt == attempt), None)
    label = f"attempt {attempt}"
    if a is not None and a.lr_ramp:
        label += (f" (LR x{a.lr_scale:g} from batch {a.lr_ramp.get('cut')}, x"
                  f"{a.lr_ramp['to']:g} again by batch {a.lr_ramp['end']})")
    elif a is not None and a.lr_scale != 1.0:
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
    _draw_rank_loss(axs[0], curves, data)
    for ax in axs:
        _draw_skips(ax, data, first=ax is axs[0])
        _draw_interventions(ax, data, first=ax is axs[0])
    axs[-1].set_xlabel("optimizer step")
    axs[0].set_title(f"{_name(data)}: training curves by attempt", loc="left", pad=16)
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


def _draw_rank_loss(ax: Any, curves: list[Curve], data: RunData) -> None:
    """The band from the lowest to the highest rank's loss around the median rank's (when the
    rows carry the per-rank summary), and a labelled marker at each rank_departure finding."""
    band_label = "loss across ranks: min-max, median dotted"
    for c in curves:
        if not c.has("loss_median"):
            continue
        s = _stride(len(c.step))
        ax.fill_between(c.step[::s], c.loss_min[::s], c.loss_max[::s], color=_colour(c.attempt),
                        alpha=0.16, lw=0, label=band_label)
        # Beneath the mean loss line: it shows only where the median rank parts from the mean.
        ax.plot(c.step[::s], c.loss_median[::s], color=_colour(c.attempt), lw=0.8, ls=":",
                zorder=1.5)
        band_label = "_nolegend_"
    # One marker per (step, rank); -1: a finding that named no rank gets a marker, no label.
    departures = sorted({(i.step, r, i.attempt) for i in data.history.incidents
                         + data.history.ignored
                         if i.incident == "rank_departure" and i.step is not None
                         for r in i.ranks or [-1]})
    marker_label = "rank_departure finding"
    for n, (step, rank, attempt) in enumerate(departures):
        y, pinned = _departure_height(curves, step, attempt)
        where = mtransforms.blended_transform_factory(ax.transData, ax.transAxes) if pinned \
            else ax.transData
        ax.scatter([step], [y], transform=where, marker="v", s=46, color="#d62828",
                   edgecolor="black", lw=0.6, zorder=6, clip_on=False, label=marker_label)
        marker_label = "_nolegend_"
        if n < DEPARTURE_LABELS and rank >= 0:
            ax.annotate(f"rank {rank}", (step, y), xycoords=where, xytext=(4, 5),
                        textcoords="offset points", fontsize=8, color="#d62828", zorder=6)


def _departure_height(curves: list[Curve], step: int, attempt: int) -> tuple[float, bool]:
    """Where a departure marker goes: the loss extreme farther from the median at that step (the
    departing rank is that extreme), else the mean loss; (0.9, True) means "pin it near the top
    of the axes", when the step has no finite loss at all."""
    for c in sorted(curves, key=lambda c: (c.attempt != attempt, -c.attempt)):
        at = np.nonzero(c.step == step)[0]
        if not len(at):
            continue
        i = int(at[0])
        low, mid, high = c.loss_min[i], c.loss_median[i], c.loss_max[i]
        if np.isfinite([low, mid, high]).all():
            return float(high if high - mid >= mid - low else low), False
        if np.isfinite(c.loss[i]):
            return float(c.loss[i]), False
    return 0.9, True


def _draw_skips(ax: Any, data: RunData, first: bool) -> None:
    seen: set[tuple[int, int]] = set()
    for a in data.history.attempts:
        for start, end, *_ in a.skip:
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


# -- (b) throughput ------------------------------------------------------------------------------


def plot_throughput(data: RunData, path: Path) -> bool:
    """Tokens per second (top) and MFU in percent (below), whichever the run reported, over
    steps, one colour per attempt: a rolling median over the raw values drawn faint, and the
    run's median as a dashed line."""
    curves = [c for c in data.curves if len(c.step)]
    panels = [(key, label, scale) for key, label, scale in
              (("tokens_per_s", "tokens/s (job)", 1.0), ("mfu", "MFU (%)", 100.0))
              if any(c.has(key) for c in curves)]
    if not panels:
        return False
    fig, axes = plt.subplots(len(panels), 1, sharex=True, squeeze=False, layout="constrained",
                             figsize=(WIDTH, 1.2 + 2.2 * len(panels)))
    axs = list(axes[:, 0])
    for ax, (key, label, scale) in zip(axs, panels, strict=True):
        every: list[Floats] = []
        for c in curves:
            values: Floats = getattr(c, key) * scale
            keep = np.isfinite(values)
            if not keep.any():
                continue
            x, y = c.step[keep], values[keep]
            every.append(y)
            s = _stride(len(x))
            ax.plot(x[::s], y[::s], color=_colour(c.attempt), lw=0.6, alpha=0.3)
            ax.plot(x[::s], _rolling_median(y, max(9, len(y) // 100))[::s],
                    color=_colour(c.attempt), lw=1.4,
                    label=_attempt_label(data, c.attempt) if ax is axs[0] else None)
        median = float(np.median(np.concatenate(every)))
        ax.axhline(median, color="#555555", lw=0.9, ls="--")
        shown = f"{median:.1f}%" if key == "mfu" else SI(float(f"{median:.3g}"))
        ax.text(0.995, median, f"run median {shown}", fontsize=8, color="#555555", ha="right",
                va="bottom", transform=mtransforms.blended_transform_factory(ax.transAxes,
                                                                             ax.transData))
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        if key == "tokens_per_s":
            ax.yaxis.set_major_formatter(SI)
        ax.grid(True, alpha=0.3)
        _draw_interventions(ax, data, first=ax is axs[0])
    axs[-1].set_xlabel("optimizer step")
    axs[0].set_title(f"{_name(data)}: throughput by attempt (rolling median; raw values faint)",
                     loc="left", pad=16)
    axs[0].legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    _save(fig, path)
    return True


# -- (c) per-rank step time -----------------------------------------------------------------------


def plot_step_times(data: RunData, path: Path) -> bool:
    """Per-rank step time over wall time (rolling median lines, or a heatmap of each rank's time
    relative to the step's median when there are many ranks) and each rank's median as bars.
    Rows of large worlds carry no per-rank lists: then the median, p99 and slowest rank's step
    time are drawn instead, and how often each rank was the slowest."""
    ranks = {r: t for r, t in data.ranks.items() if t.step_time}
    quantiles = [c for c in data.curves
                 if c.has("time") and (c.has("step_time_p50") or c.has("step_time_max"))]
    if not ranks and not quantiles:
        return False
    ends = [max(t.time) for t in ranks.values()] if ranks else [
        float(np.nanmax(c.time)) for c in quantiles]
    div, xlabel = _time_axis(max(ends) - data.t0)
    fig, (ax, bars) = plt.subplots(1, 2, figsize=(WIDTH, 3.8), layout="constrained",
                                   gridspec_kw={"width_ratios": [4, 1]})
    if not ranks:
        _draw_quantiles(ax, bars, quantiles, data, div)
        ax.set_title("step time across ranks (launches marked #n)", loc="left", pad=14)
    elif len(ranks) < HEATMAP_RANKS:
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
    if ranks:
        ax.set_title("step time per rank (launches marked #n)", loc="left", pad=14)
        _median_bars(bars, ranks)
    _mark_launches(ax, data, div, "#", "#555555", ":")
    marks.mark_troubles(ax, data, div, legend=False)  # a hang is otherwise only a gap here
    ax.set_xlabel(xlabel)
    ax.grid(True, alpha=0.3)
    _save(fig, path)
    return True


def _median_bars(bars: Any, ranks: dict[int, RankTimes]) -> None:
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


def _draw_quantiles(ax: Any, bars: Any, curves: list[Curve], data: RunData,
                    div: float) -> None:
    """The large-world step-time view: quantile lines over time, and the ranks that were the
    slowest most often (a straggler is the slowest in most steps; by chance, no rank is)."""
    lines = (("step_time_p50", "#1f77b4", "median rank"), ("step_time_p99", "#ff7f0e", "p99"),
             ("step_time_max", "#d62828", "slowest rank"))
    for key, colour, label in lines:
        for c in curves:
            y: Floats = getattr(c, key) * 1000.0
            keep = np.isfinite(y) & np.isfinite(c.time)
            if not keep.any():
                continue
            x = (c.time[keep] - data.t0) / div
            s = _stride(int(keep.sum()))
            ax.plot(x[::s], _rolling_median(y[keep], 9)[::s], lw=1.2, color=colour, label=label)
            label = "_nolegend_"  # one legend entry per quantile, one line per attempt
    ax.set_ylabel("step time (ms), rolling median of 9")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    ax.set_ylim(bottom=0)
    slowest = np.concatenate([c.step_time_max_rank for c in curves])
    slowest = slowest[np.isfinite(slowest)].astype(int)
    if not len(slowest):
        bars.set_axis_off()
        return
    ids, counts = np.unique(slowest, return_counts=True)
    top = np.argsort(-counts, kind="stable")[:10]
    shares = counts[top] / len(slowest)
    bars.barh([str(r) for r in ids[top]], shares * 100.0,
              color=["#d62828" if x > SLOWEST_SHARE else "#1f77b4" for x in shares])
    for row, x in enumerate(shares):
        bars.text(x * 100.0, row, f" {x:.0%}", va="center", fontsize=8)
    bars.invert_yaxis()
    bars.set_xlabel("% of steps as the slowest")
    bars.set_ylabel("rank")
    bars.set_title(f"red: slowest in >{SLOWEST_SHARE:.0%}", fontsize=9, loc="left", pad=14)


def _rolling_median(values: Floats, window: int) -> Floats:
    if len(values) < window:
        return values
    windows = np.lib.stride_tricks.sliding_window_view(values, window)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN windows stay NaN, quietly
        medians = np.nanmedian(windows, axis=1)
        # The first points have fewer before them: a median of those, not the raw noise.
        head = [np.nanmedian(values[: i + 1]) for i in range(window - 1)]
    out: Floats = np.concatenate([np.asarray(head, dtype=np.float64), medians])
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


# -- (d) incident timeline ------------------------------------------------------------------------


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
    span = (max(times, default=data.t0) - data.t0) / div
    offsets: dict[int, float] = {}
    for kind in kinds:  # markers close in time stack within their row instead of overlapping
        mine = [n for n, i in enumerate(findings) if i.incident == kind]
        xs = [(findings[n].time - data.t0) / div for n in mine]
        offsets.update(zip(mine, marks.spread(xs, span), strict=True))
    for n, i in enumerate(findings):
        row = kinds.index(i.incident) + offsets[n]
        ignored = i.action in ("ignore", "set_aside")
        ax.scatter((i.time - data.t0) / div, row, s=18 if ignored else 70,
                   marker="o" if ignored else "D", color=ACTION_COLOURS.get(i.action, "black"),
                   edgecolor="none" if ignored else "black", lw=0.6, zorder=3,
                   label=None if i.action in done else i.action)
        done.add(i.action)
    _mark_launches(ax, data, div, "launch #", "#2a9d8f", "-")
    marks.mark_troubles(ax, data, div, legend=False)
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
