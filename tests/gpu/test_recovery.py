"""Recovery with CUDA tensors: checkpoints (DCP) of a model and optimizer that live on the GPU,
a crash resumed bit for bit, and a loss spike rolled back.

The job is ``tests/workers/tiny_train.py --device cuda``: 2 ranks on one GPU over gloo (gloo
reduces CUDA tensors; NCCL wants one GPU per rank, see test_nccl.py). Dropout draws from the
CUDA RNG, so the resume is exact only if babysit restores the CUDA RNG streams too. cuBLAS is
pinned to its deterministic workspace so that two runs of the same steps agree bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import babysat, journal, read_jsonl
from tests.e2e.test_recovery import assert_resumed_bit_exact

pytestmark = [pytest.mark.gpu, pytest.mark.e2e]

CUDA = ("--device", "cuda", "--ddp")
DETERMINISTIC = "  env: {CUBLAS_WORKSPACE_CONFIG: ':4096:8'}\n"


def test_a_crash_resumes_bit_exact_from_a_checkpoint_of_cuda_tensors(tmp_path: Path) -> None:
    clean, clean_dir = babysat(tmp_path, "clean", "--steps", "24", *CUDA,
                               launch_extra=DETERMINISTIC)
    assert clean.returncode == 0, clean.stdout[-3000:] + clean.stderr[-3000:]
    assert "rank 0 on cuda:0" in clean.stdout  # the job really ran on the GPU
    crashed, run_dir = babysat(tmp_path, "crashed", "--steps", "24", "--crash", "0:13", *CUDA,
                               launch_extra=DETERMINISTIC + "  max_restarts: 1\n",
                               checkpoints="{every_steps: 5, probation_steps: 5, "
                                           "async_save: true, just_in_time: false}")
    assert crashed.returncode == 0, crashed.stdout[-3000:] + crashed.stderr[-3000:]
    assert_resumed_bit_exact(run_dir, clean_dir, last_step=24)


def test_a_loss_spike_rolls_back_to_a_cuda_checkpoint(tmp_path: Path) -> None:
    # The CPU suite's spike (tests/e2e/test_recovery.py), with the model on the GPU: rolled
    # back to a checkpoint of CUDA tensors, the same steps run again first (the rerun), met again
    # (the data's), rolled back again with the poisoned batches skipped.
    result, run_dir = babysat(tmp_path, "spike", "--steps", "60", "--spike", "25:40", *CUDA,
                              launch_extra=DETERMINISTIC)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    asked, data = (e for e in journal(run_dir, "finding") if e["remedy"]["action"] == "rollback")
    assert asked["finding"]["incident"] in ("loss_spike", "grad_spike")
    assert asked["finding"]["evidence"]["rerun"] == "asked"
    (verdict,) = journal(run_dir, "rerun")
    assert verdict["verdict"] == "reproduced"
    assert data["finding"]["evidence"]["rerun"] == "reproduced"
    first, resume = journal(run_dir, "resume")
    assert resume["verdict"] == "good" and resume["checkpoint_step"] < 26
    assert first["checkpoint_step"] == resume["checkpoint_step"]
    rows = read_jsonl(run_dir / "metrics.jsonl")
    last = [m for m in rows if m["attempt"] == 2]
    assert last[0]["step"] == resume["checkpoint_step"] + 1
    assert all(not (25 < m["cursor"] <= 40) for m in last)
    assert read_jsonl(run_dir / "events.jsonl")[-1]["state"] == "succeeded"
