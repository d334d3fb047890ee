"""The metrics endpoint, scraped for real over HTTP on loopback and parsed with Prometheus's own
text parser."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import prometheus_client
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from babysit.supervisor.services.exporter import Exporter, ExporterConfig, ExporterError
from babysit.supervisor.services.health import DiskSample, GpuSample, HealthSample, HostSample


@pytest.fixture
def exporter() -> Iterator[Exporter]:
    exp = Exporter(ExporterConfig(enabled=True, port=0), run_name="demo")
    exp.start()
    yield exp
    exp.stop()


def scrape(port: int) -> tuple[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]]:
    """GET /metrics the way an old Prometheus does (no Accept header); return the content type
    and every sample keyed by (name, sorted labels)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        assert resp.status == 200
        ctype, body = resp.headers["Content-Type"], resp.read().decode()
    samples = {}
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return ctype, samples


def test_metrics_appear_after_updates_in_the_standard_text_format(exporter: Exporter) -> None:
    assert exporter.port
    ctype, before = scrape(exporter.port)
    assert ctype == "text/plain; version=0.0.4; charset=utf-8"
    assert before[("babysit_run_info", (("name", "demo"),))] == 1
    # Not known yet: absent, not a misleading 0.
    assert not any(name in ("babysit_tokens_per_second", "babysit_loss", "babysit_step")
                   for name, _ in before)

    exporter.update(state="running", attempt=2, steps_per_second=4.5, tokens_per_second=9000.0,
                    dropped_reports=3)
    exporter.observe_step(120, loss=2.25, rank_step_s={0: 0.21, 1: 0.34})
    exporter.count_intervention("loss_spike", "rollback")
    exporter.count_intervention("loss_spike", "rollback")
    exporter.count_intervention("hang", "relaunch")
    _, after = scrape(exporter.port)

    assert after[("babysit_run_state", (("state", "running"),))] == 1
    assert after[("babysit_run_state", (("state", "starting"),))] == 0
    assert sum(v for (n, _), v in after.items() if n == "babysit_run_state") == 1
    assert after[("babysit_attempt", ())] == 2
    assert after[("babysit_step", ())] == 120
    assert after[("babysit_loss", ())] == 2.25
    assert after[("babysit_steps_per_second", ())] == 4.5
    assert after[("babysit_tokens_per_second", ())] == 9000
    assert after[("babysit_rank_step_seconds", (("rank", "1"),))] == 0.34
    assert after[("babysit_interventions_total",
                  (("action", "rollback"), ("incident", "loss_spike")))] == 2
    assert after[("babysit_interventions_total",
                  (("action", "relaunch"), ("incident", "hang")))] == 1
    assert after[("babysit_dropped_reports_total", ())] == 3


def test_a_new_attempt_forgets_the_old_ranks_and_health_is_exported(exporter: Exporter) -> None:
    assert exporter.port
    exporter.update(attempt=0)
    exporter.observe_step(5, rank_step_s={0: 0.1, 1: 0.1, 2: 0.1})
    exporter.update(attempt=1)
    exporter.observe_step(6, rank_step_s={0: 0.2})
    host = HostSample(64 * 2**30, 10 * 2**30, 84.0, 0, 0.0, (1.0, 1.0, 1.0), 16)
    gpu = GpuSample(0, "H100", 71.0, 0, False, (), 30 * 2**30, 80 * 2**30)
    exporter.observe_health(HealthSample(0.0, host, DiskSample("/", 5 * 2**30, 2**40), (), (gpu,)))
    _, got = scrape(exporter.port)
    assert [labels for name, labels in got if name == "babysit_rank_step_seconds"] == [
        (("rank", "0"),)]
    assert got[("babysit_host_memory_available_bytes", ())] == 10 * 2**30
    assert got[("babysit_disk_free_bytes", ())] == 5 * 2**30
    assert got[("babysit_gpu_temperature_celsius", (("gpu", "0"),))] == 71


def test_it_listens_on_loopback_only_by_default(exporter: Exporter) -> None:
    port = exporter.port
    assert port is not None
    assert exporter._server is not None
    assert exporter._server.server_address[0] == "127.0.0.1"
    others = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
              if a.family == socket.AF_INET and not a.address.startswith("127.")]
    if not others:
        pytest.skip("no non-loopback IPv4 address to try")
    # Refused, or silently dropped by a firewall: either way nothing answers there.
    with pytest.raises((ConnectionRefusedError, TimeoutError)):
        socket.create_connection((others[0], port), timeout=2).close()


def test_each_exporter_has_its_own_registry() -> None:
    a, b = Exporter(ExporterConfig(port=0)), Exporter(ExporterConfig(port=0))
    pa, pb = a.start(), b.start()
    try:
        a.observe_step(7, loss=1.0)
        assert ("babysit_step", ()) in scrape(pa)[1]
        assert ("babysit_step", ()) not in scrape(pb)[1]
        assert not [m for m in prometheus_client.REGISTRY.collect() if m.name.startswith("babysit")]
    finally:
        a.stop()
        b.stop()


def test_a_busy_port_is_one_clear_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ExporterError, match=rf"127\.0\.0\.1:{port}: .*prometheus\.port"):
            Exporter(ExporterConfig(port=port)).start()


def test_stop_closes_the_port_and_leaves_no_thread() -> None:
    before = set(threading.enumerate())
    exp = Exporter(ExporterConfig(port=0))
    port = exp.start()
    scrape(port)
    exp.stop()
    exp.stop()  # idempotent
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    deadline = time.monotonic() + 2  # a request thread may still be finishing its reply
    while set(threading.enumerate()) - before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert set(threading.enumerate()) - before == set()


def test_updates_are_cheap_enough_for_every_step(tmp_path: Path) -> None:
    exp = Exporter(ExporterConfig(port=0))  # not started: updates must not need the server
    ranks = {r: 0.1 for r in range(8)}
    t0 = time.perf_counter()
    for step in range(10_000):
        exp.observe_step(step, loss=2.0, rank_step_s=ranks)
        exp.update(steps_per_second=5.0)
    per_step_us = (time.perf_counter() - t0) / 10_000 * 1e6
    assert per_step_us < 50, per_step_us  # a few microseconds here; generous for loaded CI


def test_the_goodput_ledger_is_exported_by_category(exporter: Exporter) -> None:
    from babysit.supervisor.services.goodput import Ledger

    led = Ledger()
    led.entry({"time": 0.0, "event": "run_started", "attempt": 0})
    led.entry({"time": 0.0, "event": "launch", "attempt": 0, "directive": {"attempt": 0}})
    for step in range(1, 5):
        led.row({"time": 2.0 + step, "step": step, "attempt": 0})
    g = led.totals(now=7.0)
    exporter.observe_goodput(g.wall_s, g.seconds)
    assert exporter.port
    _, samples = scrape(exporter.port)
    assert samples[("babysit_goodput_wall_seconds", ())] == pytest.approx(7.0)
    assert samples[("babysit_goodput_ratio", ())] == pytest.approx(3.0 / 7.0)
    split = {dict(labels)["category"]: v for (name, labels), v in samples.items()
             if name == "babysit_goodput_seconds"}
    assert split["productive"] == pytest.approx(3.0) and split["startup"] == pytest.approx(3.0)
    assert sum(split.values()) == pytest.approx(7.0)
