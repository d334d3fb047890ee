"""Memory copies of CUDA tensors (``checkpoints/memory.py``): each rank's state copied from the
GPU into its node's shared memory every few steps (DCP's stager, the device-to-host copy), and a
crash resumed from the newest copy bit for bit.

The job is ``tests/workers/tiny_train.py --device cuda``, 2 ranks on one GPU over gloo, with the
just-in-time state off so that the relaunch must take the memory copy (under DDP a live replica
would otherwise keep the step itself), copies every 5 steps and checkpoints on disk every 20.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import babysat, journal
from tests.e2e.test_recovery import assert_resumed_bit_exact

pytestmark = [pytest.mark.gpu, pytest.mark.e2e]

CUDA = ("--device", "cuda", "--ddp")
DETERMINISTIC = "  env: {CUBLAS_WORKSPACE_CONFIG: ':4096:8'}\n"


def test_a_crash_resumes_bit_exact_from_a_memory_copy_of_cuda_tensors(tmp_path: Path) -> None:
    clean, clean_dir = babysat(tmp_path, "clean", "--steps", "30", *CUDA,
                               launch_extra=DETERMINISTIC)
    assert clean.returncode == 0, clean.stdout[-3000:] + clean.stderr[-3000:]
    crashed, run_dir = babysat(tmp_path, "crashed", "--steps", "30", "--crash", "0:18", *CUDA,
                               launch_extra=DETERMINISTIC + "  max_restarts: 1\n",
                               checkpoints="{every_steps: 20, probation_steps: 5, "
                                           "async_save: true, just_in_time: false, "
                                           "memory_every_steps: 5}")
    assert crashed.returncode == 0, crashed.stdout[-3000:] + crashed.stderr[-3000:]
    # The newest committed copy: 15, or 10 while 15's write was still going when rank 0 raised.
    [resumed] = [e for e in journal(run_dir, "resume") if e.get("from")]
    assert resumed["origin"] == "memory", resumed
    assert_resumed_bit_exact(run_dir, clean_dir, last_step=30, starts=(10, 15))
