"""The GPU benchmarks run end to end on the device (their figures go to docs/gpu.md by hand,
from a full run; this only checks that each script works and prints its table)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT, babysit_env

pytestmark = pytest.mark.gpu


def run(script: str, *args: str) -> str:
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args],
                          cwd=ROOT, env=babysit_env(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "skipped" not in done.stdout, done.stdout
    print(done.stdout)
    return done.stdout


def test_step_cost_compares_a_cuda_loss_tensor_with_item() -> None:
    out = run("step_cost_gpu.py", "--steps", "50", "--rounds", "2")
    for row in ("no report", "step(loss=t), t on the device", "step(loss=t.item())"):
        assert row in out


@pytest.mark.e2e
def test_relaunch_split_times_each_phase() -> None:
    out = run("relaunch_split.py", "--repeats", "1", "--n-embd", "256", "--n-layer", "2")
    for phase in ("process start", "CUDA init", "NCCL init", "checkpoint load"):
        assert f"| {phase}" in out
