"""Alerts from a real run reach a real HTTP server on loopback; ``babysit alert-test`` too.
The sink URL (with a secret-looking path) must never appear in the journal or the output."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import WORKERS, read_jsonl, run_babysit

SECRET = "T000/B000/SECRETxyz"


@pytest.fixture
def server() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    received: list[dict[str, Any]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append({"path": self.path, "body": json.loads(body)})
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/services/{SECRET}", received
    httpd.shutdown()


def config(tmp_path: Path, *args: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(
        f"launch:\n  script: {WORKERS / 'tiny_train.py'}\n  nproc-per-node: 2\n"
        f"  args: {json.dumps(list(args))}\n"
        f"run_dir: {tmp_path / 'run'}\n"
        "alerts:\n  sinks:\n    - {name: ops-hook, kind: webhook, url_env: OPS_HOOK_URL}\n")
    return path


def test_alert_test_sends_one_alert_per_sink(tmp_path: Path, server, monkeypatch) -> None:
    url, received = server
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


@pytest.mark.e2e
def test_a_crash_alerts_the_webhook_and_journals_the_delivery(tmp_path: Path, server,
                                                               monkeypatch) -> None:
    url, received = server
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
