"""GPU health from the real NVML library (``nvidia-ml-py``, the ``babysit[gpu]`` extra) and the
doctor's GPU checks on a real GPU, where the CPU suite only has a fake NVML module."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import get_args

import pytest
import torch

from babysit.supervisor.services.health import Nvml, ThrottleReason
from tests.conftest import WORKERS, babysit_env

pytestmark = pytest.mark.gpu


def test_nvml_reads_every_gpu_torch_sees() -> None:
    try:
        import pynvml  # noqa: F401
    except ImportError:
        pytest.fail("nvidia-ml-py is not installed: pip install -e '.[dev,gpu]' (the GPU suite "
                    "must read the real NVML)")
    nvml = Nvml()
    try:
        gpus, why = nvml.read()
    finally:
        nvml.close()
    assert gpus is not None, why
    # NVML ignores CUDA_VISIBLE_DEVICES: it sees at least what torch sees.
    assert len(gpus) >= torch.cuda.device_count()
    for gpu in gpus:
        assert gpu.name, gpu
        assert gpu.temperature_c is not None and 0 < gpu.temperature_c < 120, gpu
        assert gpu.memory_total_bytes is not None and gpu.memory_total_bytes > 1 << 30, gpu
        assert gpu.memory_used_bytes is not None
        assert 0 <= gpu.memory_used_bytes <= gpu.memory_total_bytes
        # A data-centre GPU (A100, H100, H200) has ECC on and reports its counters.
        assert gpu.ecc_uncorrected_volatile is not None, gpu
        assert gpu.throttle_reasons is not None
        assert set(gpu.throttle_reasons) <= set(get_args(ThrottleReason)), gpu.throttle_reasons


def test_doctor_checks_the_gpus_and_nccl(tmp_path: Path) -> None:
    config = tmp_path / "gpu.yaml"
    config.write_text(f"launch:\n  script: {WORKERS / 'tiny_train.py'}\n"
                      f"  nproc-per-node: gpu\nrun_dir: {tmp_path / 'run'}\n")
    result = subprocess.run([sys.executable, "-m", "babysit", "doctor", str(config), "--json"],
                            cwd=tmp_path, env=babysit_env(), capture_output=True, text=True,
                            timeout=300)
    rows = {r["name"]: r for r in json.loads(result.stdout)}
    assert rows["torch"]["status"] == "pass", rows["torch"]
    assert "NCCL" in rows["torch"]["summary"]
    # A healthy GPU passes; a hot or throttled one may warn, which is the doctor doing its job.
    assert rows["gpu health"]["status"] in ("pass", "warn"), rows["gpu health"]
    assert "GPU" in rows["gpu health"]["summary"]
