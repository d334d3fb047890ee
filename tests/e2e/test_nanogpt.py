"""karpathy's nanoGPT ``train.py`` loop as it is, under ``babysit run``, resumes from its
just-in-time state bit for bit (issue 55).

``tests/workers/nanogpt_train.py`` keeps nanoGPT's own loop with the few lines a new user adds:
the next step's batch drawn inside the last micro-step of gradient accumulation (after its
forward, before ``opt.step()``) and once before the loop, on a resume too; torch's global
generator for the batches and for dropout; DDP over gloo with 2 ranks; rank 0's
``estimate_loss()`` drawing more at the top of every tenth iteration. The streams a step's end
keeps are those as its last training forward ended (``supervisor/rank/boundary.py``), so the
resumed script's first ``get_batch`` draws again the batch the run had prefetched.

One clean run, and one where rank 1 is SIGKILLed mid-step (its next batch drawn) in the
iteration after an eval boundary (the relaunch resumes at step 20, and rank 0's first
iteration evaluates again after its prefetch), then rank 0 dies of SIGSEGV mid-step 33 (its
streams come from its mark). Every step's losses on both ranks, every eval and the final
weights are the clean run's, bit for bit, and no rank says its resume was not exact.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.conftest import WORKERS, babysat, journal, read_jsonl

pytestmark = pytest.mark.e2e

SCRIPT = WORKERS / "nanogpt_train.py"
MAX_ITERS = 40
SAVES = "{every_steps: 15, probation_steps: 5, async_save: true}"


def run_of(tmp: Path, name: str, *faults: str) -> tuple[Path, str, str]:
    """A finished run: its directory, its console, and the digest of its final weights."""
    digest = tmp / f"{name}.sha256"
    result, run_dir = babysat(tmp, name, "--max-iters", str(MAX_ITERS), "--digest", str(digest),
                              *faults, checkpoints=SAVES, script=SCRIPT,
                              launch_extra="" if faults else "  warm_standby: false\n")
    assert result.returncode == 0, result.stdout + result.stderr
    return run_dir, result.stdout + result.stderr, digest.read_text()


def outcome(run_dir: Path) -> tuple[dict[int, Any], dict[tuple[int, str], float]]:
    """Step -> both ranks' losses (the newest attempt's, where several trained a step), and
    (step, name) -> rank 0's evaluations (``val_loss`` every tenth iteration, the final
    held-out ``eval_loss``)."""
    losses = {m["step"]: m["loss_per_rank"] for m in read_jsonl(run_dir / "metrics.jsonl")}
    evals = {(e["data"]["step"], name): value
             for e in read_jsonl(run_dir / "events.jsonl")
             if e["event"] == "worker_scalars" and e["rank"] == 0
             for name, value in e["data"]["values"].items()}
    return losses, evals


def test_nanogpts_loop_resumes_from_just_in_time_state_bit_exact(tmp_path: Path) -> None:
    clean_dir, _, clean_weights = run_of(tmp_path, "clean")
    run_dir, console, weights = run_of(tmp_path, "faults", "--at", "0:1:21:SIGKILL",
                                       "--at", "1:0:33:SIGSEGV")

    kept = [(e["fault"], e["outcome"], e["checkpoint_step"], e["writers"], e["marks"])
            for e in journal(run_dir, "just_in_time")]
    assert kept == [("crash", "saved", 20, [0], [1]), ("crash", "saved", 32, [1], [0])]
    resumes = [e["checkpoint_step"] for e in journal(run_dir, "resume") if e.get("from")]
    assert resumes == [20, 32]
    assert all(e["data"]["took"] for e in journal(run_dir, "resume_check"))

    clean_losses, clean_evals = outcome(clean_dir)
    losses, evals = outcome(run_dir)
    assert sorted(losses) == list(range(1, MAX_ITERS + 2))  # nanoGPT trains 0..max_iters
    assert losses == clean_losses
    assert evals == clean_evals and (20, "val_loss") in evals
    assert weights == clean_weights
    assert "is not exact" not in console
