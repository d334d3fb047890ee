"""The background services during a real run: the Prometheus endpoint serves live values, health
samples and digests are journaled by the scheduled jobs."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import WORKERS, babysit_env, read_jsonl

pytestmark = pytest.mark.e2e


def test_metrics_endpoint_and_scheduled_jobs_on_a_live_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text(
        f"launch:\n  script: {WORKERS / 'tiny_train.py'}\n  nproc-per-node: 2\n"
        f"  args: [--steps, '80', --step-sleep, '0.05', --slow-data, '1:0.06']\n"
        f"run_dir: {run_dir}\n"
        "prometheus: {enabled: true, port: 0, linger_s: 0}\n"
        "schedule: {health_every_s: 0.5, digest_every_s: 2.0}\n")
    proc = subprocess.Popen([sys.executable, "-m", "babysit", "run", str(config)],
                            cwd=tmp_path, env=babysit_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        body = ""
        running = 'babysit_run_state{state="running"} 1.0'
        rank1 = 'babysit_rank_step_seconds{rank="1"}'
        deadline = time.monotonic() + 90
        # The state shows "running" from the first step on, but a rank's first step has no
        # step time yet (it is measured between steps): wait for all three.
        while time.monotonic() < deadline and not ("babysit_step " in body and running in body
                                                   and rank1 in body):
            time.sleep(0.5)
            # The run directory comes a moment before its journal: wait for the journal.
            journal = run_dir / "events.jsonl"
            started = [e for e in read_jsonl(journal)
                       if e["event"] == "prometheus_started"] if journal.exists() else []
            if started:
                with urllib.request.urlopen(started[0]["url"], timeout=5) as response:
                    assert response.headers["Content-Type"].startswith("text/plain")
                    body = response.read().decode()
        assert started and started[0]["url"].startswith("http://127.0.0.1:")
        assert "babysit_step " in body and running in body
        assert rank1 in body
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    journal = read_jsonl(run_dir / "events.jsonl")
    assert any(e["event"] == "digest" for e in journal)
    assert "babysit: [digest]" in out
    # The straggler (rank 1's slow loader) was counted as an intervention in the metrics too.
    assert any(e["event"] == "finding" and e["finding"]["incident"] == "straggler"
               for e in journal)
    json.dumps(journal)  # every entry is plain JSON
