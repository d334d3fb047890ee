"""Alerts from a real run reach a real HTTP server on loopback (``babysit alert-test``:
``tests/supervisor/commands/test_cli_alerts.py``). The sink URL (with a secret-looking path)
must never appear in the journal or the output."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from babysit.supervisor.contract.directive import Directive
from tests.conftest import WEBHOOK_SECRET as SECRET
from tests.conftest import WORKERS, babysit_env, journal, read_jsonl, run_babysit
from tests.supervisor.commands.test_cli_alerts import config

pytestmark = pytest.mark.e2e


def test_a_crash_alerts_the_webhook_and_journals_the_delivery(tmp_path: Path, webhook,
                                                               monkeypatch) -> None:
    url, received = webhook
    monkeypatch.setenv("OPS_HOOK_URL", url)
    result = run_babysit("run", str(config(tmp_path, "--crash", "1:3")), cwd=tmp_path)
    assert result.returncode == 1
    bodies = [r["body"] for r in received]
    assert any(b["severity"] == "critical" and b["incident"] == "crash" and b["ranks"] == [1]
               for b in bodies), bodies
    journal = (tmp_path / "run" / "events.jsonl").read_text()
    deliveries = [e["result"] for e in read_jsonl(tmp_path / "run" / "events.jsonl")
                  if e["event"] == "alert_delivery"]
    assert deliveries and all(d["outcome"] == "delivered" for d in deliveries)
    assert SECRET not in journal and url.split("/services")[0] not in journal


def test_a_hang_and_a_spike_are_told_in_full_and_the_final_state_stays_scrapeable(
        tmp_path: Path, webhook, monkeypatch) -> None:
    """One real run, two incidents (rank 1 hangs at step 15 on the first attempt; batches 30-39
    are poisoned): the receiver gets, per incident, the finding, the remedy as applied (resume
    step, skipped batches, LR scale) and a recovered message, then "run finished"; after the
    run has ended, /metrics still answers with its final state; and the report of the run shows
    the eval loss the script reported, its config, and no raw JSON."""
    url, received = webhook
    monkeypatch.setenv("OPS_HOOK_URL", url)
    run_dir = tmp_path / "run"
    prom = tmp_path / "babysit.prom"
    path = tmp_path / "run.yaml"
    path.write_text(
        f"launch:\n  script: {WORKERS / 'tiny_train.py'}\n  nproc-per-node: 2\n"
        f"  args: [--steps, '50', --hang, '1:15', --spike, '30:40', --eval-every, '5']\n"
        f"run_dir: {run_dir}\n"
        "checkpoints: {every_steps: 5, probation_steps: 5}\n"
        # (The spike's rollback skips at once, no rerun first: tests/e2e/test_cause.py.)
        f"policy: {{name: {WORKERS.parent / 'fast_policy.yaml'}, "
        "overrides: {rollback: {rerun_max_steps: 0}}}\n"
        f"prometheus: {{enabled: true, port: 0, linger_s: 60, textfile: {prom}}}\n"
        "alerts:\n  sinks:\n"
        "    - {name: ops-hook, kind: webhook, url_env: OPS_HOOK_URL, min_severity: info}\n")
    proc = subprocess.Popen([sys.executable, "-m", "babysit", "run", str(path)], cwd=tmp_path,
                            env=babysit_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        ended = wait_for(lambda: so_far(run_dir, "run_finished"), timeout=150)
        assert ended and proc.poll() is None, "babysit should linger, serving the final state"
        (started,) = journal(run_dir, "prometheus_started")
        samples = scrape(started["url"])
        # The run is over and its last state is still scrapeable, with how it got there.
        assert samples[("babysit_run_state", (("state", "succeeded"),))] == 1
        assert samples[("babysit_run_state", (("state", "running"),))] == 0
        assert samples[("babysit_exit_code", ())] == 0
        moves = {labels: v for (name, labels), v in samples.items()
                 if name == "babysit_state_transitions_total"}
        assert moves[(("from_state", "running"), ("to_state", "intervening"))] == 2
        assert moves[(("from_state", "relaunching"), ("to_state", "starting"))] == 2
        # The LR scale in force at the last step: the rollback's cut, or on its way back.
        last = Directive.from_json(journal(run_dir, "launch")[-1]["directive"])
        cursor = read_jsonl(run_dir / "metrics.jsonl")[-1]["cursor"]
        assert samples[("babysit_lr_scale_ratio", ())] == pytest.approx(last.scale_at(cursor))
        assert samples[("babysit_step", ())] == 50
        assert samples[("babysit_last_good_checkpoint_age_seconds", ())] >= 0
        assert ("babysit_grad_norm", ()) in samples
        assert ("babysit_step_duration_seconds", ()) in samples
        # The goodput ledger, as the run ended: its categories make up the wall time.
        split = {dict(labels)["category"]: v for (name, labels), v in samples.items()
                 if name == "babysit_goodput_seconds"}
        assert sum(split.values()) == pytest.approx(samples[("babysit_goodput_wall_seconds", ())])
        assert split["detection"] > 0 and split["lost"] > 0  # the hang, the rollback
        assert 0 < samples[("babysit_goodput_ratio", ())] < 1
        assert 'babysit_run_state{state="succeeded"} 1.0' in prom.read_text()
        bodies = wait_for(lambda: [r["body"] for r in received
                                   if r["body"].get("kind") == "finished"], timeout=15)
        proc.send_signal(signal.SIGINT)  # Ctrl-C ends the linger at once
        out, _ = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert "serving the final metrics" in out
    bodies = [r["body"] for r in received]
    story = [b for b in bodies if b["kind"] != "warning"]
    hang = [b for b in story if b["incident"] == "hang"]
    spike = [b for b in story if b["incident_id"] and b not in hang]
    # The hang: found on rank 1 on this host, relaunched from the just-in-time state of step 14
    # (the last step it completed), recovered.
    assert [b["kind"] for b in hang] == ["incident", "remedy", "recovered"], hang
    assert hang[0]["ranks"] == [1] and hang[0]["host"] and hang[0]["incident_dir"]
    assert len({b["incident_id"] for b in hang}) == 1
    assert all(b["title"].startswith(f"[run #{hang[0]['incident_id']}]") for b in hang)
    assert hang[1]["remedy"]["resume_step"] == 14 and hang[1]["remedy"]["lr_scale"] == 1.0
    assert hang[1]["remedy"]["just_in_time"]["writers"] == [0]
    assert hang[1]["evidence"]["steps_to_redo"] == 1
    assert "resumed from the just-in-time state of step 14" in hang[1]["title"]
    assert hang[2]["evidence"]["time_lost_s"] > 0
    # The spike: rolled back before the poisoned batches, skipped them all, LR halved.
    assert [b["kind"] for b in spike] == ["incident", "remedy", "recovered"], spike
    applied = spike[1]["remedy"]
    assert applied["action"] == "rollback" and applied["lr_scale"] == 0.5
    assert applied["resume_step"] is not None and applied["resume_step"] <= 30
    (first, last), = applied["skipped_batches"]
    assert first <= 30 and last >= 39
    assert "resumed from step" in spike[1]["title"] and "skipped batches" in spike[1]["title"]
    # The end: one "finished" message, and nothing after it.
    assert bodies[-1]["kind"] == "finished" and bodies[-1]["evidence"]["incidents"] == 2
    assert "run finished" in bodies[-1]["title"]
    assert 0 < bodies[-1]["evidence"]["goodput"] < 1 and "goodput" in bodies[-1]["title"]

    report = run_babysit("report", str(run_dir), cwd=tmp_path)
    assert report.returncode == 0, report.stderr
    page = (run_dir / "report.html").read_text()
    assert (run_dir / "report" / "scalars.png").stat().st_size > 0
    assert "Run config" in page and "--eval-every" in page
    assert "rank 0, step 50: eval_loss" in page or "rank 1, step 50: eval_loss" in page
    assert "{&quot;" not in page  # no raw JSON anywhere


def so_far(run_dir: Path, event: str) -> list[dict[str, Any]]:
    """The journal entries of one kind written so far (none before the journal exists)."""
    path = run_dir / "events.jsonl"
    if not path.exists():
        return []
    lines = path.read_text().splitlines(keepends=True)
    return [e for e in map(json.loads, (x for x in lines if x.endswith("\n")))
            if e["event"] == event]


def wait_for(fetch: Callable[[], list[Any]], timeout: float) -> list[Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = fetch()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"nothing came within {timeout} s")


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """GET /metrics and parse it with Prometheus's own text parser."""
    with urllib.request.urlopen(url, timeout=5) as response:
        body = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body) for s in family.samples}
