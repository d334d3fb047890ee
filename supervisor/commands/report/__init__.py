"""``babysit report RUN_DIR [--out PATH]``: one HTML page with plots of a run, live or finished.

Writes ``PATH`` (default ``RUN_DIR/report.html``) and its figures in a folder beside it named
after it (``RUN_DIR/report/*.png``), linked relatively so the pair can be copied anywhere:

- ``training.png``: loss (plus grad norm and LR) by step, one colour per attempt, relaunch and
  rollback lines, shaded batches that a later attempt skipped, non-finite values as red marks,
  the band of per-rank losses and rank_departure findings, when reported;
- ``throughput.png``: tokens/s and MFU by step, when the run reported them;
- ``scalars.png``: the other numbers the script reported (``run.step(scalars=...)``: eval
  loss...) by step, when it reported any;
- ``step_times.png``: each rank's step time over the run, and each rank's median (large worlds:
  the median, p99 and slowest rank's step time, and which ranks were the slowest most often);
- ``timeline.png``: every finding over time, by kind, coloured by the policy's action.
- ``goodput.png``: each attempt's wall time stacked by the goodput ledger's categories
  (productive steps and badput by cause), with the ledger's table in the page.

Hangs (a band from the last progress to the finding) and crashes (a line) are marked on both
time plots (``marks``); the page also shows the run's config, and the journal's other events
in words, never as raw JSON.

Calling rules: reads only the run directory (safe while the run is live; a torn last line is
skipped); needs matplotlib (imported here, never by ``babysit run``). The whole metrics file is
read; curves are thinned to ``plots.MAX_POINTS`` per line for drawing only.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TextIO

from babysit.supervisor.commands.history import NotARunDir, goodput, snapshot

__all__ = ["report_main", "write_report"]


def write_report(run_dir: str | Path, out_path: str | Path | None = None) -> Path:
    """Write the report and its figures; return the HTML path. Raises ``status.NotARunDir``."""
    from babysit.supervisor.commands.report import html, ledger, plots, scalars
    from babysit.supervisor.commands.report.data import RunData

    run_dir = Path(run_dir)
    data = RunData.load(run_dir)
    snap = snapshot(run_dir)
    if (snap["goodput"] or {}).get("source") != "files":  # status's size limit: not here
        snap["goodput"] = goodput(data.history, max_bytes=None)
    out = Path(out_path) if out_path is not None else run_dir / "report.html"
    if out.is_dir():
        out = out / "report.html"
    elif out.suffix.lower() not in (".html", ".htm"):
        out = out.with_name(out.name + ".html")  # else the figure folder would take its name
    fig_dir = out.parent / out.stem
    drawers = {"training": plots.plot_training, "throughput": plots.plot_throughput,
               "scalars": scalars.plot_scalars, "step_times": plots.plot_step_times,
               "timeline": plots.plot_timeline}
    figures: dict[str, str | None] = {}
    for name, draw in drawers.items():
        png = fig_dir / f"{name}.png"
        png.unlink(missing_ok=True)  # a figure this run no longer has must not linger
        figures[name] = f"{fig_dir.name}/{png.name}" if draw(data, png) else None
    png = fig_dir / "goodput.png"
    png.unlink(missing_ok=True)
    figures["goodput"] = f"{fig_dir.name}/{png.name}" \
        if ledger.plot_goodput(snap.get("goodput"), png) else None
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(html.render(data, snap, figures, out), encoding="utf-8")
    tmp.replace(out)  # a browser reloading the page never sees half of it
    return out


def report_main(run_dir: str, out_path: str | None, out: TextIO,
                err: TextIO | None = None) -> int:
    """``babysit report``: write the report, print where to ``out``; return the exit code: 0, or
    2 (a usage mistake) with one paragraph on ``err`` (stderr) if RUN_DIR is not a run
    directory or matplotlib is missing."""
    err = err or sys.stderr
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("babysit: error: 'babysit report' draws its plots with matplotlib, which is not "
              "installed in this environment. Install it (pip install matplotlib) and run the "
              "command again.", file=err)
        return 2
    try:
        path = write_report(run_dir, out_path)
    except NotARunDir as exc:
        print(f"babysit: error: {exc}", file=err)
        return 2
    figs = sorted(p.name for p in (path.parent / path.stem).glob("*.png"))
    out.write(f"babysit: wrote {path} with {len(figs)} plot(s) in {path.parent / path.stem}\n")
    return 0
