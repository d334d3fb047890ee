"""A stand-in for ``pynvml`` (nvidia-ml-py) for end-to-end tests on machines without a GPU.

NVML is the one true seam of babysit's GPU health (a C library that talks to the kernel
driver: no test can make a real GPU fall off the bus). A test puts this folder first on a
babysitter's ``PYTHONPATH`` and names a JSON file in ``FAKE_NVML_STATE``::

    {"gpus": [{"name": "H100", "ecc": 0}], "xids": [[0, 79]]}

Each call reads the file again, so the test changes the machine's state while the run goes on;
an Xid in ``xids`` is delivered once, on the event set, like the driver's.
"""

from __future__ import annotations

import json
import os
import types
from typing import Any

_delivered = 0


class NVMLError(Exception):
    pass


def _state() -> dict[str, Any]:
    with open(os.environ["FAKE_NVML_STATE"]) as f:
        state: dict[str, Any] = json.load(f)
    return state


def nvmlInit() -> None:
    _state()


def nvmlShutdown() -> None:
    pass


def nvmlDeviceGetCount() -> int:
    return len(_state()["gpus"])


def nvmlDeviceGetHandleByIndex(index: int) -> int:
    return index


def nvmlDeviceGetName(handle: int) -> str:
    return str(_state()["gpus"][handle]["name"])


def nvmlDeviceGetTemperature(handle: int, sensor: int) -> int:
    return 50


def nvmlDeviceGetTotalEccErrors(handle: int, kind: int, counter: int) -> int:
    return int(_state()["gpus"][handle].get("ecc", 0))


def nvmlDeviceGetRetiredPagesPendingStatus(handle: int) -> int:
    return 0


def nvmlDeviceGetRemappedRows(handle: int) -> tuple[int, int, int, int]:
    return (0, 0, 0, 0)


def nvmlDeviceGetCurrentClocksThrottleReasons(handle: int) -> int:
    return 0


def nvmlDeviceGetMemoryInfo(handle: int) -> types.SimpleNamespace:
    return types.SimpleNamespace(used=0, total=80 << 30, free=80 << 30)


def nvmlEventSetCreate() -> str:
    return "events"


def nvmlDeviceRegisterEvents(handle: int, kinds: int, events: str) -> None:
    pass


def nvmlEventSetWait_v2(events: str, timeout_ms: int) -> types.SimpleNamespace:
    global _delivered
    xids = _state().get("xids", [])
    if _delivered >= len(xids):
        raise NVMLError("Timeout")
    gpu, xid = xids[_delivered]
    _delivered += 1
    return types.SimpleNamespace(device=gpu, eventType=0x8, eventData=xid)


def nvmlEventSetFree(events: str) -> None:
    pass
