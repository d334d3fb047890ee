"""NCCL on the GPU: a 1-rank NCCL job under babysit, with torch's flight recorder switched on
by babysit and its dump collected into a hang's incident folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import babysat, journal, read_jsonl

pytestmark = [pytest.mark.gpu, pytest.mark.e2e]

NCCL = ("--device", "cuda", "--backend", "nccl", "--ddp")


def test_a_one_rank_nccl_job_runs_and_checkpoints(tmp_path: Path) -> None:
    result, run_dir = babysat(tmp_path, "nccl", "--steps", "12", *NCCL, nproc=1)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert ", nccl" in result.stdout  # the worker's own line: its default group is NCCL
    saved = [e["checkpoint_step"] for e in journal(run_dir, "checkpoint_saved")]
    assert 10 in saved
    assert read_jsonl(run_dir / "events.jsonl")[-1]["state"] == "succeeded"


def test_a_hang_collects_the_nccl_flight_recorder(tmp_path: Path) -> None:
    # Rank 0 sleeps outside any collective at step 8; babysit detects the hang (fast policy:
    # seconds), asks the rank's flight recorder for a dump through torch's pipe, and relaunches.
    result, run_dir = babysat(tmp_path, "hang", "--steps", "16", "--hang", "0:8", *NCCL,
                              nproc=1)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (record,) = journal(run_dir, "incident")
    folder = Path(record["dir"])
    dumps = sorted((folder / "flight_recorder").glob("rank_*"))
    assert [d.name for d in dumps] == ["rank_0"], sorted(p.name for p in folder.rglob("*"))
    assert dumps[0].stat().st_size > 0
    assert "flight_recorder/" in (folder / "summary.txt").read_text()
    assert read_jsonl(run_dir / "events.jsonl")[-1]["state"] == "succeeded"
