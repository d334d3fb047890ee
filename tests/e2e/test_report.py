"""``babysit report`` on the real NaN-then-rollback run made by tests/e2e/test_status.py (shared,
so the job runs once per session), and on copies of it bent into the awkward cases: extra
NaN/inf rows and missing fields, no metrics at all, many ranks with a straggler.
"""

from __future__ import annotations

import html
import json
import re
import shutil
from pathlib import Path

import pytest

from tests.conftest import read_jsonl
from tests.e2e.test_status import real_run
from tests.supervisor.commands.test_report import assert_png, images, report

pytestmark = pytest.mark.e2e

REAL_FIGURES = ("training.png", "scalars.png", "step_times.png", "timeline.png", "goodput.png")
"""The real run's: the demo script reports its eval loss (``run.scalars``) at its last step."""


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return real_run(tmp_path_factory)


def copy_run(run_dir: Path, to: Path) -> Path:
    to.mkdir()
    for name in ("events.jsonl", "metrics.jsonl"):
        shutil.copy(run_dir / name, to / name)
    return to


def test_report_of_a_rollback_run(tmp_path: Path, run_dir: Path) -> None:
    code, out, err = report(run_dir, tmp_path / "out" / "r.html")
    assert code == 0 and err == ""
    page = tmp_path / "out" / "r.html"
    # The demo gives tokens; whether tokens/s (and MFU) reach the rows is the aggregator's call.
    rates = any("tokens_per_s" in r or "mfu" in r for r in read_jsonl(run_dir / "metrics.jsonl"))
    figures = [*REAL_FIGURES[:1], *(["throughput.png"] if rates else []), *REAL_FIGURES[1:]]
    assert out == (f"babysit: wrote {page} with {len(figures)} plot(s) in "
                   f"{tmp_path / 'out' / 'r'}\n")
    linked = images(page)
    assert [p.name for p in linked] == figures
    assert {p.parent for p in linked} == {tmp_path / "out" / "r"}
    for png in linked:
        assert_png(png)
    text = page.read_text()
    finding = next(e for e in read_jsonl(run_dir / "events.jsonl")
                   if e["event"] == "finding" and e["remedy"]["action"] == "rollback")
    assert finding["finding"]["message"] in text
    assert finding["remedy"]["reason"] in html.unescape(text)
    assert "succeeded" in text and "lr x0.5" in text and "#1" in text
    # The NaN steps not acted on (how many depends on timing) are summarised, not listed.
    # (Under load a throughput finding may be set aside too: it has its own count.)
    not_acted = [e for e in read_jsonl(run_dir / "events.jsonl")
                 if e.get("finding", {}).get("incident") == "nonfinite" and (
                     e["event"] == "finding_set_aside"
                     or (e["event"] == "finding" and e["remedy"]["action"] == "ignore"))]
    assert bool(re.search(rf"nonfinite x{len(not_acted)} \(steps \d+-\d+\)", text)) == bool(
        not_acted)


def test_default_location_is_inside_the_run_directory(tmp_path: Path, run_dir: Path) -> None:
    run = copy_run(run_dir, tmp_path / "run")
    assert report(run)[0] == 0
    linked = [p.relative_to(run) for p in images(run / "report.html")]
    assert [Path("report") / f for f in REAL_FIGURES] == [p for p in linked
                                                           if p.name != "throughput.png"]


def test_nan_inf_and_missing_fields(tmp_path: Path, run_dir: Path) -> None:
    run = copy_run(run_dir, tmp_path / "run")
    last = read_jsonl(run / "metrics.jsonl")[-1]
    extra = [
        {**last, "step": 61, "time": last["time"] + 0.1, "loss": "nan", "grad_norm": "inf",
         "loss_per_rank": ["nan", 1.0], "step_time_per_rank": ["nan", 0.1]},
        {"step": 62, "time": last["time"] + 0.2, "attempt": last["attempt"]},  # nothing else
        {"step": 63, "attempt": last["attempt"], "loss": "-inf", "ranks": "garbage"},
    ]
    with open(run / "metrics.jsonl", "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in extra) + '{"step": 64, "ti')  # torn
    code, _, err = report(run)
    assert code == 0, err
    for png in images(run / "report.html"):
        assert_png(png)


def test_a_run_without_metrics_still_gets_a_timeline(tmp_path: Path, run_dir: Path) -> None:
    run = copy_run(run_dir, tmp_path / "run")
    (run / "metrics.jsonl").write_text("")
    assert report(run)[0] == 0
    # The eval loss comes from the journal, not the metrics: it is still drawn.
    assert [p.name for p in images(run / "report.html")] == [
        "scalars.png", "timeline.png", "goodput.png"]
    assert "No metrics." in (run / "report.html").read_text()
    assert not (run / "report" / "training.png").exists()


def test_many_ranks_draw_a_heatmap_without_error(tmp_path: Path, run_dir: Path) -> None:
    run = copy_run(run_dir, tmp_path / "run")
    rows = read_jsonl(run / "metrics.jsonl")
    with open(run / "metrics.jsonl", "w") as f:
        for r in rows:
            times = [0.01 * (3 if rank == 5 else 1) for rank in range(16)]
            f.write(json.dumps({**r, "ranks": list(range(16)), "step_time_per_rank": times})
                    + "\n")
    assert report(run)[0] == 0
    assert_png(run / "report" / "step_times.png")
