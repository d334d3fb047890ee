"""This node's GPUs as the machine's witness (``node/gpu_watch.py``): NVML's uncorrectable ECC
errors and machine Xids become a finding naming the node's ranks. The only fake is the NVML
module, the C library's seam (as in ``tests/supervisor/services/test_health.py``)."""

from __future__ import annotations

from typing import Any

from babysit.policies.types import Incident, Severity
from babysit.supervisor.node.gpu_watch import GpuWatch
from babysit.supervisor.services.health import Nvml
from tests.supervisor.services.test_health import fake_nvml, with_xids


def test_a_new_uncorrectable_ecc_error_or_a_machine_xid_names_the_nodes_ranks() -> None:
    gpus: list[dict[str, Any]] = [{"name": "H100", "ecc": 2}, {"name": "H100", "ecc": 0}]
    pending: list[tuple[int, int]] = []
    watch = GpuWatch(10.0, Nvml(with_xids(fake_nvml(gpus), pending)))
    assert watch.look(0.0, 5, {2, 3}) == []  # 2 errors since the driver loaded: a baseline
    gpus[0]["ecc"] = 4
    assert watch.look(5.0, 9, {2, 3}) == []  # not every_s since the last look
    [finding] = watch.look(10.0, 20, {3, 2})
    assert finding.incident is Incident.GPU_FAULT and finding.severity is Severity.CRITICAL
    assert finding.ranks == (2, 3) and finding.step == 20 and finding.onset_step == 6
    assert finding.evidence == {"gpus": {"0": ["2 uncorrectable ECC error(s)"]},
                                "clean_step": 5, "memory": True}
    assert watch.look(20.0, 30, {2, 3}) == []  # counted once
    pending += [(0, 13), (0, 79)]  # 13: the program's; 79: the machine's
    [xid] = watch.look(30.0, 40, {2, 3})
    assert xid.evidence["gpus"] == {"0": ["Xid 79 (fallen off the bus)"]}
    assert "GPU 0: Xid 79 (fallen off the bus)" in xid.message
    # A GPU that stopped computed nothing wrong before: its onset is where it was seen.
    assert xid.onset_step == 40 and xid.evidence["memory"] is False
    pending += [(1, 94)]  # a contained ECC error: since the last clean look (30) may be wrong
    [memory] = watch.look(40.0, 50, {2, 3})
    assert memory.onset_step == 31 and memory.evidence["memory"] is True


def test_without_nvml_it_says_why_once_and_never_looks_again() -> None:
    nvml = fake_nvml([], init_error="Driver Not Loaded")
    watch = GpuWatch(1.0, Nvml(nvml))
    for t in range(5):
        assert watch.look(float(t * 2), t, {0}) == []
    assert watch.unavailable == "NVML init failed: Driver Not Loaded"
    assert nvml.calls["init"] == 1
    assert GpuWatch(None, Nvml(fake_nvml([]))).look(0.0, 1, {0}) == []  # turned off
