"""AlertDispatcher against a real HTTP server on loopback: payloads, retries, timeouts, limits,
never blocking the caller, and never leaking the webhook URL.

The server is http.server in a thread; each test scripts its replies (status, headers, body,
delay). Nothing in requests is mocked.
"""

from __future__ import annotations

import json
import logging
import socket
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal

import pytest

from babysit.policies.types import Incident, Severity
from babysit.supervisor.services.alerts import (
    Alert,
    AlertConfigError,
    AlertDispatcher,
    AlertsConfig,
    SinkConfig,
)

SECRET_PATH = "/services/T000/B000/SECRETxyz"
SECRET = "SECRETxyz"


# --- a scriptable webhook endpoint -------------------------------------------------------------


@dataclass
class Reply:
    status: int = 200
    body: bytes = b"ok"
    headers: dict[str, str] = field(default_factory=dict)
    delay: float = 0.0


@dataclass
class Received:
    at: float
    path: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class Endpoint:
    """Replies with ``script`` in order, then with ``default``; remembers every request."""

    def __init__(self) -> None:
        self.script: deque[Reply] = deque()
        self.default = Reply()
        self.received: list[Received] = []
        self.cond = threading.Condition()
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with endpoint.cond:
                    endpoint.received.append(
                        Received(time.monotonic(), self.path, dict(self.headers), body)
                    )
                    reply = endpoint.script.popleft() if endpoint.script else endpoint.default
                    endpoint.cond.notify_all()
                time.sleep(reply.delay)
                try:
                    self.send_response(reply.status)
                    for name, value in reply.headers.items():
                        self.send_header(name, value)
                    self.send_header("Content-Length", str(len(reply.body)))
                    self.end_headers()
                    self.wfile.write(reply.body)
                except OSError:
                    pass  # the client timed out and went away

            def log_message(self, format: str, *args: Any) -> None:
                pass  # the request line holds the secret path; keep stderr clean too

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )

    def url(self, path: str = SECRET_PATH) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}{path}"

    def wait_for(self, n: int, timeout: float = 5.0) -> list[Received]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.received) >= n, timeout), self.received
            return list(self.received)


class Records:
    """Collects on_result records; ``wait_for(n)`` blocks until n have arrived."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.cond = threading.Condition()

    def __call__(self, record: dict[str, Any]) -> None:
        with self.cond:
            self.items.append(record)
            self.cond.notify_all()

    def wait_for(self, n: int, timeout: float = 5.0) -> list[dict[str, Any]]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.items) >= n, timeout), self.items
            return list(self.items)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def endpoint() -> Iterator[Endpoint]:
    ep = Endpoint()
    ep.thread.start()
    yield ep
    ep.server.shutdown()
    ep.server.server_close()


@pytest.fixture
def closed_port_url() -> str:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now: connections are refused
    return f"http://127.0.0.1:{port}{SECRET_PATH}"


def make(
    url: str,
    records: Callable[[dict[str, Any]], None],
    *,
    kind: Literal["slack", "webhook"] = "webhook",
    clock: FakeClock | None = None,
    queue_size: int = 100,
    **sink: Any,
) -> AlertDispatcher:
    sink.setdefault("backoff_s", 0.02)
    config = AlertsConfig(
        sinks=[SinkConfig(name="hook", kind=kind, url_env="HOOK_URL", **sink)],
        queue_size=queue_size,
    )
    return AlertDispatcher.from_config(
        config,
        on_result=records,
        environ={"HOOK_URL": url},
        clock=clock or time.monotonic,
    )


def alert(title: str = "Loss spike: 9.12 vs baseline 2.31", **kw: Any) -> Alert:
    fields: dict[str, Any] = {
        "severity": Severity.CRITICAL,
        "run": "gpt2-small",
        "attempt": 2,
        "step": 5120,
        "ranks": (3,),
        "incident": Incident.LOSS_SPIKE,
        "action": "rollback to step 5000, lr x0.5",
        "evidence": {"loss": 9.12, "baseline": 2.31, "grad_norm": float("nan")},
        "incident_dir": "runs/gpt2/incidents/0003",
        "time": 1738324800.0,
    }
    fields.update(kw)
    return Alert(title=title, **fields)


# --- payloads on the wire ----------------------------------------------------------------------


def test_slack_message_is_block_kit_with_text_fallback(endpoint: Endpoint) -> None:
    records = Records()
    with make(endpoint.url(), records, kind="slack") as alerts:
        alerts.submit(alert())
        assert records.wait_for(1)[0]["outcome"] == "delivered"
    got = endpoint.received[0]
    assert got.path == SECRET_PATH
    assert got.headers["Content-Type"].startswith("application/json")
    body = got.json()
    assert "Loss spike" in body["text"] and "gpt2-small" in body["text"]
    header, facts, evidence, context = body["blocks"]
    assert header["type"] == "header" and header["text"]["type"] == "plain_text"
    assert "CRITICAL" in header["text"]["text"] and "Loss spike" in header["text"]["text"]
    shown = {f["text"].split("\n")[0].strip("*"): f["text"].split("\n")[1] for f in facts["fields"]}
    assert shown["Run"] == "gpt2-small"
    assert shown["Attempt"] == "2" and shown["Step"] == "5120" and shown["Rank(s)"] == "3"
    assert shown["What babysit did"] == "rollback to step 5000, lr x0.5"
    assert ":rotating_light:" in shown["Severity"]
    assert "loss: 9.12" in evidence["text"]["text"] and "grad_norm: nan" in evidence["text"]["text"]
    assert any("runs/gpt2/incidents/0003" in e["text"] for e in context["elements"])


def test_webhook_payload_is_the_documented_v1_shape(endpoint: Endpoint) -> None:
    records = Records()
    with make(endpoint.url(), records) as alerts:
        alerts.submit(alert())
        records.wait_for(1)
    assert endpoint.received[0].json() == {
        "version": 1,
        "title": "Loss spike: 9.12 vs baseline 2.31",
        "severity": "critical",
        "run": "gpt2-small",
        "attempt": 2,
        "step": 5120,
        "ranks": [3],
        "incident": "loss_spike",
        "action": "rollback to step 5000, lr x0.5",
        "evidence": {"loss": 9.12, "baseline": 2.31, "grad_norm": "nan"},
        "incident_dir": "runs/gpt2/incidents/0003",
        "time": "2025-01-31T12:00:00.000Z",
        "dedup_key": "loss_spike:Loss spike: 9.12 vs baseline 2.31",
        "suppressed": {"duplicates": 0, "rate_limited": 0},
        "kind": "alert",
        "incident_id": None,
        "host": None,
        "node": None,
        "needs": None,
        "remedy": None,
    }


def test_severity_routes_per_sink(endpoint: Endpoint) -> None:
    records = Records()
    config = AlertsConfig(
        sinks=[
            SinkConfig(name="all", kind="webhook", url_env="U", min_severity="info"),
            SinkConfig(name="pager", kind="webhook", url_env="U", min_severity="critical"),
        ]
    )
    env = {"U": endpoint.url()}
    with AlertDispatcher.from_config(config, on_result=records, environ=env) as alerts:
        alerts.submit(alert("fyi", severity=Severity.INFO))
        alerts.submit(alert("on fire", severity=Severity.CRITICAL))
        got = records.wait_for(3)
    assert sorted((r["sink"], r["title"]) for r in got) == [
        ("all", "fyi"),
        ("all", "on fire"),
        ("pager", "on fire"),
    ]


# --- retries and failures ----------------------------------------------------------------------


def test_server_error_is_retried_then_delivered(endpoint: Endpoint) -> None:
    endpoint.script.append(Reply(status=500, body=b"oops"))
    records = Records()
    with make(endpoint.url(), records, max_retries=3) as alerts:
        alerts.submit(alert())
        (record,) = records.wait_for(1)
    assert record["outcome"] == "delivered"
    assert record["attempts"] == 2 and record["status"] == 200 and record["error"] is None
    assert len(endpoint.received) == 2


def test_timeout_is_retried_then_recorded_as_failed(endpoint: Endpoint) -> None:
    endpoint.default = Reply(delay=0.6)
    records = Records()
    with make(endpoint.url(), records, timeout_s=0.2, max_retries=1) as alerts:
        alerts.submit(alert())
        (record,) = records.wait_for(1)
    assert record["outcome"] == "failed"
    assert record["attempts"] == 2 and record["status"] is None
    assert record["error"] == "ReadTimeout"
    assert "no response within 0.2 s" in record["detail"]
    assert len(endpoint.received) == 2


def test_client_error_is_not_retried(endpoint: Endpoint) -> None:
    endpoint.default = Reply(status=404, body=b"no_service")
    records = Records()
    with make(endpoint.url(), records, max_retries=3) as alerts:
        alerts.submit(alert())
        (record,) = records.wait_for(1)
    assert record["outcome"] == "failed"
    assert record["attempts"] == 1 and record["status"] == 404
    assert "no_service" in record["detail"]


def test_429_honours_retry_after(endpoint: Endpoint) -> None:
    endpoint.script.append(Reply(status=429, headers={"Retry-After": "1"}))
    records = Records()
    with make(endpoint.url(), records, backoff_s=0.0, max_backoff_s=5.0) as alerts:
        alerts.submit(alert())
        (record,) = records.wait_for(1, timeout=5)
    first, second = endpoint.received
    assert record["outcome"] == "delivered" and record["attempts"] == 2
    assert second.at - first.at >= 0.9


def test_429_retry_after_is_capped(endpoint: Endpoint) -> None:
    endpoint.script.append(Reply(status=429, headers={"Retry-After": "3600"}))
    records = Records()
    with make(endpoint.url(), records, max_backoff_s=0.1) as alerts:
        alerts.submit(alert())
        (record,) = records.wait_for(1, timeout=3)
    first, second = endpoint.received
    assert record["outcome"] == "delivered"
    assert second.at - first.at < 1.0


def test_unreachable_endpoint_is_recorded_as_failed(closed_port_url: str) -> None:
    records = Records()
    with make(closed_port_url, records, max_retries=2) as alerts:
        alerts.submit(alert())
        (record,) = records.wait_for(1)
    assert record["outcome"] == "failed"
    assert record["attempts"] == 3 and record["status"] is None
    assert record["error"] == "ConnectionError"
    assert "connection failed" in record["detail"]
    assert alerts.stats()["hook"]["failed"] == 1


# --- never blocking the caller -----------------------------------------------------------------


def test_submit_keeps_the_callers_pace_while_the_endpoint_is_slow(endpoint: Endpoint) -> None:
    endpoint.default = Reply(delay=0.3)
    records = Records()
    alerts = make(endpoint.url(), records, queue_size=5, dedup_window_s=0)
    alerts.start()
    durations = []
    for i in range(300):
        t0 = time.perf_counter()
        alerts.submit(alert(f"alert {i}"))
        durations.append(time.perf_counter() - t0)
        time.sleep(0.001)  # a supervisor loop doing its own work between alerts
    assert statistics.median(durations) < 0.001
    assert max(durations) < 0.05
    t0 = time.monotonic()
    alerts.close(timeout_s=0.5)
    assert time.monotonic() - t0 < 1.5
    dropped = [r for r in records.items if r["outcome"] == "dropped"]
    assert {r["reason"] for r in dropped} <= {"queue_full", "shutdown"}
    assert sum(r["count"] for r in dropped) >= 300 - 5 - len(endpoint.received)
    stats = alerts.stats()["hook"]
    assert stats["dropped"] + stats["delivered"] + stats["failed"] + stats["rate_limited"] == 300


def test_close_drains_within_its_deadline(endpoint: Endpoint) -> None:
    endpoint.default = Reply(delay=0.2)
    records = Records()
    alerts = make(endpoint.url(), records, dedup_window_s=0)
    alerts.start()
    for i in range(10):
        alerts.submit(alert(f"alert {i}"))
    t0 = time.monotonic()
    assert alerts.close(timeout_s=0.5) is True
    assert time.monotonic() - t0 < 0.5 + 0.4
    delivered = [r for r in records.items if r["outcome"] == "delivered"]
    dropped = [r for r in records.items if r["outcome"] == "dropped"]
    failed = [r for r in records.items if r["outcome"] == "failed"]
    assert 1 <= len(delivered) <= 3
    assert dropped and dropped[-1]["reason"] == "shutdown"
    assert len(delivered) + len(failed) + sum(r["count"] for r in dropped) == 10
    alerts.submit(alert("after close"))  # counted and dropped, not raised
    assert alerts.stats()["hook"]["dropped"] == sum(r["count"] for r in dropped) + 1


def test_alerts_submitted_before_start_are_sent_after(endpoint: Endpoint) -> None:
    records = Records()
    alerts = make(endpoint.url(), records)
    alerts.submit(alert())
    alerts.start()
    assert records.wait_for(1)[0]["outcome"] == "delivered"
    alerts.close(1)


def test_a_failing_on_result_callback_does_not_stop_delivery(endpoint: Endpoint) -> None:
    def explode(record: dict[str, Any]) -> None:
        raise RuntimeError("journal is full")

    with make(endpoint.url(), explode, dedup_window_s=0) as alerts:
        alerts.submit(alert("one"))
        alerts.submit(alert("two"))
        endpoint.wait_for(2)


# --- de-duplication and rate limiting, through the real path ----------------------------------


def test_duplicates_are_suppressed_and_counted(endpoint: Endpoint) -> None:
    clock, records = FakeClock(), Records()
    with make(endpoint.url(), records, clock=clock, dedup_window_s=600) as alerts:
        for step in (100, 110, 120):
            alerts.submit(alert(f"hang at step {step}", step=step, dedup_key="hang:rank3"))
        got = records.wait_for(3)
        assert [(r["outcome"], r.get("count")) for r in got] == [
            ("delivered", None),
            ("suppressed", 1),
            ("suppressed", 2),
        ]
        clock.now += 601  # the window has passed: a reminder goes out, with the count
        alerts.submit(alert("hang at step 900", dedup_key="hang:rank3"))
        assert records.wait_for(4)[3]["outcome"] == "delivered"
    assert len(endpoint.received) == 2
    assert endpoint.received[1].json()["suppressed"] == {"duplicates": 2, "rate_limited": 0}


def test_rate_limit_drops_the_excess_and_reports_it_next_time(endpoint: Endpoint) -> None:
    clock, records = FakeClock(), Records()
    limit = {"max_alerts": 2, "window_s": 60}
    with make(endpoint.url(), records, kind="slack", clock=clock, rate_limit=limit) as alerts:
        for i in range(5):
            alerts.submit(alert(f"straggler {i}"))
        got = records.wait_for(5)
        assert [(r["outcome"], r.get("count")) for r in got] == [
            ("delivered", None),
            ("delivered", None),
            ("rate_limited", 1),
            ("rate_limited", 2),
            ("rate_limited", 3),
        ]
        clock.now += 61
        alerts.submit(alert("straggler 5"))
        assert records.wait_for(6)[5]["outcome"] == "delivered"
    assert len(endpoint.received) == 3
    context = endpoint.received[2].json()["blocks"][-1]["elements"]
    assert any("3 alert(s) suppressed by the rate limit" in e["text"] for e in context)


# --- configuration and the alert-test command --------------------------------------------------


def test_missing_url_variable_is_a_startup_error_naming_sink_and_variable() -> None:
    config = AlertsConfig(
        sinks=[SinkConfig(name="team-slack", kind="slack", url_env="BABYSIT_SLACK_URL")]
    )
    with pytest.raises(AlertConfigError) as err:
        AlertDispatcher.from_config(config, environ={})
    message = str(err.value)
    assert "team-slack" in message and "BABYSIT_SLACK_URL" in message
    assert "export BABYSIT_SLACK_URL=" in message


def test_test_all_reports_each_sink(endpoint: Endpoint, closed_port_url: str) -> None:
    config = AlertsConfig(
        sinks=[
            SinkConfig(name="good", kind="slack", url_env="GOOD", min_severity="critical"),
            SinkConfig(name="down", kind="webhook", url_env="DOWN", timeout_s=1),
        ]
    )
    env = {"GOOD": endpoint.url(), "DOWN": closed_port_url}
    results = AlertDispatcher.from_config(config, environ=env).test_all()
    assert [(name, ok) for name, ok, _ in results] == [("good", True), ("down", False)]
    assert "HTTP 200" in results[0][2] and "connection failed" in results[1][2]
    assert "alert test" in endpoint.received[0].json()["text"]


# --- the URL is a secret -----------------------------------------------------------------------


def test_the_url_never_appears_in_records_logs_or_errors(
    endpoint: Endpoint, closed_port_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    # The endpoint echoes the URL in its error body, as some proxies do.
    endpoint.script.extend([Reply(status=503, body=endpoint.url().encode())] * 2)
    endpoint.script.append(Reply(status=400, body=f"bad request to {SECRET_PATH}".encode()))
    endpoint.script.append(Reply(delay=0.4))
    records = Records()
    shown: list[str] = []
    scenarios: list[tuple[str, dict[str, Any]]] = [
        (endpoint.url(), {"max_retries": 1}),  # 503, 503 -> failed
        (endpoint.url(), {"max_retries": 1}),  # 400 echoing the path -> failed
        (endpoint.url(), {"max_retries": 0, "timeout_s": 0.1}),  # timeout
        (closed_port_url, {"max_retries": 1}),  # refused
    ]
    for url, sink in scenarios:
        with make(url, records, kind="slack", **sink) as alerts:
            shown.append(repr(alerts))
            alerts.submit(alert())
            records.wait_for(len(records.items) + 1)
    assert [r["outcome"] for r in records.items] == ["failed"] * 4
    endpoint.default = Reply(status=404, body=endpoint.url().encode())
    for url in (endpoint.url(), closed_port_url):
        shown.extend(detail for *_, detail in make(url, records).test_all())
    for bad in ["ftp://example.com" + SECRET_PATH, "not a url " + SECRET]:
        with pytest.raises(AlertConfigError) as err:
            make(bad, records)
        shown.append(str(err.value))
    everything = json.dumps(records.items) + caplog.text + "\n".join(shown)
    assert "Max retries" not in everything  # requests' own (URL-bearing) message is never used
    assert SECRET not in everything
    # urllib3 did log its request lines (with the path) at DEBUG; the filter scrubbed them.
    assert '"POST <redacted> HTTP/1.1"' in caplog.text
