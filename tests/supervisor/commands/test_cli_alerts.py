"""``babysit alert-test`` and ``babysit validate`` on a config with an alert sink: the real CLI
in a subprocess, a real HTTP server on loopback, and the sink URL never in the output (the alerts
of a real run: ``tests/e2e/test_alerts.py``)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import WEBHOOK_SECRET as SECRET
from tests.conftest import WORKERS, run_babysit


def config(tmp_path: Path, *args: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(
        f"launch:\n  script: {WORKERS / 'tiny_train.py'}\n  nproc-per-node: 2\n"
        f"  args: {json.dumps(list(args))}\n"
        f"run_dir: {tmp_path / 'run'}\n"
        "alerts:\n  sinks:\n    - {name: ops-hook, kind: webhook, url_env: OPS_HOOK_URL}\n")
    return path


def test_alert_test_sends_one_alert_per_sink(tmp_path: Path, webhook, monkeypatch) -> None:
    url, received = webhook
    monkeypatch.setenv("OPS_HOOK_URL", url)
    result = run_babysit("alert-test", str(config(tmp_path)), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("ops-hook: delivered")
    assert len(received) == 1 and received[0]["body"]["version"] == 1
    assert SECRET not in result.stdout + result.stderr


def test_missing_url_variable_is_a_config_error(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("OPS_HOOK_URL", raising=False)
    result = run_babysit("validate", str(config(tmp_path)), cwd=tmp_path)
    assert result.returncode == 2
    assert "alerts:" in result.stderr and "OPS_HOOK_URL" in result.stderr
