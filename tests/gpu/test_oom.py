"""A real CUDA out-of-memory error: torch's own message classified as OOM, in process and from a
rank's log under babysit, and handled as the policy says (one relaunch for an OOM)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from babysit.policies.detectors import CrashClass, classify
from tests.conftest import babysat, journal, read_jsonl

pytestmark = pytest.mark.gpu


def test_torchs_cuda_oom_message_is_classified_as_oom() -> None:
    with pytest.raises(torch.cuda.OutOfMemoryError) as raised:
        torch.empty(1 << 50, dtype=torch.uint8, device="cuda")  # 1 PiB
    message = f"{type(raised.value).__module__}.{type(raised.value).__qualname__}: {raised.value}"
    assert "CUDA out of memory" in message  # the wording the CPU unit test copies
    log = 'Traceback (most recent call last):\n  File "train.py", line 1\n' + message + "\n"
    verdict = classify(1, None, log, step=3)
    assert verdict.crash_class is CrashClass.OOM, (verdict, message)


@pytest.mark.e2e
def test_an_oom_in_a_rank_is_classified_and_relaunched(tmp_path: Path) -> None:
    # The fault strikes on the first attempt only; the default policy relaunches an OOM once.
    result, run_dir = babysat(tmp_path, "oom", "--steps", "12", "--oom", "1:6",
                              "--device", "cuda", "--ddp", launch_extra="  max_restarts: 1\n")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    finding = next(e for e in journal(run_dir, "finding")
                   if e["finding"]["incident"] == "crash")
    assert finding["finding"]["evidence"]["class"] == "oom", finding
    assert finding["finding"]["ranks"] == [1]
    assert finding["remedy"]["action"] == "relaunch"
    assert read_jsonl(run_dir / "events.jsonl")[-1]["state"] == "succeeded"
