"""``babysit report`` on run directories written by hand (no job): a folder that is not a run,
tokens/s and MFU, per-rank loss summaries and a rank departing, the row shape of large worlds,
silent data corruption checks and checkpoint cadence advice. The report of a real run (and of
copies of it bent into the awkward cases): ``tests/e2e/test_report.py``.
"""

from __future__ import annotations

import html
import io
import json
import math
import re
from pathlib import Path
from typing import Any

import matplotlib.image
import numpy as np

from babysit.supervisor.commands.report import report_main
from babysit.supervisor.commands.report.data import RunData

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FIGURES = ("training.png", "step_times.png", "timeline.png", "goodput.png")
T0 = 1_700_000_000.0


def report(run_dir: Path, out_path: Path | None = None) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = report_main(str(run_dir), str(out_path) if out_path else None, out, err)
    return code, out.getvalue(), err.getvalue()


def images(html_path: Path) -> list[Path]:
    """The PNGs the page links to, resolved against the page (they must be relative links)."""
    sources = re.findall(r"<img src='([^']+)'", html_path.read_text())
    assert all(not Path(s).is_absolute() for s in sources)
    return [html_path.parent / s for s in sources]


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 10_000, path


def test_not_a_run_directory(tmp_path: Path) -> None:
    code, out, err = report(tmp_path)
    assert code == 2 and out == "" and "Traceback" not in err
    assert err.startswith(f"babysit: error: {tmp_path} is not a babysit run directory")
    assert not (tmp_path / "report.html").exists()


# -- run directories written by hand --------------------------------------------------------------


def write_run(to: Path, rows: list[dict[str, Any]],
              events: tuple[dict[str, Any], ...] = ()) -> Path:
    """A finished one-attempt run: the journal around ``events``, and ``rows`` as metrics."""
    to.mkdir()
    end = max([T0 + 2.0, *(r["time"] + 1.0 for r in rows if "time" in r)])
    journal = [{"event": "run_started", "time": T0, "attempt": 0, "step": None,
                "name": "synthetic", "pid": 0},
               {"event": "launch", "time": T0 + 1.0, "attempt": 0, "step": None,
                "directive": {"attempt": 0}},
               *events,
               {"event": "run_finished", "time": end, "attempt": 0, "step": None,
                "state": "succeeded", "reason": "workers finished", "exit_code": 0}]
    for name, lines in (("events.jsonl", journal), ("metrics.jsonl", rows)):
        (to / name).write_text("".join(json.dumps(x) + "\n" for x in lines))
    return to


def small_world_rows(steps: int = 240, world: int = 4, rates: bool = True) -> list[dict[str, Any]]:
    """Rows as the aggregator writes them for a small world: per-rank lists, the loss summary,
    and (``rates``) tokens/s and MFU. Rank 1's loss departs between steps 150 and 170."""
    rows = []
    for step in range(1, steps + 1):
        base = 1.0 + 4.0 * math.exp(-step / 60)
        losses = [base + 0.03 * math.sin(step * (r + 1)) + (1.5 if r == 1 and 150 <= step < 170
                                                             else 0.0) for r in range(world)]
        order = sorted(range(world), key=lambda r: losses[r])
        row: dict[str, Any] = {
            "step": step, "time": T0 + 1.0 + 0.5 * step, "attempt": 0, "cursor": step,
            "ranks": list(range(world)), "loss": sum(losses) / world, "loss_per_rank": losses,
            "loss_min": losses[order[0]], "loss_min_rank": order[0],
            "loss_median": float(np.median(losses)), "loss_max": losses[order[-1]],
            "loss_max_rank": order[-1], "grad_norm": 1.0, "lr": 3e-4, "tokens": 4096.0 * world,
            "step_time_per_rank": [0.5 + 0.01 * r for r in range(world)]}
        if rates:
            # Medians 120,000 tokens/s and 41.0% MFU, with a slow patch and noise either side.
            slow = 0.6 if 60 <= step < 80 else 1.0
            row["tokens_per_s"] = slow * (120_000.0 + 10_000.0 * ((step % 3) - 1))
            row["mfu"] = "nan" if step == 7 else slow * (0.41 + 0.02 * ((step % 3) - 1))
        rows.append(row)
    return rows


def finding(step: int, incident: str, ranks: list[int], action: str = "alert",
            message: str = "") -> dict[str, Any]:
    return {"event": "finding", "time": T0 + 1.0 + 0.5 * step, "attempt": 0, "step": step,
            "finding": {"incident": incident, "severity": "warning", "step": step,
                        "ranks": ranks, "message": message or f"{incident} at step {step}"},
            "remedy": {"action": action, "reason": f"policy: {action} on {incident}"}}


def incident_rows(page: Path) -> list[str]:
    """The incidents table's rows, one string of cell texts each."""
    section = page.read_text().split("<h2>Incidents</h2>")[1].split("<h2>")[0]
    return [html.unescape(re.sub(r"<[^>]+>", " ", row)) for row in section.split("<tr>")[2:]]


def colour_present(png: Path, hex_colour: str, left: float = 1.0) -> bool:
    """Whether ``png`` has pixels of about ``hex_colour`` (anti-aliased lines are never exactly
    it) in its ``left`` share of the width."""
    pixels = (matplotlib.image.imread(png)[..., :3] * 255).round().astype(int)
    pixels = pixels[:, : int(left * pixels.shape[1])]
    want = [int(hex_colour[i:i + 2], 16) for i in (1, 3, 5)]
    return int((np.abs(pixels - want).sum(axis=-1) <= 60).sum()) > 100


def test_throughput_mfu_and_rank_departures(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", small_world_rows(), (
        finding(155, "rank_departure", [1], message="rank 1's loss departs from the others"),))
    code, out, err = report(run)
    assert code == 0 and err == "" and "with 5 plot(s)" in out
    page = run / "report.html"
    assert [p.name for p in images(page)] == [
        "training.png", "throughput.png", "step_times.png", "timeline.png", "goodput.png"]
    for png in images(page):
        assert_png(png)
    text = page.read_text()
    # The ledger: launch at +1 s, first step at +2 s, one step a second, end a second later.
    assert "<h2>Goodput</h2>" in text and re.search(r"9[0-9]\.[0-9]% of [0-9.]+ (s|min) "
                                                    r"productive", text)
    # Newest 50 rows (the speed line) and the whole run (the throughput line) both median 41%.
    assert "MFU 41.0% (median)" in text
    assert "120,000 tokens/s, MFU 41.0% (medians over all steps)" in text
    assert re.search(r"rank losses \(last step\).*\(rank \d\)", text)
    departure = [r for r in incident_rows(page) if "rank_departure" in r]
    assert len(departure) == 1 and " 1 " in departure[0] and "rank 1's loss" in departure[0]


def test_no_rates_no_throughput_figure_and_no_mfu(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", small_world_rows())
    assert report(run)[0] == 0
    assert (run / "report" / "throughput.png").exists()
    # Re-reported without rates (say the script dropped them): the old figure must not linger.
    rows = small_world_rows(rates=False)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert report(run)[0] == 0
    assert [p.name for p in images(run / "report.html")] == list(FIGURES)
    assert not (run / "report" / "throughput.png").exists()
    assert "MFU" not in (run / "report.html").read_text()


def large_world_rows(steps: int = 300, world: int = 128) -> list[dict[str, Any]]:
    """The summary rows of a world above the per-rank limit: quantiles and extreme ranks, no
    per-rank lists; rank 77 is the slowest most of the time and sometimes missing."""
    rows = []
    for step in range(1, steps + 1):
        straggling = step % 4 != 0
        row: dict[str, Any] = {
            "step": step, "time": T0 + 1.0 + 0.8 * step, "attempt": 0, "cursor": step,
            "n_ranks": world, "world_size": world, "loss": 3.0 - step / 200,
            "loss_min": 2.9 - step / 200, "loss_min_rank": step % world,
            "loss_median": 3.0 - step / 200, "loss_max": 3.2 - step / 200, "loss_max_rank": 5,
            "step_time": 0.9 if straggling else 0.62, "step_time_p50": 0.5,
            "step_time_p99": "nan" if step == 9 else 0.6,
            "step_time_max": 0.9 if straggling else 0.62,
            "step_time_max_rank": 77 if straggling else step % world,
            "tokens": 4096.0 * world, "tokens_per_s": 4096.0 * world / 0.9}
        if step % 50 == 0:
            row.update(n_ranks=world - 1, missing_ranks=[77])
        rows.append(row)
    # One step written as two partial rows (ranks that reported late), out of order.
    late = {"step": 120, "time": T0 + 97.0, "attempt": 0, "n_ranks": 3, "world_size": world,
            "loss": 2.5, "loss_min": 2.4, "loss_median": 2.5, "loss_max": 9.0,
            "loss_max_rank": 3, "step_time_p50": 0.5, "step_time_p99": 0.6,
            "step_time_max": 1.4, "step_time_max_rank": 3}
    return [*rows[:200], late, *rows[200:]]


def test_large_world_rows_draw_step_time_quantiles(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", large_world_rows())
    code, _, err = report(run)
    assert code == 0, err
    page = run / "report.html"
    assert [p.name for p in images(page)] == [
        "training.png", "throughput.png", "step_times.png", "timeline.png", "goodput.png"]
    for png in images(page):
        assert_png(png)
    data = RunData.load(run)
    assert data.ranks == {}  # nothing per rank: the step-time figure drew from the quantiles
    [curve] = data.curves
    merged = int(np.nonzero(curve.step == 120)[0][0])
    assert (curve.loss_max[merged], curve.step_time_max[merged]) == (9.0, 1.4)
    # Its three lines (left of the legend and the bars): median rank, p99, slowest rank.
    for colour in ("#1f77b4", "#ff7f0e", "#d62828"):
        assert colour_present(run / "report" / "step_times.png", colour, left=0.6), colour


def sdc_check(step: int, agree: bool, **fields: Any) -> dict[str, Any]:
    return {"event": "sdc_check", "time": T0 + 1.0 + 0.5 * step, "attempt": 0,
            "checked_step": step, "agree": agree, "ranks": 8,
            "last_agreeing_step": step if agree else 200,
            "disagreeing": [], **fields}


def test_sdc_disagreement_names_the_rank(tmp_path: Path) -> None:
    same = {str(r): "9f3a1c22" for r in range(8)}
    digests = {"params": {**same, "3": "c0ffee01"}, "optimizer": same}
    rows = small_world_rows(steps=320, rates=False)
    run = write_run(tmp_path / "run", rows, (
        sdc_check(100, True), sdc_check(200, True),
        sdc_check(300, False, disagreeing=[3], digests=digests),
        finding(300, "sdc", [3], action="stop", message="rank 3's parameters differ")))
    assert report(run)[0] == 0
    text = (run / "report.html").read_text()
    section = text.split("<h2>Silent data corruption checks</h2>")[1].split("<h2>")[0]
    assert "3 check(s) between steps 100 and 300, comparing 8 ranks" in section
    assert "1 disagreed" in section and "all compared ranks agreed: <b>200</b>" in section
    cells = re.sub(r"<[^>]+>", " ", section.split("<tr>")[2]).split()
    assert cells[:5] == ["300", "0", "8", "3", "200"]  # step, attempt, compared, odd rank, last ok
    # Digests grouped by value, the odd one bold; a key where all agree has nothing bold.
    assert "<code>9f3a1c22</code> ranks 0-2, 4-7; <b><code>c0ffee01</code> rank 3</b>" in section
    assert "<code>optimizer</code>: <code>9f3a1c22</code> ranks 0-7" in section
    assert "sdc_check" not in text.split("<h2>Checkpoints</h2>")[1]  # not listed raw
    [sdc] = [r for r in incident_rows(run / "report.html") if " sdc " in r]
    assert " 3 " in sdc and "rank 3's parameters differ" in sdc and "stop" in sdc

    clean = write_run(tmp_path / "clean", rows, (sdc_check(100, True), sdc_check(200, True)))
    assert report(clean)[0] == 0
    assert "2 check(s) between steps 100 and 200" in (clean / "report.html").read_text()
    assert "All agreed." in (clean / "report.html").read_text()


def cadence_advice(step: int, summary: str, **fields: Any) -> dict[str, Any]:
    return {"event": "cadence_advice", "time": T0 + 1.0 + 0.5 * step, "attempt": 0,
            "step": step, "blocking_s": 42.0, "tau_s": 21_600.0, "tau_source": "observed",
            "interruptions": 3, "observed_s": 64_800.0, "optimal_interval_s": 1320.0,
            "optimal_steps": 440, "configured_steps": 1000, "waste_configured": 0.052,
            "waste_optimal": 0.031, "summary": summary, **fields}


def test_cadence_advice_shows_its_numbers(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", small_world_rows(rates=False), (
        cadence_advice(100, "older advice", optimal_steps=900),
        cadence_advice(200, "checkpoint every 440 steps instead of 1000: 3.1% lost, not 5.2%"),
        {"event": "cadence_adopted", "time": T0 + 102.0, "attempt": 0, "step": 201,
         "old_every": 1000, "new_every": 440, "from_step": 201, "reason": "cadence advice"}))
    assert report(run)[0] == 0
    text = (run / "report.html").read_text()
    section = text.split("<h2>Checkpoint cadence</h2>")[1].split("<h2>")[0]
    plain = re.sub(r"<[^>]+>", " ", section)
    assert "checkpoint every 440 steps instead of 1000" in plain and "older advice" not in plain
    # 1000 steps at 1320 s / 440 steps: 3000 s = 50 minutes.
    assert re.search(r"interval\s+every 1000 steps \(about 50.0 min\)\s+every 440 steps "
                     r"\(22.0 min\)", plain)
    assert re.search(r"expected waste\s+5.2%\s+3.1%", plain)
    assert "42.0 s" in plain
    assert "6.0 h (source: observed; 3 interruption(s) seen in 18.0 h)" in plain
    assert "step 201: checkpoint every 1000 -&gt; 440 steps (cadence advice)" in plain
    assert "Other journal events" not in text
