"""Health sampling against real processes and the real file system; judgement exhaustively.

The only fake is the NVML module (``FakeNvml``): the C library behind ``pynvml`` talks to the
GPU driver, and no test can make a real GPU run hot or report ECC errors. This machine has no
GPU, so the real "absent" path is tested for real.
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from babysit.supervisor.services.health import (
    GIB,
    DiskSample,
    GpuSample,
    HealthConfig,
    HealthKind,
    HealthSample,
    HealthSampler,
    HealthWatch,
    HostSample,
    Nvml,
    ThrottleReason,
    WorkerSample,
    judge,
    machine_faults,
    sample,
)

# -- real sampling ---------------------------------------------------------------------------------


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        p.kill()
        p.wait()


def test_sample_reads_real_workers_and_skips_vanished_ones(
        tmp_path: Path, children: list[subprocess.Popen[bytes]]) -> None:
    sleeper = subprocess.Popen(["sleep", "30"])
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    gone = subprocess.Popen(["true"])
    gone.wait()  # reaped: its pid names no process any more
    zombie = subprocess.Popen(["true"])
    children += [sleeper, busy, zombie]
    time.sleep(0.1)  # the zombie has exited but is not reaped

    sampler = HealthSampler()
    pids = [sleeper.pid, busy.pid, gone.pid, zombie.pid]
    first = sampler.sample(pids, tmp_path / "ckpt")
    time.sleep(0.5)
    sleeper.kill()  # vanishes between samples
    sleeper.wait()
    second = sampler.sample(pids, tmp_path / "ckpt")
    sampler.close()

    by_pid = {w.pid: w for w in first.workers}
    assert gone.pid not in by_pid
    assert by_pid[sleeper.pid].rss_bytes > 0 and by_pid[sleeper.pid].name == "sleep"
    assert by_pid[busy.pid].cpu_percent is None  # CPU% needs two looks
    later = {w.pid: w for w in second.workers}
    assert sleeper.pid not in later
    cpu = later[busy.pid].cpu_percent
    assert cpu is not None and cpu > 5.0, cpu  # it spins a core


def test_disk_is_measured_on_the_nearest_existing_parent(tmp_path: Path) -> None:
    s = sample([], tmp_path / "not" / "yet" / "created")
    assert s.disk is not None and s.disk.path == str(tmp_path)
    assert abs(s.disk.free_bytes - shutil.disk_usage(tmp_path).free) < 256 * 1024**2
    assert s.host.memory_total_bytes > s.host.memory_available_bytes > 0
    assert len(s.host.load_average) == 3


def test_without_a_gpu_the_gpu_field_is_none_with_a_reason(tmp_path: Path) -> None:
    s = sample([], tmp_path)
    if s.gpus is not None:
        pytest.skip("this machine has a working GPU driver")
    assert s.gpu_unavailable is not None
    assert s.gpu_unavailable.startswith(("no NVML library", "NVML init failed: "))


def test_without_the_nvml_package_the_reason_says_what_to_install(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` fail
    s = sample([], tmp_path)
    assert s.gpus is None
    assert s.gpu_unavailable == "no NVML library (install nvidia-ml-py to read GPU health)"


# -- the GPU path, through a fake NVML module at the seam ------------------------------------------


class NotSupported(Exception):
    """What pynvml raises (NVMLError_NotSupported) for a query the GPU does not support."""


def fake_nvml(gpus: list[dict[str, Any]], init_error: str | None = None) -> types.ModuleType:
    """A stand-in for ``pynvml`` with the calls the sampler makes. A missing key in a GPU's dict
    means the GPU does not support that query."""
    m = types.ModuleType("pynvml")
    calls: dict[str, int] = {"init": 0, "shutdown": 0}

    def get(handle: int, key: str) -> Any:
        if key not in gpus[handle]:
            raise NotSupported("Not Supported")
        return gpus[handle][key]

    def init() -> None:
        calls["init"] += 1
        if init_error:
            raise RuntimeError(init_error)

    m.__dict__.update(
        calls=calls,
        nvmlInit=init,
        nvmlShutdown=lambda: calls.__setitem__("shutdown", calls["shutdown"] + 1),
        nvmlDeviceGetCount=lambda: len(gpus),
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetName=lambda h: get(h, "name"),
        nvmlDeviceGetTemperature=lambda h, sensor: get(h, "temp"),
        nvmlDeviceGetTotalEccErrors=lambda h, kind, counter: get(h, "ecc"),
        nvmlDeviceGetRetiredPagesPendingStatus=lambda h: get(h, "retired"),
        nvmlDeviceGetRemappedRows=lambda h: get(h, "remap"),
        nvmlDeviceGetCurrentClocksThrottleReasons=lambda h: get(h, "throttle"),
        nvmlDeviceGetMemoryInfo=lambda h: get(h, "mem"),
    )
    return m


def test_gpus_are_read_and_decoded_and_unsupported_queries_are_none(tmp_path: Path) -> None:
    mem = types.SimpleNamespace(used=30 * GIB, total=80 * GIB, free=50 * GIB)
    gpus = [
        {"name": b"NVIDIA H100", "temp": 60, "ecc": 0, "remap": (0, 0, 0, 0), "throttle": 0x1,
         "mem": mem},
        {"name": "NVIDIA A10", "temp": 91, "ecc": 0, "retired": 1, "throttle": 0x40 | 0x4},
    ]
    nvml = fake_nvml(gpus)
    sampler = HealthSampler(Nvml(nvml))
    before = sampler.sample([], tmp_path)
    gpus[1]["ecc"] = 2
    after = sampler.sample([], tmp_path)
    sampler.close()

    assert nvml.calls == {"init": 1, "shutdown": 1}
    assert before.gpu_unavailable is None and before.gpus is not None
    g0, g1 = before.gpus
    assert g0 == GpuSample(0, "NVIDIA H100", 60.0, 0, False, ("gpu_idle",), 30 * GIB, 80 * GIB)
    assert g1.name == "NVIDIA A10" and g1.pages_pending is True
    assert g1.throttle_reasons == ("sw_power_cap", "hw_thermal_slowdown")
    assert g1.memory_used_bytes is None  # not supported: unknown, not an error

    kinds = {(w.kind, w.subject) for w in judge(after, HealthConfig(), [before])}
    assert kinds == {(HealthKind.GPU_TEMPERATURE, "gpu 1"), (HealthKind.GPU_ECC_ERRORS, "gpu 1"),
                     (HealthKind.GPU_PAGES_PENDING, "gpu 1"), (HealthKind.GPU_THROTTLED, "gpu 1")}


def test_nvml_init_failure_is_reported_once_and_not_retried(tmp_path: Path) -> None:
    nvml = fake_nvml([], init_error="Driver Not Loaded")
    sampler = HealthSampler(Nvml(nvml))
    for _ in range(3):
        s = sampler.sample([], tmp_path)
        assert s.gpus is None and s.gpu_unavailable == "NVML init failed: Driver Not Loaded"
    sampler.close()
    assert nvml.calls == {"init": 1, "shutdown": 0}


# -- judgement (pure) ------------------------------------------------------------------------------


def make(t: float = 0.0, *, avail_gib: float = 100, total_gib: float = 200, free_gib: float = 500,
         workers: tuple[WorkerSample, ...] = (),
         gpus: tuple[GpuSample, ...] | None = None) -> HealthSample:
    host = HostSample(int(total_gib * GIB), int(avail_gib * GIB), 50.0, 0, 0.0, (1.0, 1.0, 1.0), 8)
    disk = DiskSample("/ckpt", int(free_gib * GIB), int(2000 * GIB))
    return HealthSample(t, host, disk, workers, gpus)


def gpu(index: int = 0, *, temp: float = 60, ecc: int = 0,
        throttle: tuple[ThrottleReason, ...] = ()) -> GpuSample:
    return GpuSample(index, "GPU", temp, ecc, False, throttle, GIB, 80 * GIB)


def kinds(warnings: list[Any]) -> list[HealthKind]:
    return [w.kind for w in warnings]


def test_a_healthy_sample_warns_of_nothing() -> None:
    assert judge(make(gpus=(gpu(0), gpu(1))), HealthConfig()) == []


@pytest.mark.parametrize(("avail", "total", "warns"), [
    (3.0, 16.0, False),    # 18.8 % and 3 GiB: fine
    (1.5, 16.0, True),     # below 2 GiB
    (8.0, 200.0, True),    # 4 % of a big host, though 8 GiB
    (10.1, 200.0, False),
])
def test_host_memory_low_by_percent_or_by_gib(avail: float, total: float, warns: bool) -> None:
    found = judge(make(avail_gib=avail, total_gib=total), HealthConfig())
    assert kinds(found) == ([HealthKind.HOST_MEMORY_LOW] if warns else [])
    if warns:
        assert f"{avail:.1f} GiB available" in found[0].message
        assert "Reduce" in found[0].message
        assert found[0].evidence["available_bytes"] == int(avail * GIB)


def test_disk_low_below_the_minimum_or_below_keep_checkpoints() -> None:
    config = HealthConfig(min_free_disk_gib=10, expected_checkpoint_gib=40)
    assert judge(make(free_gib=121), config, checkpoint_keep=3) == []
    (w,) = judge(make(free_gib=119), config, checkpoint_keep=3)
    assert w.kind is HealthKind.DISK_LOW and w.subject == "/ckpt"
    assert "119.0 GiB, below 120.0 GiB (3 checkpoint(s) of 40 GiB)" in w.message
    (w,) = judge(make(free_gib=9), HealthConfig(min_free_disk_gib=10))
    assert "the 10 GiB minimum" in w.message


def worker_series(rss_gib: list[float], every_s: float = 60.0) -> list[HealthSample]:
    return [make(i * every_s, workers=(WorkerSample(7, "python", int(r * GIB), 100.0),))
            for i, r in enumerate(rss_gib)]


def test_steady_memory_growth_is_a_leak_with_a_rate_and_a_forecast() -> None:
    series = worker_series([4 + 0.1 * i for i in range(31)])  # 3 GiB over 30 min
    (w,) = judge(series[-1], HealthConfig(), series[:-1])
    assert w.kind is HealthKind.WORKER_MEMORY_GROWTH and w.subject == "pid 7"
    assert "over 30 min" in w.message and "runs out in about" in w.message
    assert 5.9 * GIB < w.evidence["bytes_per_hour"] < 6.1 * GIB  # 0.1 GiB a minute
    assert "grew from 4.0 GiB to 7.0 GiB" in w.message


def test_warm_up_breathing_and_short_history_are_not_leaks() -> None:
    config = HealthConfig()
    breathing = worker_series([4 + (1.5 if i % 2 else 0) for i in range(31)])
    assert judge(breathing[-1], config, breathing[:-1]) == []
    short = worker_series([4 + 0.5 * i for i in range(10)])  # 9 min of a 30 min window
    assert judge(short[-1], config, short[:-1]) == []
    plateau = worker_series([4 + min(i, 3) for i in range(31)])  # grows once, then flat
    assert judge(plateau[-1], config, plateau[:-1]) == []


@settings(max_examples=50, deadline=None)
@given(base=st.floats(0.5, 64), noise=st.lists(st.floats(0, 0.9), min_size=31, max_size=31))
def test_stationary_memory_never_warns(base: float, noise: list[float]) -> None:
    series = worker_series([base + n for n in noise])
    assert judge(series[-1], HealthConfig(), series[:-1]) == []


def test_gpu_temperature_ecc_and_throttle_rules() -> None:
    config = HealthConfig()
    assert judge(make(gpus=(gpu(temp=85),)), config) == []
    (w,) = judge(make(gpus=(gpu(temp=86),)), config)
    assert w.kind is HealthKind.GPU_TEMPERATURE and "86 °C, above 85 °C" in w.message
    # Power capping under load is normal; a thermal slowdown is not.
    assert judge(make(gpus=(gpu(throttle=("sw_power_cap", "gpu_idle")),)), config) == []
    (w,) = judge(make(gpus=(gpu(throttle=("sw_power_cap", "hw_thermal_slowdown")),)), config)
    assert w.kind is HealthKind.GPU_THROTTLED and w.evidence["reasons"] == ["hw_thermal_slowdown"]
    # ECC: counted against the previous sample; unchanged totals are old news.
    prev = make(0, gpus=(gpu(ecc=3),))
    assert judge(make(1, gpus=(gpu(ecc=3),)), config, [prev]) == []
    (w,) = judge(make(1, gpus=(gpu(ecc=5),)), config, [prev])
    assert w.evidence == {"gpu": 0, "new_errors": 2, "total": 5}
    assert "2 new uncorrectable ECC error(s)" in w.message


def test_watch_warns_once_per_condition_until_it_clears() -> None:
    watch = HealthWatch(HealthConfig(clear_after_samples=2))
    low, ok = 1.0, 100.0
    seen = [kinds(watch.observe(make(t, avail_gib=avail)))
            for t, avail in enumerate([low, low, ok, low, ok, ok, low])]
    # A single healthy sample does not clear it (no flapping); two do, and it may warn again.
    assert seen == [[HealthKind.HOST_MEMORY_LOW], [], [], [], [], [],
                    [HealthKind.HOST_MEMORY_LOW]]


def test_watch_keeps_just_enough_history_to_see_a_leak() -> None:
    watch = HealthWatch(HealthConfig(leak_window_s=600))
    found = []
    for s in worker_series([2 + 0.2 * i for i in range(40)], every_s=30):  # 20 min
        found += watch.observe(s)
    assert kinds(found) == [HealthKind.WORKER_MEMORY_GROWTH]
    assert len(watch._history) <= 21  # 600 s of 30 s samples
    assert [w.kind for w in watch.active] == [HealthKind.WORKER_MEMORY_GROWTH]


# -- Xids: NVML's event set, through the fake at the seam ------------------------------------------


class Timeout(Exception):
    """What pynvml raises (NVMLError_Timeout) when no event waits."""


def with_xids(nvml: types.ModuleType, pending: list[tuple[int, int]]) -> types.ModuleType:
    """``nvml`` with NVML's event API: ``pending`` holds (GPU handle, Xid) events not yet read;
    GPU 1 does not support the event (its registration fails)."""
    registered: list[int] = []

    def register(handle: int, kind: int, events: str) -> None:
        if handle == 1:
            raise NotSupported("Not Supported")
        assert kind == 0x8 and events == "set"
        registered.append(handle)

    def wait(events: str, timeout_ms: int) -> types.SimpleNamespace:
        assert timeout_ms == 0  # never blocks the loop
        if not pending:
            raise Timeout("Timeout")
        handle, xid = pending.pop(0)
        return types.SimpleNamespace(device=handle, eventType=0x8, eventData=xid)

    nvml.__dict__.update(registered=registered, nvmlEventSetCreate=lambda: "set",
                         nvmlDeviceRegisterEvents=register, nvmlEventSetWait_v2=wait,
                         nvmlEventSetFree=lambda events: None)
    return nvml


def test_xids_are_read_from_nvmls_event_set_without_waiting_and_machine_ones_warn(
        tmp_path: Path) -> None:
    gpus: list[dict[str, Any]] = [{"name": "H100", "ecc": 0}, {"name": "H100", "ecc": 0}]
    pending = [(0, 79), (0, 13)]
    nvml = with_xids(fake_nvml(gpus), pending)
    sampler = HealthSampler(Nvml(nvml))
    first = sampler.sample([], tmp_path)
    assert nvml.registered == [0]  # GPU 1 cannot deliver events: the others still do
    assert first.gpus is not None and first.gpus[0].xids == (79, 13) and first.gpus[1].xids == ()
    warnings = judge(first, HealthConfig())
    assert [(w.kind, w.subject, w.evidence["machine"]) for w in warnings] == [
        (HealthKind.GPU_XID, "gpu 0 xid 79", True), (HealthKind.GPU_XID, "gpu 0 xid 13", False)]
    assert "fallen off the bus" in warnings[0].message
    second = sampler.sample([], tmp_path)  # read once: the set is drained
    assert second.gpus is not None and second.gpus[0].xids == ()
    sampler.close()


def test_machine_faults_are_new_uncorrectable_ecc_errors_and_the_machines_xids() -> None:
    before = gpu(ecc=3)
    assert machine_faults(gpu(ecc=3), None) == []  # the driver's count: a baseline
    assert machine_faults(gpu(ecc=3), before) == []
    assert machine_faults(gpu(ecc=5), before) == ["2 uncorrectable ECC error(s)"]
    xids = dataclasses.replace(gpu(), xids=(13, 74, 74))
    assert machine_faults(xids, gpu()) == ["Xid 74 (NVLink error)"]  # 13: the program's
