"""Just-in-time state of a model on the GPU: written from the keeper's thread while the rank's
main thread waits on a kernel that never ends, and resumed bit for bit.

2 ranks on one GPU over gloo (``test_recovery.py``'s set-up). Before step 30, rank 0 launches a
kernel that spins forever on its compute stream and waits for it (``--at 0:0:30:spin``): the
stand-in, on one GPU, for a rank inside an NCCL collective whose peer never came; its host
thread spins in the CUDA synchronize, so the hang is named after ``busy_s``. Rank 0 is the
writer of the replicated state: its keeper copies the weights and Adam's state off the device on
a side stream once the mark's event (after step 29's update) completed, never queued behind
the spinning kernel. The relaunch resumes at step 29, and every step after it equals a clean
run's, bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import FAST_POLICY, babysat, journal
from tests.e2e.test_recovery import assert_resumed_bit_exact

pytestmark = [pytest.mark.gpu, pytest.mark.e2e]

CUDA = ("--device", "cuda", "--steps", "50", "--ddp")
DETERMINISTIC = "  env: {CUBLAS_WORKSPACE_CONFIG: ':4096:8'}\n"
SAVES = "{every_steps: 20, probation_steps: 5, async_save: true}"


def test_a_cuda_model_is_written_while_its_rank_waits_on_a_kernel_that_never_ends(
        tmp_path: Path) -> None:
    clean, clean_dir = babysat(tmp_path, "clean", *CUDA, checkpoints=SAVES,
                               launch_extra=DETERMINISTIC + "  warm_standby: false\n")
    assert clean.returncode == 0, clean.stdout[-3000:] + clean.stderr[-3000:]
    policy = f"{{name: {FAST_POLICY}, overrides: {{detectors: {{hang: {{busy_s: 6.0}}}}}}}}"
    result, run_dir = babysat(tmp_path, "spin", *CUDA, "--at", "0:0:30:spin",
                              checkpoints=SAVES, policy=policy, launch_extra=DETERMINISTIC)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "rank 0 on cuda:0" in result.stdout
    (hang,) = [e["finding"] for e in journal(run_dir, "finding")]
    assert hang["incident"] == "hang" and hang["ranks"] == [0]
    (saved,) = journal(run_dir, "just_in_time")
    assert (saved["outcome"], saved["step"], saved["writers"]) == ("saved", 29, [0]), saved
    assert_resumed_bit_exact(run_dir, clean_dir, last_step=50, starts=(29,))


def test_a_crashing_rank_writes_its_cuda_state_at_its_exception(tmp_path: Path) -> None:
    """Rank 0 raises before step 13's backward: it holds on at its uncaught exception and
    writes the state of step 12 from the GPU itself; the relaunch resumes there, bit-exact."""
    clean, clean_dir = babysat(tmp_path, "clean", "--steps", "24", "--device", "cuda",
                               "--ddp", launch_extra=DETERMINISTIC + "  warm_standby: false\n")
    assert clean.returncode == 0, clean.stdout[-3000:] + clean.stderr[-3000:]
    crashed, run_dir = babysat(tmp_path, "crashed", "--steps", "24", "--crash", "0:13",
                               "--device", "cuda", "--ddp",
                               launch_extra=DETERMINISTIC + "  max_restarts: 1\n",
                               checkpoints="{every_steps: 5, probation_steps: 5, "
                                           "async_save: true}")
    assert crashed.returncode == 0, crashed.stdout[-3000:] + crashed.stderr[-3000:]
    (saved,) = journal(run_dir, "just_in_time")
    assert (saved["outcome"], saved["step"], saved["writers"]) == ("saved", 12, [0]), saved
    assert_resumed_bit_exact(run_dir, clean_dir, last_step=24, starts=(12,))
