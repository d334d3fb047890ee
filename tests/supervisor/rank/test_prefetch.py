"""nanoGPT's loop, which draws the next step's batch inside the step (after the last micro-step's
forward, before ``opt.step()``) and once more before its loop on a resume, resumes bit-exact
from a periodic checkpoint and from the keeper's state; a loop that draws for the step itself
after its last forward, which babysit cannot resume exactly, is told so on its console
(``rank/boundary.py``), in one process with a real ``attach()``. The same under ``babysit run``,
two DDP ranks and real faults: ``tests/e2e/test_nanogpt.py``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from babysit import attach
from babysit.checkpoints import just_in_time, mark, step_dir
from babysit.checkpoints.manifest import FileEntry
from babysit.supervisor.contract import protocol
from babysit.supervisor.contract.directive import Directive, Resume
from babysit.supervisor.node.intake import Intake
from tests.supervisor.rank.test_boundary import intake  # noqa: F401  (a fixture)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning",
                                        "ignore:.*load in a single process:UserWarning")
INEXACT = "is not exact"


class Loop:
    """One babysat rank of a nanoGPT-shaped job (``shape="nanogpt"``): the first batch drawn
    before the loop, two micro-steps each drawing the next batch right after its forward, from
    torch's global generator, dropout; the worker-API page's loop (``shape="top"``), the batch
    drawn at the top of the step; or (``shape="sampling"``) that loop drawing for the step
    itself after its last forward (a sample for a log)."""

    def __init__(self, tmp: Path, monkeypatch: pytest.MonkeyPatch, *, shape: str = "nanogpt",
                 seed: int = 0, keep: bool = False, every: int = 0,
                 resume: Resume | None = None) -> None:
        directive = tmp / f"directive-{seed}.json"
        Directive(checkpoint_dir=str(tmp / "ckpt"), checkpoint_every=every, resume=resume,
                  just_in_time={"marks": str(tmp / "marks"), "hold_s": 5.0} if keep else {},
                  ).write(directive)
        monkeypatch.setenv(protocol.ENV_DIRECTIVE, str(directive))
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
                                         torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
        self.opt = torch.optim.Adam(self.model.parameters(), lr=0.01)
        torch.manual_seed(100 + seed)  # the data's and dropout's stream (restored on resume)
        self.run = attach(model=self.model, optimizer=self.opt)
        self.shape = shape
        self.x = torch.randn(3, 4) if shape == "nanogpt" else None  # before the loop

    def step(self, between: Callable[[str], None] = lambda where: None) -> float:
        total = 0.0
        if self.shape != "nanogpt":
            self.x = torch.randn(3, 4)
        for micro in range(2):
            loss = self.model(self.x).square().mean() / 2
            if self.shape == "nanogpt":
                self.x = torch.randn(3, 4)  # the next batch, prefetched
            between(f"micro {micro}")
            loss.backward()
            total += loss.item()
        if self.shape == "sampling":
            torch.randint(10, (1,))  # the step's own draw, after its last forward
        self.run.step(loss=total)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return total

    def train(self, to: int) -> dict[int, float]:
        losses = {}
        while self.run.step_count < to:
            loss = self.step()
            losses[self.run.step_count] = loss
        return losses


@pytest.mark.parametrize("shape", ["nanogpt", "top"])
def test_a_loop_drawing_its_batch_after_the_last_forward_or_at_the_top_resumes_bit_exact(
        tmp_path: Path, intake: Intake, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
        capsys: pytest.CaptureFixture[str], shape: str) -> None:
    """From a periodic checkpoint, saved as the next step's first forward began."""
    job = Loop(tmp_path, monkeypatch, shape=shape, every=3)
    losses = job.train(9)
    job.run.close()
    resumed = Loop(tmp_path, monkeypatch, shape=shape, seed=1, every=3,
                   resume=Resume(path=str(step_dir(tmp_path / "ckpt", 6)), step=6, cursor=6))
    assert resumed.train(9) == {s: losses[s] for s in (7, 8, 9)}
    resumed.run.close()
    assert INEXACT not in capsys.readouterr().err


def test_nanogpts_loop_resumes_bit_exact_from_the_keepers_state_after_a_mid_step_fault(
        tmp_path: Path, intake: Intake, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
        capsys: pytest.CaptureFixture[str]) -> None:
    """The fault comes inside step 3, after its first micro-step drew the batch of the second:
    the state written is step 2's, with the streams as step 2's last forward ended."""
    job = Loop(tmp_path, monkeypatch, keep=True)
    keeper = job.run._keeper
    job.train(2)
    expected: dict[int, float] = {}
    root = tmp_path / "jit"
    written: dict[str, Any] = {}

    def fault(where: str) -> None:
        if where == "micro 0" and not written:
            assert keeper.view()["consistent"] and keeper.view()["step"] == 2
            assert mark.read(tmp_path / "marks" / "0").forward  # step 3's first forward noted
            written.update(keeper.write(str(just_in_time.staging_dir(root, 2)), 2, True))

    expected[3] = job.step(between=fault)
    assert written["ok"], written
    files = [FileEntry(f["name"], f["size"], f["crc32"]) for f in written["files"]]
    path = just_in_time.commit(root, just_in_time.Plan(2, 2, None, 1.0, writers=(0,)), files,
                               world_size=1, fault="crash")
    expected.update(job.train(5))
    job.run.close()

    resumed = Loop(tmp_path, monkeypatch, seed=1, keep=True,
                   resume=Resume(path=str(path), step=2, cursor=2))
    assert resumed.train(5) == expected
    resumed.run.close()
    assert INEXACT not in capsys.readouterr().err


def test_a_loop_that_draws_for_its_step_after_its_last_forward_is_told_its_resume_is_not_exact(
        tmp_path: Path, intake: Intake, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
        capsys: pytest.CaptureFixture[str]) -> None:
    """The streams kept are those after the step's last forward, before the step's own draw,
    which the resumed script does not repeat: its first forward starts from other streams
    than the run had there, and the rank says so, once, with the change that makes it exact."""
    job = Loop(tmp_path, monkeypatch, shape="sampling", every=3)
    losses = job.train(6)
    job.run.close()
    assert INEXACT not in capsys.readouterr().err
    resumed = Loop(tmp_path, monkeypatch, shape="sampling", seed=1, every=3,
                   resume=Resume(path=str(step_dir(tmp_path / "ckpt", 3)), step=3, cursor=3))
    again = resumed.train(6)
    resumed.run.close()
    assert again != {s: losses[s] for s in (4, 5, 6)}
    said = [line for line in capsys.readouterr().err.splitlines() if INEXACT in line]
    assert len(said) == 1, said
    assert said[0].startswith("babysit: [warning] rank 0's resume at step 3 is not exact")
    assert "draw each step's batch at its top" in said[0]
    assert "from a torch.Generator of your own" in said[0]
