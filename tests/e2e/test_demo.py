"""The demo model with a corrupted stretch of data, under babysit (torchrun-style, no config),
against the same job clean (plain torchrun): babysit's run must end within 1 % of the clean one.

The corruption (random targets for global batches 220-249) is in the data, so it would come back
after a rollback unless those batches are skipped; it ends 10 steps before the run does. Plain
torchrun on the same data ends 39 % worse (3.197 against 2.297, docs/recovery.md); that run is
not repeated here: the journal below shows the spike caught, rerun, reproduced and skipped, which
is what made the difference. ``benchmarks/eval_detectors.py --e2e`` measures all three at the
demo's full size.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, babysit_env, console_noise, read_jsonl, run_babysit

pytestmark = pytest.mark.e2e

DEMO = ROOT / "configs" / "demo_train.py"
ARGS = ["--steps", "260", "--eval-every", "1000"]
CORRUPT = ["--corrupt", "220:250"]


def eval_loss(output: str) -> float:
    match = re.search(r"done: .* eval loss ([0-9.]+)", output)
    assert match, output[-3000:]
    return float(match.group(1))


def test_babysit_recovers_a_data_spike_to_within_1_percent_of_the_clean_run(
        tmp_path: Path) -> None:
    # The clean reference is the job itself (babysit's attach() and saves change nothing of its
    # training: the same 2.297 either way), without a supervisor's own start and standby.
    clean = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--standalone", str(DEMO), *ARGS],
        cwd=tmp_path, env=babysit_env(), capture_output=True, text=True, timeout=300)
    # Its training finished and said so (gloo in torch 2.13 sometimes aborts a rank in its
    # teardown after that, and plain torchrun then exits 1).
    assert clean.returncode == 0 or "eval loss" in clean.stdout, clean.stderr[-3000:]

    # The torchrun-style invocation, no config: babysit checkpoints by default (every 100 steps,
    # then the cadence advice's interval), so the spike at step 221 goes back to step 100.
    spiked = run_babysit("run", "--nproc-per-node", "2", "--run-dir", str(tmp_path / "spike"),
                         str(DEMO), *ARGS, *CORRUPT, cwd=tmp_path, timeout=300)
    assert spiked.returncode == 0, spiked.stdout[-3000:]
    # Its console says what babysit did, and nothing of torch's that babysit caused (every
    # rank of every attempt once warned of a deprecated flight recorder setting).
    journal = read_jsonl(tmp_path / "spike" / "events.jsonl")
    assert console_noise(spiked.stdout + spiked.stderr, journal, [0, 1], alerts=False) == []

    # Rerun from there first, nothing skipped; the spike came back at the same batches (the
    # data's), so back once more, skipping them: from the rerun's own save where the skip
    # starts, not from step 100 a third time.
    resumes = [e for e in journal if e["event"] == "resume" and e.get("from")]
    assert (resumes[0]["checkpoint_step"], resumes[0]["verdict"]) == (100, "good")
    launches = [e for e in journal if e["event"] == "launch"]
    skip_start = launches[-1]["directive"]["skip"][0]["start"]
    assert launches[1]["directive"]["save_at"] == skip_start > 100
    assert (resumes[1]["cursor"], resumes[1]["verdict"]) == (skip_start, "pending")
    assert resumes[1]["replayed"].startswith("replayed by the rerun of steps 101-")
    (rerun,) = [e for e in journal if e["event"] == "rerun"]
    assert rerun["verdict"] == "reproduced"
    # The LR cut is temporary, and on the record: journal, status.
    (lr,) = [e for e in journal if e["event"] == "lr_scale"]
    assert lr["lr_scale"] == 0.5 and lr["lr_ramp"]["to"] == 1.0
    status = run_babysit("status", str(tmp_path / "spike"), cwd=tmp_path, timeout=60)
    assert "back to x1 over batches" in status.stdout, status.stdout
    reference, protected = eval_loss(clean.stdout), eval_loss(spiked.stdout)
    print(f"final eval loss: clean {reference:.3f}, babysit {protected:.3f}")
    assert protected <= reference * 1.01
