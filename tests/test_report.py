"""``babysit report`` on the real NaN-then-rollback run made by tests/test_status.py (shared, so
the job runs once per session), and on copies of it bent into the awkward cases: extra NaN/inf
rows and missing fields, no metrics at all, many ranks with a straggler."""

from __future__ import annotations

import io
import json
import re
import shutil
from pathlib import Path

import pytest

from supervisor.report import report_main
from tests.conftest import read_jsonl
from tests.test_status import real_run

pytestmark = pytest.mark.e2e

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FIGURES = ("training.png", "step_times.png", "timeline.png")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return real_run(tmp_path_factory)


def copy_run(run_dir: Path, to: Path) -> Path:
    to.mkdir()
    for name in ("events.jsonl", "metrics.jsonl"):
        shutil.copy(run_dir / name, to / name)
    return to


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


def test_report_of_a_rollback_run(tmp_path: Path, run_dir: Path) -> None:
    code, out, err = report(run_dir, tmp_path / "out" / "r.html")
    assert code == 0 and err == ""
    page = tmp_path / "out" / "r.html"
    assert out == f"babysit: wrote {page} with 3 plot(s) in {tmp_path / 'out' / 'r'}\n"
    linked = images(page)
    assert [p.name for p in linked] == list(FIGURES)
    assert {p.parent for p in linked} == {tmp_path / "out" / "r"}
    for png in linked:
        assert_png(png)
    text = page.read_text()
    finding = next(e for e in read_jsonl(run_dir / "events.jsonl")
                   if e["event"] == "finding" and e["remedy"]["action"] == "rollback")
    assert finding["finding"]["message"] in text and finding["remedy"]["reason"] in text.replace(
        "&gt;", ">")
    assert "succeeded" in text and "lr x0.5" in text and "#1" in text
    # The NaN steps not acted on (how many depends on timing) are summarised, not listed.
    not_acted = [e for e in read_jsonl(run_dir / "events.jsonl")
                 if e["event"] == "finding_set_aside"
                 or (e["event"] == "finding" and e["remedy"]["action"] == "ignore")]
    assert bool(re.search(rf"nonfinite x{len(not_acted)} \(steps \d+-\d+\)", text)) == bool(
        not_acted)


def test_default_location_is_inside_the_run_directory(tmp_path: Path, run_dir: Path) -> None:
    run = copy_run(run_dir, tmp_path / "run")
    assert report(run)[0] == 0
    assert [p.relative_to(run) for p in images(run / "report.html")] == [
        Path("report") / f for f in FIGURES]


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
    assert [p.name for p in images(run / "report.html")] == ["timeline.png"]
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


def test_not_a_run_directory(tmp_path: Path) -> None:
    code, out, err = report(tmp_path)
    assert code == 2 and out == "" and "Traceback" not in err
    assert err.startswith(f"babysit: error: {tmp_path} is not a babysit run directory")
    assert not (tmp_path / "report.html").exists()
