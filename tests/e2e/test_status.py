"""``babysit status`` on a real run directory: the real CLI ran a 2-rank gloo job whose loss went
NaN, babysit rolled it back (relaunch with skipped batches and half the LR) and it finished.

The run is made once per test session by ``real_run`` and shared with tests/e2e/test_report.py
(about 20 s, mostly two torchrun start-ups); tests copy it before changing anything.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from babysit.supervisor.commands.history import snapshot
from babysit.supervisor.commands.status import status_main
from tests.conftest import ROOT, journal, read_jsonl, run_babysit

pytestmark = pytest.mark.e2e

_RUN: dict[str, Path] = {}
STATUS_KEYS = {
    "run_dir", "journal", "metrics", "name", "state", "live", "reason", "exit_code", "verdict",
    "supervisor_pid", "started", "finished", "elapsed_s", "last_update", "attempt", "attempts",
    "step", "loss", "steps_per_s", "tokens_per_s", "incident_count", "ignored_findings",
    "incidents", "attempt_history", "checkpoint_dir", "checkpoints", "mfu", "loss_spread", "sdc",
    "cadence", "nodes", "goodput", "reruns", "slurm", "memory_copies",
}


def real_run(factory: pytest.TempPathFactory) -> Path:
    """The shared real run directory (made on first use). Treat it as read-only."""
    if "dir" not in _RUN:
        base = factory.mktemp("nan_rollback")
        result = run_babysit(
            "run", "--nproc-per-node", "2", "--policy", str(ROOT / "tests" / "fast_policy.yaml"),
            "--run-dir", str(base / "run"), str(ROOT / "configs" / "demo_train.py"),
            "--steps", "60", "--n-layer", "1", "--n-embd", "32", "--n-head", "2",
            "--batch-size", "4", "--block-size", "32", "--eval-every", "1000", "--nan-at", "30",
            cwd=base)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        _RUN["dir"] = base / "run"
    return _RUN["dir"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return real_run(tmp_path_factory)


def status(run_dir: Path, as_json: bool) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = status_main(str(run_dir), as_json, out, err)
    return code, out.getvalue(), err.getvalue()


def test_json_agrees_with_the_journal_and_metrics(run_dir: Path) -> None:
    code, out, err = status(run_dir, as_json=True)
    assert code == 0 and err == ""
    s = json.loads(out)
    assert set(s) == STATUS_KEYS
    finished = journal(run_dir, "run_finished")[-1]
    assert (s["state"], s["exit_code"], s["reason"]) == (
        finished["state"], finished["exit_code"], finished["reason"]) == (
        "succeeded", 0, "workers finished")
    assert s["live"] is False and s["supervisor_pid"] == journal(run_dir, "run_started")[0]["pid"]
    assert s["journal"] == str(run_dir / "events.jsonl")
    last = read_jsonl(run_dir / "metrics.jsonl")[-1]
    assert (s["attempt"], s["step"], s["loss"]) == (last["attempt"], last["step"], last["loss"])
    # The NaN's steps rerun first (attempt 1), and rolled back past it once it came back.
    assert s["step"] == 60 and s["attempts"] == len(journal(run_dir, "launch")) == 3
    (rerun,) = s["reruns"]
    assert rerun["verdict"] == "reproduced" and "the data's: skipped" in rerun["summary"]
    (verdict,) = journal(run_dir, "rerun")  # non-finite again where it was: infinitely far
    assert verdict["first_excess"] == verdict["rerun_excess"] == "inf"
    assert s["steps_per_s"] > 0 and s["tokens_per_s"] > 0  # the demo reports tokens
    # Incidents: the findings the policy acted on; the NaN steps it ignored are counted.
    findings = journal(run_dir, "finding")
    acted = [f for f in findings if f["remedy"]["action"] != "ignore"]
    # (A loaded machine may add a timing alert, a straggler say: count what the journal holds.)
    assert s["incident_count"] == len(acted) >= 1
    set_aside = journal(run_dir, "finding_set_aside")  # NaN steps while workers were replaced
    assert s["ignored_findings"] == len(findings) - len(acted) + len(set_aside)
    nan = next(f for f in acted if f["finding"]["incident"] == "nonfinite")
    incident = next(i for i in s["incidents"] if i["incident"] == "nonfinite")
    assert (incident["action"], incident["step"], incident["ranks"]) == (
        "rollback", nan["finding"]["step"], nan["finding"]["ranks"])
    # The rollback past it: what attempt 2 was told (the directive) and why.
    assert s["attempt_history"][1]["skip"] == [] and s["attempt_history"][1]["lr_scale"] == 1.0
    told = journal(run_dir, "launch")[2]["directive"]
    again = s["attempt_history"][2]
    assert again["skip"] == [[r["start"], r["end"]] for r in told["skip"]] and again["skip"]
    assert again["lr_scale"] == told["lr_scale"] == 0.5
    assert again["cause"]["incident"] == "nonfinite" and s["attempt_history"][0]["cause"] is None
    # No checkpoint of the cadence's (every 100 steps) in 60 steps: the rerun from scratch
    # saved one where the data's rollback skips from, and that rollback resumed there.
    [saved] = s["checkpoints"]
    assert (saved["step"], saved["verdict"]) == (again["resume_step"], "pending") == (
        again["skip"][0][0], "pending")
    assert saved["reason"].startswith("replayed by the rerun of steps 1-")
    assert s["checkpoint_dir"] == str(run_dir / "checkpoints")
    # The ledger of this run (a NaN rollback): its categories make up its wall time.
    g = s["goodput"]
    assert g["wall_s"] == pytest.approx(s["elapsed_s"], abs=0.01)
    assert sum(g["seconds"].values()) == pytest.approx(g["wall_s"], abs=0.01)
    assert g["seconds"]["lost"] > 0 and g["seconds"]["relaunch"] > 0 and 0 < g["goodput"] < 1


def test_human_view_says_the_same_compactly(run_dir: Path) -> None:
    code, out, _ = status(run_dir, as_json=False)
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == f"babysit status: demo_train  ({run_dir})"
    labels = [line[2:14].strip() for line in lines[1:] if line.startswith("  ") and line[2] != " "]
    assert labels == ["state", "time", "progress", "speed", "rank loss", "cadence", "goodput",
                      "rerun", "incidents", "attempts", "checkpoints", "memory", "journal"]
    # DDP: every shard has a live replica, so memory copies are off by default, and why.
    assert "  memory      no copies: every shard of the state has live replicas (DDP)" in out
    assert re.search(r"  goodput     \d+\.\d% of [0-9.]+ s productive; badput .*lost", out)
    assert "  state       succeeded (workers finished), exit code 0" in lines
    assert "attempt 2 (3 launched), step 60, loss " in out
    assert "reproduced on the rerun at batch" in out
    start, end = json.loads(status(run_dir, True)[1])["attempt_history"][2]["skip"][0]
    step = next(f["finding"]["step"] for f in journal(run_dir, "finding")
                if f["remedy"]["action"] == "rollback")
    # The LR cut wears off after the skipped batches (issue 14's re-warm), and the line says so.
    assert f"skip batches {start}-{end - 1}, lr x0.5 from batch {start}, back to x1 over " \
           f"batches {end}-" in out
    assert f"(after nonfinite at step {step} -> rollback)" in out
    incident = next(line for line in lines if "-> rollback" in line and "ranks" in line)
    assert f"step {step:>6}  nonfinite" in incident and "non-finite" in incident
    assert lines[-1] == f"  journal     {run_dir / 'events.jsonl'}"
    assert all(len(line) < 200 for line in lines)


def test_not_a_run_directory_is_one_clear_paragraph(tmp_path: Path, run_dir: Path) -> None:
    for path, what in [(tmp_path, "no events.jsonl in it"), (tmp_path / "nope", "does not exist"),
                       (run_dir / "events.jsonl", "is a file")]:
        code, out, err = status(path, as_json=True)
        assert code == 2 and out == ""
        assert err.startswith(f"babysit: error: {path} ") and what in err
        assert "Traceback" not in err and err.count("\n") == 1


def test_live_run_and_abandoned_run(tmp_path: Path, run_dir: Path) -> None:
    """Without run_finished the supervisor's pid decides: alive -> its last state, gone ->
    abandoned. A torn last line (babysit writing it right now) is skipped, not fatal."""
    entries = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] != "run_finished"]
    (tmp_path / "metrics.jsonl").write_text(
        (run_dir / "metrics.jsonl").read_text() + '{"step": 61, "time": 17')

    def with_pid(pid: int) -> dict[str, Any]:
        entries[0]["pid"] = pid
        (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in entries))
        return snapshot(tmp_path)

    live = with_pid(os.getpid())  # this test process started before the run: a fitting pid
    assert (live["state"], live["live"], live["exit_code"]) == ("succeeded", True, None)
    assert live["state"] == journal(run_dir, "state")[-1]["new"] and live["step"] == 60
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    gone = with_pid(int(done.stdout))
    assert (gone["state"], gone["live"]) == ("abandoned", False)
    assert f"pid {int(done.stdout)} is gone" in gone["reason"]


def test_reads_only_the_tail_of_a_huge_metrics_file(tmp_path: Path, run_dir: Path) -> None:
    """A 4 GiB metrics file (sparse: no disk used) answers in milliseconds: status seeks to the
    end instead of reading it."""
    shutil.copy(run_dir / "events.jsonl", tmp_path)
    with open(tmp_path / "metrics.jsonl", "wb") as f:
        f.truncate(4 << 30)
        f.seek(0, os.SEEK_END)
        f.write(b"\n" + (run_dir / "metrics.jsonl").read_bytes())
    started = time.perf_counter()
    s = snapshot(tmp_path)
    assert time.perf_counter() - started < 0.5
    assert s["step"] == 60 and s["steps_per_s"] > 0
    # Not a 4 GiB read for the ledger either: the one the supervisor journaled at its end.
    assert s["goodput"]["source"] == "journal" and s["goodput"]["wall_s"] > 0
