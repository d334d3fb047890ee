"""The demo end to end on the GPU under babysit (``configs/demo_train.py --device cuda``), with
MFU against the device's real peak, and a data spike rolled back on the device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, read_jsonl, run_babysit

pytestmark = [pytest.mark.gpu, pytest.mark.e2e]

DEMO = ROOT / "configs" / "demo_train.py"

FP32_PEAK = {"H200": 66.9e12, "H100": 66.9e12, "A100": 19.5e12, "L40S": 91.6e12}
"""Dense FP32 (non-tensor-core) peak FLOP/s of one GPU, from NVIDIA's data sheets (SXM parts).
The demo trains in FP32 with TF32 off (torch's default), so this is the peak it can reach."""


def fp32_peak() -> float:
    name = torch.cuda.get_device_name(0)
    for model, peak in FP32_PEAK.items():
        if model in name:
            return peak
    pytest.skip(f"no FP32 peak known for {name!r}: add it to FP32_PEAK to check MFU")


def test_the_demo_trains_on_the_gpu_and_reports_mfu(tmp_path: Path) -> None:
    peak = fp32_peak()
    result = run_babysit("run", "--nproc-per-node", "1", "--run-dir", str(tmp_path / "run"),
                         str(DEMO), "--device", "cuda", "--steps", "200", "--eval-every", "100",
                         "--peak-flops", str(peak), cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "done: 200 steps" in result.stdout
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert rows[-1]["step"] == 200
    assert rows[-1]["loss"] < 4.0  # it learned something from ln 256 = 5.5
    mfu = [r["mfu"] for r in rows if r.get("mfu") is not None]
    assert mfu, rows[-1]
    # A 0.4M-parameter model leaves an H200 mostly idle; the point is a real, sane ratio.
    assert all(0 < m < 1 for m in mfu), mfu[-5:]
    print(f"demo on {torch.cuda.get_device_name(0)}: median MFU "
          f"{sorted(mfu)[len(mfu) // 2]:.4f} of {peak:.3g} FLOP/s")


def test_a_data_spike_on_the_gpu_is_rolled_back(tmp_path: Path) -> None:
    config = tmp_path / "spike.yaml"
    args = ["--device", "cuda", "--steps", "160", "--eval-every", "1000", "--corrupt", "110:130"]
    config.write_text(f"launch:\n  script: {DEMO}\n  nproc-per-node: 1\n  args: {args}\n"
                      f"run_dir: {tmp_path / 'run'}\n"
                      "checkpoints: {every_steps: 25, probation_steps: 20}\n")
    result = run_babysit("run", str(config), cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    journal = read_jsonl(tmp_path / "run" / "events.jsonl")
    assert any(e["event"] == "resume" and e.get("from") for e in journal)
    assert journal[-1]["state"] == "succeeded"
