"""The scheduler recipes in docs/multinode.md do what the exit codes mean: the Slurm requeue
snippet is taken from the document as written and run by bash against a real run directory and
the real ``babysit status``, with ``scontrol`` the one stand-in (it records what it is asked)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def slurm_requeue_snippet() -> str:
    text = (ROOT / "docs" / "multinode.md").read_text()
    start = text.index("```bash", text.index("To requeue on a cause outside the job"))
    body = text[start + len("```bash"):text.index("```", start + len("```bash"))]
    assert "scontrol requeue" in body and "/shared/runs/$SLURM_JOB_ID" in body
    return body


def run_recipe(tmp_path: Path, finished: dict[str, object], exclude: str = "") -> tuple[int, str]:
    run_dir = tmp_path / "runs" / "4242"
    run_dir.mkdir(parents=True)
    entries = [{"time": 1.0, "event": "run_started", "attempt": 0, "name": "llm", "pid": 1},
               {"time": 9.0, "event": "run_finished", "attempt": 3, "step": 800, **finished}]
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in entries))
    if exclude:
        (run_dir / "exclude_hosts").write_text(exclude)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "scontrol.calls"
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    (bin_dir / "scontrol").chmod(0o755)
    script = slurm_requeue_snippet().replace("/shared/runs/", f"{tmp_path}/runs/")
    env = {**os.environ, "SLURM_JOB_ID": "4242",
           "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
    done = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True,
                          timeout=60)
    return done.returncode, calls.read_text() if calls.exists() else ""


def test_a_requeue_verdict_requeues_the_job_without_the_hosts_it_names(tmp_path: Path) -> None:
    code, calls = run_recipe(tmp_path, {"state": "failed", "exit_code": 75,
                                        "reason": "node lost", "verdict": "requeue",
                                        "why": "outside the job", "exclude_hosts": ["gpu-3"]},
                             exclude="gpu-3\ngpu-5\n")
    assert code == 75
    assert calls.splitlines() == ["update JobId=4242 ExcNodeList=gpu-3,gpu-5",
                                  "requeue 4242"]


@pytest.mark.parametrize(("finished", "code"), [
    ({"state": "failed", "exit_code": 1, "reason": "data", "verdict": "stop", "why": "own"}, 1),
    ({"state": "succeeded", "exit_code": 0, "reason": "workers finished"}, 0),
])
def test_a_stop_or_a_success_is_not_requeued(tmp_path: Path, finished: dict[str, object],
                                             code: int) -> None:
    assert run_recipe(tmp_path, finished) == (code, "")
