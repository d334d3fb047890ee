"""Any loop shape: periodic checkpoints and just-in-time state where the script never loops
``for batch in run.batches(...)``, for real (issue 46).

Real torchrun jobs of ``tests/workers/while_train.py`` (2 DDP ranks over gloo, dropout, Adam,
StepLR: a resume is exact only if the weights, the optimizer, the scheduler and every rank's
random streams all come back), 400 steps, checkpoints every 100, rank 1 killed by SIGSEGV just
before step 240. In each shape the periodic checkpoints of steps 100 and 200 are saved, the
relaunch resumes at step 239 from the just-in-time state rank 0 wrote (rank 1's streams from its
mark), and every step's losses and the final held-out loss are bit for bit those of the same
loop without the fault:

- nanoGPT's ``while`` loop, each rank's batch drawn from torch's global generator at the top of
  the step, ``run.step()`` before ``opt.step()``: the point between steps is found from the
  optimizer's hooks alone;
- torchtitan's ``train_step(data_iter)``, ``next()`` drawn from ``run.batches(loader)``: the
  top of ``run.batches()`` as ever;
- the same with a plain iterator of the script's, fast-forwarded by the script, and the step
  reported after ``opt.step()`` and ``sched.step()``.

A loop babysit cannot find the point between steps in (no optimizer given to ``attach()``,
no ``run.batches()``) is told so on the console, once, at its first step; the reasons and when
each is known are ``tests/supervisor/rank/test_boundary.py``'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.conftest import WORKERS, babysat, final_eval, journal, read_jsonl

pytestmark = pytest.mark.e2e

STEPS = 400
SCRIPT = WORKERS / "while_train.py"
SAVES = "{every_steps: 100, probation_steps: 5, async_save: true}"
FAULT = ("--at", "0:1:240:SIGSEGV")


def run_of(tmp: Path, name: str, shape: str, *extra: str, relaunches: bool = True) -> Path:
    """A finished run of ``shape``; without ``relaunches`` no standby waits for a relaunch."""
    result, run_dir = babysat(tmp, name, "--shape", shape, "--steps", str(STEPS), *extra,
                              checkpoints=SAVES, script=SCRIPT,
                              launch_extra="" if relaunches else "  warm_standby: false\n")
    assert result.returncode == 0, result.stdout + result.stderr
    return run_dir


def losses(run_dir: Path) -> dict[int, Any]:
    """Step -> every rank's loss (the newest attempt's, where several trained a step)."""
    return {m["step"]: m["loss_per_rank"] for m in read_jsonl(run_dir / "metrics.jsonl")}


def outcome(run_dir: Path) -> tuple[dict[int, Any], float]:
    return losses(run_dir), final_eval(read_jsonl(run_dir / "events.jsonl"), STEPS)


@pytest.fixture(scope="module")
def clean_while(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[int, Any], float]:
    """The ``while`` loop without a fault."""
    return outcome(run_of(tmp_path_factory.mktemp("clean_while"), "clean", "while",
                          relaunches=False))


@pytest.fixture(scope="module")
def clean_iterator(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[int, Any], float]:
    """A ``train_step(data_iter)`` loop without a fault: both iterator shapes draw the same
    batches in the same order and compute the same numbers."""
    return outcome(run_of(tmp_path_factory.mktemp("clean_iterator"), "clean", "iterator",
                          relaunches=False))


def assert_resumed_at_the_fault(run_dir: Path, clean: tuple[dict[int, Any], float]) -> None:
    """Checkpoints of 100 and 200 saved before the fault; the relaunch resumed at 239 from the
    just-in-time state; the run ended bit for bit as the clean one."""
    saved = [(e["attempt"], e["checkpoint_step"]) for e in journal(run_dir, "checkpoint_saved")]
    assert saved[:2] == [(0, 100), (0, 200)], saved
    assert saved[2:] == [(1, 300), (1, 400)], saved  # the last one at run.close()
    kept = journal(run_dir, "just_in_time")
    assert [(e["fault"], e["outcome"], e["checkpoint_step"], e["writers"], e["marks"])
            for e in kept] == [("crash", "saved", 239, [0], [1])]
    resumes = [e for e in journal(run_dir, "resume") if e.get("from")]
    assert [(e["checkpoint_step"], e["just_in_time"]["periodic_step"]) for e in resumes] == \
        [(239, 200)]
    assert min(m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")
               if m["attempt"] == 1) == 240
    assert all(e["data"]["took"] for e in journal(run_dir, "resume_check"))
    # The resumed attempt's first run.step() came before its first step's end (the while
    # loop's order): no step of its own had ended yet, and nothing is wrong (issue 55).
    assert not journal(run_dir, "checkpoints_off")
    clean_losses, clean_eval = clean
    got_losses, got_eval = outcome(run_dir)
    assert got_losses == clean_losses
    assert got_eval == clean_eval


def test_a_while_loop_drawing_from_the_global_generator_resumes_at_the_fault_bit_exact(
        tmp_path: Path, clean_while: tuple[dict[int, Any], float]) -> None:
    run_dir = run_of(tmp_path, "while", "while", *FAULT)
    assert_resumed_at_the_fault(run_dir, clean_while)
    # The worker side said where each checkpoint was taken: no step saved twice.
    steps = [e["checkpoint_step"] for e in journal(run_dir, "checkpoint_saved")]
    assert len(steps) == len(set(steps))


@pytest.mark.parametrize("shape", ["batches-next", "iterator"])
def test_a_train_step_drawing_with_next_resumes_at_the_fault_bit_exact(
        tmp_path: Path, clean_iterator: tuple[dict[int, Any], float], shape: str) -> None:
    assert_resumed_at_the_fault(run_of(tmp_path, shape, shape, *FAULT), clean_iterator)


def test_a_loop_whose_steps_babysit_cannot_see_is_told_so_on_the_console(tmp_path: Path) -> None:
    result, run_dir = babysat(tmp_path, "blind", "--shape", "while", "--steps", "20",
                              "--no-optimizer", checkpoints="{every_steps: 5}", script=SCRIPT,
                              launch_extra="  warm_standby: false\n")
    assert result.returncode == 0, result.stdout + result.stderr
    said = [line for line in result.stdout.splitlines() if "babysit: [warning] "
            "checkpoints.every_steps is 5, but attach() got no optimizer" in line]
    assert len(said) == 1, result.stdout  # rank 0's, once
    assert "(rank 0, step 1)" in said[0] and "run.batches(loader)" in said[0]
    [off] = journal(run_dir, "checkpoints_off")
    assert off["why"] in said[0]
    assert not journal(run_dir, "checkpoint_saved")
