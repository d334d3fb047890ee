"""Host, worker and GPU health: sample it (side effects), judge it (pure), warn once.

Three layers, the I/O at the edge::

    HealthSampler.sample(pids, checkpoint_dir) -> HealthSample     psutil, statvfs, NVML
    judge(sample, config, history, checkpoint_keep) -> warnings     pure, no clock, no I/O
    HealthWatch.observe(sample) -> new warnings                     keeps the history it needs,
                                                                    warns once per condition

Nothing here raises because a worker vanished, a file system disappeared or the machine has no
GPU: a sample says what it could not measure (``None`` fields, ``gpu_unavailable``) instead.

GPUs are read through NVML (``pynvml``, from the ``nvidia-ml-py`` package) only when the module
imports *and* ``nvmlInit`` succeeds. The NVML module is injectable (``Nvml(module=...)``): it is
the one true seam here, a C library that talks to the kernel driver, and a test cannot make a real
GPU run hot, throttle or report ECC errors. Everything behind the seam (what we ask, how we
decode bitmasks, how we survive "not supported") is our code and is what the fake exercises.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import importlib
import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

import psutil
from pydantic import Field

from babysit.policies.section import Section

GIB = 1024**3

ThrottleReason = Literal[
    "gpu_idle",
    "applications_clocks_setting",
    "sw_power_cap",
    "hw_slowdown",
    "sync_boost",
    "sw_thermal_slowdown",
    "hw_thermal_slowdown",
    "hw_power_brake_slowdown",
    "display_clock_setting",
]

# Bits of nvmlDeviceGetCurrentClocksThrottleReasons, from nvml.h. They are part of NVML's stable
# ABI, so they are written here rather than read from the module (a fake needs no constants).
_THROTTLE_BITS: tuple[tuple[int, ThrottleReason], ...] = (
    (0x001, "gpu_idle"),
    (0x002, "applications_clocks_setting"),
    (0x004, "sw_power_cap"),
    (0x008, "hw_slowdown"),
    (0x010, "sync_boost"),
    (0x020, "sw_thermal_slowdown"),
    (0x040, "hw_thermal_slowdown"),
    (0x080, "hw_power_brake_slowdown"),
    (0x100, "display_clock_setting"),
)
_NVML_TEMPERATURE_GPU = 0
_NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
_NVML_VOLATILE_ECC = 0
_NVML_FEATURE_ENABLED = 1
_NVML_EVENT_XID_CRITICAL = 0x8  # nvmlEventTypeXidCriticalError

MACHINE_XIDS: dict[int, str] = {
    48: "double-bit ECC error",
    63: "ECC page retirement or row remapping",
    64: "row remapping failure",
    74: "NVLink error",
    79: "fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
}
"""The Xids (NVIDIA's numbered driver errors) that are the machine's, from NVIDIA's Xid
catalogue: memory, NVLink, the bus, the GPU's own processor. The others (13 a kernel's bad
access, 31 a page fault, 43 a stopped channel, 45 a killed context, ...) most often follow the
program and are left to the crash's own classification."""
MEMORY_XIDS = frozenset({48, 63, 64, 92, 94, 95})
"""The machine Xids of memory errors: what was computed since the last clean look may be
wrong. The others (the bus, NVLink, the GSP) stop the GPU; what it computed before stands."""


# -- configuration --------------------------------------------------------------------------------


class HealthConfig(Section):
    """Thresholds for host, disk, worker and GPU health warnings."""

    min_available_memory_percent: float = Field(5.0, ge=0, le=100)
    """Warn when the host's available memory falls below this percentage of its total."""
    min_available_memory_gib: float = Field(2.0, ge=0)
    """Warn when the host's available memory falls below this many GiB (either rule warns)."""
    min_free_disk_gib: float = Field(10.0, ge=0)
    """Warn when the file system holding the checkpoints has less than this many GiB free."""
    expected_checkpoint_gib: float | None = Field(None, gt=0)
    """Size of one checkpoint in GiB, if known: then also warn when free space is below this
    times ``checkpoints.keep`` (room for the checkpoints retention will hold)."""
    leak_window_s: float = Field(1800.0, gt=0)
    """Seconds of history over which a worker's memory growth (a leak) is judged."""
    leak_min_growth_gib: float = Field(1.0, gt=0)
    """Warn of a leak only when a worker's RSS grew by at least this many GiB over the window."""
    leak_min_growth_fraction: float = Field(0.25, ge=0)
    """... and by at least this fraction of its earlier size (0.25: by a quarter)."""
    gpu_max_temperature_c: float = Field(85.0, gt=0)
    """Warn when a GPU's core temperature exceeds this many degrees Celsius."""
    gpu_throttle_reasons: tuple[ThrottleReason, ...] = (
        "hw_slowdown",
        "hw_thermal_slowdown",
        "sw_thermal_slowdown",
        "hw_power_brake_slowdown",
    )
    """Clock throttle reasons that warn (NVML's names in snake case). Idle, application clocks and
    the software power cap are normal under load and left out by default."""
    clear_after_samples: int = Field(3, ge=1)
    """A warned condition must be absent from this many consecutive samples before it counts as
    cleared and may warn again (stops a value hovering at a threshold from flapping)."""


# -- samples --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WorkerSample:
    """One process of the job."""

    pid: int
    name: str
    rss_bytes: int
    cpu_percent: float | None
    """Percent of one core since this sampler last saw the pid (may exceed 100 with threads);
    None the first time it is seen."""


@dataclass(frozen=True, slots=True)
class HostSample:
    """The machine's memory, swap and load."""

    memory_total_bytes: int
    memory_available_bytes: int
    memory_used_percent: float
    swap_used_bytes: int | None
    swap_used_percent: float | None
    load_average: tuple[float, float, float]
    """Run-queue length over 1, 5 and 15 minutes (compare with ``cpu_count``)."""
    cpu_count: int


@dataclass(frozen=True, slots=True)
class DiskSample:
    """Free space on the file system that holds the checkpoint folder."""

    path: str
    """The folder measured: the checkpoint folder, or its nearest existing parent."""
    free_bytes: int
    total_bytes: int


@dataclass(frozen=True, slots=True)
class GpuSample:
    """One GPU as NVML reports it. A field the GPU or driver does not support is None."""

    index: int
    name: str | None
    temperature_c: float | None
    ecc_uncorrected_volatile: int | None
    """Uncorrectable ECC errors since the driver loaded."""
    pages_pending: bool | None
    """Memory pages waiting for retirement (pre-Ampere) or rows waiting for remapping (Ampere
    and later); either takes effect only after a GPU reset."""
    throttle_reasons: tuple[ThrottleReason, ...] | None
    memory_used_bytes: int | None
    memory_total_bytes: int | None
    xids: tuple[int, ...] = ()
    """Critical Xid events the driver raised for this GPU since the last read (NVML's event
    set, registered at init; empty where the driver does not deliver them)."""


@dataclass(frozen=True, slots=True)
class HealthSample:
    """Everything measured at one moment. ``time`` is Unix seconds."""

    time: float
    host: HostSample
    disk: DiskSample | None
    workers: tuple[WorkerSample, ...]
    gpus: tuple[GpuSample, ...] | None
    """None when GPUs could not be read; ``gpu_unavailable`` says why."""
    gpu_unavailable: str | None = None
    disk_unavailable: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# -- sampling (side effects) -----------------------------------------------------------------------


class Nvml:
    """NVML for the sampler: imported and initialised on first ``read()``, shut down by ``close``.

    ``module``: the NVML module (default: ``import pynvml``); pass a fake to test the GPU path
    on a machine without one. A failed import or init is remembered, not retried: neither fixes
    itself while a run lasts, and retrying costs a dlopen every sample. Not thread-safe: one
    thread (the scheduler's health job) reads it.
    """

    def __init__(self, module: ModuleType | None = None) -> None:
        self._module = module
        self._ready = False
        self._failure: str | None = None
        self._events: Any = None
        """The event set critical Xids arrive on; None before the first read, False where
        NVML cannot deliver them (no Xids read)."""

    def read(self) -> tuple[tuple[GpuSample, ...] | None, str | None]:
        """``(gpus, None)``, or ``(None, why not)`` when NVML is unavailable. Never raises."""
        nvml = self._init()
        if nvml is None:
            return None, self._failure
        try:
            count = int(nvml.nvmlDeviceGetCount())
            handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        except Exception as exc:  # any NVML error means "cannot read GPUs now"
            return None, f"NVML query failed: {exc}"
        if self._events is None:
            self._events = _watch_xids(nvml, handles)
        xids = _drain_xids(nvml, self._events, handles) if self._events else {}
        return tuple(dataclasses.replace(_read_gpu(nvml, i, h), xids=tuple(xids.get(i, ())))
                     for i, h in enumerate(handles)), None

    def close(self) -> None:
        if self._events and self._module is not None:
            with contextlib.suppress(Exception):
                self._module.nvmlEventSetFree(self._events)
        self._events = None
        if self._ready and self._module is not None:
            # Shutting down: an error here has nothing left to protect.
            with contextlib.suppress(Exception):
                self._module.nvmlShutdown()
        self._ready = False

    def _init(self) -> ModuleType | None:
        if self._ready:
            return self._module
        if self._failure is not None:
            return None
        if self._module is None:
            try:
                self._module = importlib.import_module("pynvml")
            except ImportError:
                self._failure = "no NVML library (install nvidia-ml-py to read GPU health)"
                return None
        try:
            self._module.nvmlInit()
        except Exception as exc:  # no driver, no GPU, or a broken install
            self._failure = f"NVML init failed: {exc}"
            return None
        self._ready = True
        return self._module


def _watch_xids(nvml: ModuleType, handles: list[object]) -> Any:
    """An event set on which every GPU delivers its critical Xid errors; False where NVML
    cannot (an older driver, a GPU without the event): not asked again."""
    try:
        events = nvml.nvmlEventSetCreate()
    except Exception:
        return False
    registered = False
    for handle in handles:
        with contextlib.suppress(Exception):  # NotSupported on this GPU: the others still can
            nvml.nvmlDeviceRegisterEvents(handle, _NVML_EVENT_XID_CRITICAL, events)
            registered = True
    return events if registered else False


def _drain_xids(nvml: ModuleType, events: Any, handles: list[object]
                ) -> dict[int, list[int]]:
    """The Xids waiting on ``events``, by GPU index; never waits (a timeout of 0 ms)."""
    wait = getattr(nvml, "nvmlEventSetWait_v2", None) or nvml.nvmlEventSetWait
    found: dict[int, list[int]] = {}
    for _ in range(64):  # a storm of events is not read all at once: the rest next time
        try:
            event = wait(events, 0)
        except Exception:  # NVML_ERROR_TIMEOUT: none waiting (or the set is gone)
            break
        if event.eventType & _NVML_EVENT_XID_CRITICAL:
            index = next((i for i, h in enumerate(handles) if h == event.device), -1)
            found.setdefault(index, []).append(int(event.eventData))
    return found


def _read_gpu(nvml: ModuleType, index: int, handle: object) -> GpuSample:
    name = _query(nvml.nvmlDeviceGetName, handle)
    if isinstance(name, bytes):  # older nvidia-ml-py versions return bytes
        name = name.decode(errors="replace")
    temperature = _query(nvml.nvmlDeviceGetTemperature, handle, _NVML_TEMPERATURE_GPU)
    ecc = _query(nvml.nvmlDeviceGetTotalEccErrors, handle, _NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                 _NVML_VOLATILE_ECC)
    retired = _query(nvml.nvmlDeviceGetRetiredPagesPendingStatus, handle)
    remapped = _query(getattr(nvml, "nvmlDeviceGetRemappedRows", None), handle)
    pending = None
    if retired is not None:
        pending = int(retired) == _NVML_FEATURE_ENABLED
    if remapped is not None:  # (corrected, uncorrected, pending, failure)
        pending = bool(pending) or bool(remapped[2])
    # The call was renamed "ClocksEventReasons" in newer NVML; the old name still works there.
    reasons_fn = (getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
                  or getattr(nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None))
    mask = _query(reasons_fn, handle)
    memory = _query(nvml.nvmlDeviceGetMemoryInfo, handle)
    return GpuSample(
        index=index,
        name=str(name) if name is not None else None,
        temperature_c=float(temperature) if temperature is not None else None,
        ecc_uncorrected_volatile=int(ecc) if ecc is not None else None,
        pages_pending=pending,
        throttle_reasons=(tuple(n for bit, n in _THROTTLE_BITS if int(mask) & bit)
                          if mask is not None else None),
        memory_used_bytes=int(memory.used) if memory is not None else None,
        memory_total_bytes=int(memory.total) if memory is not None else None,
    )


def _query(fn: Callable[..., Any] | None, *args: Any) -> Any:
    """One NVML call; None when it is missing or fails (most often: not supported on this GPU)."""
    if fn is None:
        return None
    try:
        return fn(*args)
    except Exception:  # NotSupported, NoPermission, GpuIsLost: all mean "unknown"
        return None


class HealthSampler:
    """Samples the host, the job's processes and the GPUs. Keeps what CPU% needs between calls.

    Calling rules: one thread calls ``sample`` (the scheduler's health job); ``close()`` when the
    run ends releases NVML. The constructor does no I/O. ``clock`` gives Unix seconds.
    """

    def __init__(self, nvml: Nvml | None = None, clock: Callable[[], float] = time.time) -> None:
        self.nvml = nvml if nvml is not None else Nvml()
        self._clock = clock
        self._procs: dict[int, psutil.Process] = {}

    def sample(self, pids: Iterable[int], checkpoint_dir: Path) -> HealthSample:
        """Measure now. Processes that are gone (or not ours to read) are left out."""
        now = self._clock()
        workers = tuple(w for pid in dict.fromkeys(pids) if (w := self._worker(pid)) is not None)
        seen = {w.pid for w in workers}
        self._procs = {pid: p for pid, p in self._procs.items() if pid in seen}
        disk, disk_why = _disk(checkpoint_dir)
        gpus, gpu_why = self.nvml.read()
        return HealthSample(now, _host(), disk, workers, gpus, gpu_why, disk_why)

    def close(self) -> None:
        self.nvml.close()
        self._procs.clear()

    def _worker(self, pid: int) -> WorkerSample | None:
        proc = self._procs.get(pid)
        first = proc is None or not proc.is_running()  # is_running also catches a reused pid
        try:
            if first or proc is None:
                proc = psutil.Process(pid)
            with proc.oneshot():
                rss = proc.memory_info().rss
                cpu = proc.cpu_percent(interval=None)  # since the previous call on this object
                name = proc.name()
        except (psutil.NoSuchProcess, psutil.AccessDenied):  # ZombieProcess is a NoSuchProcess
            self._procs.pop(pid, None)
            return None
        self._procs[pid] = proc
        return WorkerSample(pid, name, rss, None if first else cpu)


def sample(pids: Iterable[int], checkpoint_dir: Path,
           nvml_module: ModuleType | None = None) -> HealthSample:
    """One-off sample (CPU% is None: it needs two looks). Prefer a long-lived ``HealthSampler``."""
    sampler = HealthSampler(Nvml(nvml_module))
    try:
        return sampler.sample(pids, checkpoint_dir)
    finally:
        sampler.close()


def _host() -> HostSample:
    mem = psutil.virtual_memory()
    try:
        swap = psutil.swap_memory()
        swap_used, swap_pct = int(swap.used), float(swap.percent)
    except (OSError, RuntimeError):  # some containers hide /proc/vmstat
        swap_used, swap_pct = None, None
    load = os.getloadavg()
    return HostSample(int(mem.total), int(mem.available), float(mem.percent), swap_used, swap_pct,
                      (load[0], load[1], load[2]), os.cpu_count() or 1)


def _disk(checkpoint_dir: Path) -> tuple[DiskSample | None, str | None]:
    # The folder may not exist yet (no checkpoint saved); its future file system is the nearest
    # existing parent's.
    probe = Path(os.path.abspath(checkpoint_dir))
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    try:
        usage = psutil.disk_usage(str(probe))
    except OSError as exc:
        return None, f"cannot measure {probe}: {exc.strerror or exc}"
    return DiskSample(str(probe), int(usage.free), int(usage.total)), None


# -- judgement (pure) ------------------------------------------------------------------------------


class HealthKind(str, enum.Enum):
    """What a warning is about."""

    HOST_MEMORY_LOW = "host_memory_low"
    DISK_LOW = "disk_low"
    WORKER_MEMORY_GROWTH = "worker_memory_growth"
    GPU_TEMPERATURE = "gpu_temperature"
    GPU_ECC_ERRORS = "gpu_ecc_errors"
    GPU_PAGES_PENDING = "gpu_pages_pending"
    GPU_THROTTLED = "gpu_throttled"
    GPU_XID = "gpu_xid"


@dataclass(frozen=True, slots=True)
class HealthWarning:
    """One unhealthy condition. ``subject`` names what it is about (``host``, a path,
    ``pid 123``, ``gpu 0``); ``(kind, subject)`` identifies the condition for warn-once."""

    kind: HealthKind
    subject: str
    message: str
    """One sentence for a person: what, the numbers, what to do."""
    evidence: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> tuple[HealthKind, str]:
        return self.kind, self.subject

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind.value, "subject": self.subject, "message": self.message,
                "evidence": dict(self.evidence)}


def judge(sample: HealthSample, config: HealthConfig, history: Sequence[HealthSample] = (),
          checkpoint_keep: int = 1) -> list[HealthWarning]:
    """Every unhealthy condition in ``sample``. Pure.

    ``history``: earlier samples, oldest first (leaks need ``leak_window_s`` of them; new ECC
    errors are counted against the newest). ``checkpoint_keep``: ``checkpoints.keep``, used with
    ``expected_checkpoint_gib``.
    """
    warnings = _memory(sample, config) + _disk_space(sample, config, checkpoint_keep)
    warnings += _leaks(sample, config, history)
    previous = history[-1].gpus if history else None
    before = {g.index: g for g in previous or ()}
    for gpu in sample.gpus or ():
        warnings += _gpu(gpu, before.get(gpu.index), config)
    return warnings


def _memory(s: HealthSample, c: HealthConfig) -> list[HealthWarning]:
    h = s.host
    pct = 100.0 * h.memory_available_bytes / h.memory_total_bytes if h.memory_total_bytes else 0.0
    avail_gib = h.memory_available_bytes / GIB
    if pct >= c.min_available_memory_percent and avail_gib >= c.min_available_memory_gib:
        return []
    return [HealthWarning(
        HealthKind.HOST_MEMORY_LOW, "host",
        f"Host memory is low: {avail_gib:.1f} GiB available ({pct:.1f}% of "
        f"{h.memory_total_bytes / GIB:.0f} GiB), below the {c.min_available_memory_gib:g} GiB / "
        f"{c.min_available_memory_percent:g}% threshold; the kernel may kill a rank. Reduce "
        f"data-loader workers or batch size, or stop other jobs on this node.",
        {"available_bytes": h.memory_available_bytes, "total_bytes": h.memory_total_bytes,
         "available_percent": round(pct, 2), "swap_used_percent": h.swap_used_percent},
    )]


def _disk_space(s: HealthSample, c: HealthConfig, keep: int) -> list[HealthWarning]:
    if s.disk is None:
        return []
    need_gib, why = c.min_free_disk_gib, f"the {c.min_free_disk_gib:g} GiB minimum"
    if c.expected_checkpoint_gib is not None and c.expected_checkpoint_gib * keep > need_gib:
        need_gib = c.expected_checkpoint_gib * keep
        why = f"{keep} checkpoint(s) of {c.expected_checkpoint_gib:g} GiB"
    free_gib = s.disk.free_bytes / GIB
    if free_gib >= need_gib:
        return []
    return [HealthWarning(
        HealthKind.DISK_LOW, s.disk.path,
        f"Free disk space on {s.disk.path} is {free_gib:.1f} GiB, below {need_gib:.1f} GiB "
        f"({why}); the next checkpoint save may fail. Free space there, or lower "
        f"checkpoints.keep.",
        {"path": s.disk.path, "free_bytes": s.disk.free_bytes, "needed_bytes": int(need_gib * GIB)},
    )]


def _leaks(s: HealthSample, c: HealthConfig,
           history: Sequence[HealthSample]) -> list[HealthWarning]:
    # Conservative on purpose: RSS breathes (allocator caches, prefetch), so a leak is declared
    # only when the *lowest* recent value is above the *highest* value from the window's start.
    start = s.time - c.leak_window_s
    window = [h for h in history if h.time >= start] + [s]
    warnings = []
    for worker in s.workers:
        points = [(h.time, w.rss_bytes) for h in window for w in h.workers if w.pid == worker.pid]
        span = points[-1][0] - points[0][0]
        if span < c.leak_window_s / 2:
            continue  # too little history to tell growth from warm-up
        quarter = span / 4
        head = [(t, rss) for t, rss in points if t <= points[0][0] + quarter]
        tail = [(t, rss) for t, rss in points if t >= points[-1][0] - quarter]
        early, late = max(rss for _, rss in head), min(rss for _, rss in tail)
        if late - early < max(c.leak_min_growth_gib * GIB, c.leak_min_growth_fraction * early):
            continue
        # The rate from the quarters' centres of mass: the conservative bounds above would
        # understate it, and the forecast is what tells a person how urgent this is.
        (t0, r0), (t1, r1) = _mean_point(head), _mean_point(tail)
        rate = (r1 - r0) / (t1 - t0)  # bytes per second
        hours_left = s.host.memory_available_bytes / rate / 3600
        first, last = points[0][1], points[-1][1]
        warnings.append(HealthWarning(
            HealthKind.WORKER_MEMORY_GROWTH, f"pid {worker.pid}",
            f"Worker pid {worker.pid} ({worker.name}) grew from {first / GIB:.1f} GiB to "
            f"{last / GIB:.1f} GiB over {span / 60:.0f} min ({rate * 3600 / GIB:.2f} GiB/h); at "
            f"this rate host memory runs out in about {hours_left:.1f} h. Look for tensors kept "
            f"across steps (a loss summed without .item()) or a cache growing in the data loader.",
            {"pid": worker.pid, "first_rss_bytes": first, "last_rss_bytes": last,
             "span_s": round(span, 1), "bytes_per_hour": int(rate * 3600),
             "hours_until_host_memory_exhausted": round(hours_left, 2)},
        ))
    return warnings


def _mean_point(points: list[tuple[float, int]]) -> tuple[float, float]:
    return (sum(t for t, _ in points) / len(points), sum(r for _, r in points) / len(points))


def _gpu(g: GpuSample, before: GpuSample | None, c: HealthConfig) -> list[HealthWarning]:
    subject = f"gpu {g.index}"
    out = []
    if g.temperature_c is not None and g.temperature_c > c.gpu_max_temperature_c:
        out.append(HealthWarning(
            HealthKind.GPU_TEMPERATURE, subject,
            f"GPU {g.index} is at {g.temperature_c:.0f} °C, above {c.gpu_max_temperature_c:g} °C; "
            f"it will slow down and may shut off. Check the node's cooling, or drain it.",
            {"gpu": g.index, "temperature_c": g.temperature_c,
             "threshold_c": c.gpu_max_temperature_c},
        ))
    if g.ecc_uncorrected_volatile is not None:
        old = before.ecc_uncorrected_volatile if before is not None else 0
        new = g.ecc_uncorrected_volatile - (old or 0)
        if new > 0:
            out.append(HealthWarning(
                HealthKind.GPU_ECC_ERRORS, subject,
                f"GPU {g.index} reported {new} new uncorrectable ECC error(s) "
                f"({g.ecc_uncorrected_volatile} since the driver loaded); results computed on it "
                f"may be wrong. Drain the node for a GPU reset or replacement, and prefer a "
                f"checkpoint saved before the errors.",
                {"gpu": g.index, "new_errors": new, "total": g.ecc_uncorrected_volatile},
            ))
    if g.pages_pending:
        out.append(HealthWarning(
            HealthKind.GPU_PAGES_PENDING, subject,
            f"GPU {g.index} has memory pages waiting to be retired or remapped after memory "
            f"errors; they take effect only after a GPU reset. Reset the GPU before the next job.",
            {"gpu": g.index},
        ))
    for xid in dict.fromkeys(g.xids):
        meaning = MACHINE_XIDS.get(xid)
        out.append(HealthWarning(
            HealthKind.GPU_XID, f"{subject} xid {xid}",
            f"GPU {g.index} raised Xid {xid}" + (
                f" ({meaning}): the machine's, not the program's. Drain the node for a GPU "
                f"reset or replacement." if meaning else
                ": see NVIDIA's Xid catalogue; most such errors follow the program."),
            {"gpu": g.index, "xid": xid, "machine": meaning is not None},
        ))
    bad = [r for r in g.throttle_reasons or () if r in c.gpu_throttle_reasons]
    if bad:
        out.append(HealthWarning(
            HealthKind.GPU_THROTTLED, subject,
            f"GPU {g.index} clocks are throttled ({', '.join(bad)}); steps will be slower. Check "
            f"the node's cooling and power limits.",
            {"gpu": g.index, "reasons": bad, "temperature_c": g.temperature_c},
        ))
    return out


def machine_faults(g: GpuSample, before: GpuSample | None) -> list[str]:
    """What in ``g`` is a fault of the machine, in words: uncorrectable ECC errors new since
    ``before`` (the count is the driver's since it loaded, so the first look is only a
    baseline), and each Xid of ``MACHINE_XIDS``. Pure."""
    new = _new_ecc(g, before)
    faults = [f"{new} uncorrectable ECC error(s)"] if new else []
    faults += [f"Xid {x} ({MACHINE_XIDS[x]})" for x in dict.fromkeys(g.xids)
               if x in MACHINE_XIDS]
    return faults


def may_corrupt(g: GpuSample, before: GpuSample | None) -> bool:
    """Whether ``g``'s machine faults (``machine_faults``) may have changed results: new
    uncorrectable ECC errors, or a memory Xid."""
    return _new_ecc(g, before) > 0 or any(x in MEMORY_XIDS for x in g.xids)


def _new_ecc(g: GpuSample, before: GpuSample | None) -> int:
    """Uncorrectable ECC errors counted since ``before``; 0 with no earlier count to compare."""
    if before is None or g.ecc_uncorrected_volatile is None \
            or before.ecc_uncorrected_volatile is None:
        return 0
    return max(0, g.ecc_uncorrected_volatile - before.ecc_uncorrected_volatile)


# -- warn once (small state) -----------------------------------------------------------------------


class HealthWatch:
    """Judges each sample against the recent ones and returns only *new* warnings.

    A condition (kind, subject) warns when it appears, stays quiet while it lasts, and may warn
    again once it was absent from ``clear_after_samples`` consecutive samples. Keeps
    ``leak_window_s`` of samples. Calling rules: one thread calls ``observe``, with samples in
    time order.
    """

    def __init__(self, config: HealthConfig, checkpoint_keep: int = 1) -> None:
        self.config = config
        self.checkpoint_keep = checkpoint_keep
        self._history: deque[HealthSample] = deque()
        self._active: dict[tuple[HealthKind, str], HealthWarning] = {}
        self._absent: dict[tuple[HealthKind, str], int] = {}

    @property
    def active(self) -> list[HealthWarning]:
        """The conditions warned about and not yet cleared (their latest warning)."""
        return list(self._active.values())

    def observe(self, sample: HealthSample) -> list[HealthWarning]:
        found = {w.key: w for w in judge(sample, self.config, self._history, self.checkpoint_keep)}
        new = [w for key, w in found.items() if key not in self._active]
        for key in list(self._active):
            if key in found:
                self._absent.pop(key, None)
                continue
            self._absent[key] = self._absent.get(key, 0) + 1
            if self._absent[key] >= self.config.clear_after_samples:
                del self._active[key]
                del self._absent[key]
        self._active.update(found)
        self._history.append(sample)
        while self._history and self._history[0].time < sample.time - self.config.leak_window_s:
            self._history.popleft()
        return new
