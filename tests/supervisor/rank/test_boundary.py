"""The point between two steps of a loop without ``run.batches()`` (``rank/boundary.py``), in one
process: its bookkeeping for every order of ``run.step()`` and ``opt.step()``; a real
``attach()`` (a real intake socket, a tiny model with dropout, Adam, a scheduler) whose periodic
checkpoints and keeper's state, taken from the optimizer's hooks, resume bit-exact; the
``run.batches()`` loop left as it was; and what a run that can take no checkpoint is told. Real
torchrun jobs of those loop shapes meeting a real fault: ``tests/e2e/test_loop_shapes.py``."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from babysit import attach
from babysit.checkpoints import just_in_time, load, step_dir
from babysit.checkpoints.manifest import FileEntry
from babysit.supervisor.contract import protocol
from babysit.supervisor.contract.directive import Directive, Resume
from babysit.supervisor.node.intake import Intake
from babysit.supervisor.rank.api import Run
from babysit.supervisor.rank.boundary import StepEnds, why_no_checkpoints

# DCP warns when it runs without a process group; these tests do that on purpose.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning",
                                        "ignore:.*load in a single process:UserWarning")
TOKEN = b"b" * protocol.TOKEN_BYTES


# -- the bookkeeping -----------------------------------------------------------------------------

def test_a_step_ends_once_its_report_and_its_update_both_came_in_either_order() -> None:
    ends = StepEnds()
    assert not ends.start()  # nothing ended yet: no step to start after
    # run.step() before opt.step(), as the worker-API page shows.
    assert not ends.report(keep=True) and ends.update()
    assert ends.start() and not ends.start()  # the next step starts once
    # run.step() after opt.step(), as torchtitan reports.
    assert not ends.update() and ends.report(keep=True)
    # A skipped update (run.step() said False): the step ends at the report.
    assert ends.report(keep=False)
    assert ends.ended == 3 and ends.open


def test_an_update_the_optimizer_never_ran_ends_no_step() -> None:
    """A GradScaler that met infinite gradients skips opt.step() although run.step() said keep:
    that step has no end, and the next one ends as usual."""
    ends = StepEnds()
    assert not ends.report(keep=True)  # step 1: its update never comes
    assert not ends.report(keep=True)  # step 2's report
    assert ends.update() and ends.ended == 1


# -- what a run that can take no checkpoint is told ----------------------------------------------

def why(**kw: Any) -> tuple[bool, str | None]:
    facts = {"wanted": True, "model": True, "optimizer": True, "by_loader": False,
             "ended": 0, "step": 1, "began": 0, "every": 100, "rank": 0, **kw}
    return why_no_checkpoints(**facts)


def test_what_a_run_that_can_take_no_checkpoint_is_told_and_when() -> None:
    assert why(wanted=False, model=False) == (True, None)  # not asked, or a framework saves
    known, said = why(model=False)
    assert known and said is not None
    assert "attach() got no model (rank 0, step 1)" in said and "attach(model=" in said
    assert "checkpoints.every_steps: 0" in said  # the other way out: the script's own saves
    known, said = why(optimizer=False)
    assert known and said is not None and "no optimizer" in said
    assert "run.batches(loader)" in said and "attach(optimizer=...)" in said
    assert why(optimizer=False, by_loader=True) == (True, None)  # batches() finds the point
    assert why(ended=1) == (True, None)
    assert why(step=100) == (False, None)  # step 100's end may still come (opt.step() after)
    known, said = why(step=101)
    assert known and said is not None
    assert "in 100 steps no training step ended" in said and "due at step 100" in said


def test_a_resumed_attempt_is_weighed_by_its_own_steps_not_the_runs() -> None:
    """The attempt resumed at step 256 counted its first step (257) before its optimizer ended
    one (``run.step()`` before ``opt.step()``): nothing known yet, and nothing wrong; the
    question is this attempt's steps against this attempt's first save (300)."""
    assert why(began=256, step=257) == (False, None)
    assert why(began=256, step=300) == (False, None)
    known, said = why(began=256, step=301)
    assert known and said is not None
    assert "in 44 steps since its resume at step 256 no training step ended" in said
    assert "the checkpoint due at step 300 was not saved" in said


# -- a real attach() ------------------------------------------------------------------------------

@pytest.fixture
def intake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Intake]:
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    it = Intake(run_dir / "telemetry.sock", TOKEN).open()
    monkeypatch.setenv(protocol.ENV_SOCKET, str(it.path))
    monkeypatch.setenv(protocol.ENV_TOKEN, TOKEN.hex())
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    yield it
    it.close()


class Job:
    """One babysat rank of a tiny job: a model with dropout, Adam, a scheduler that moves the
    LR every step; the directive written as babysit writes it."""

    def __init__(self, tmp: Path, intake: Intake, monkeypatch: pytest.MonkeyPatch, *,
                 seed: int = 0, keep: bool = False, every: int = 0,
                 resume: Resume | None = None, optimizer: bool = True) -> None:
        self.intake = intake
        directive = tmp / f"directive-{seed}.json"
        Directive(checkpoint_dir=str(tmp / "ckpt"), checkpoint_every=every, resume=resume,
                  just_in_time={"marks": str(tmp / "marks"), "hold_s": 5.0} if keep else {},
                  ).write(directive)
        monkeypatch.setenv(protocol.ENV_DIRECTIVE, str(directive))
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
                                         torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
        self.opt = torch.optim.Adam(self.model.parameters(), lr=0.01)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=1, gamma=0.9)
        torch.manual_seed(100 + seed)  # the data's and dropout's stream (restored on resume)
        self.run: Run = attach(model=self.model, optimizer=self.opt if optimizer else None,
                               scheduler=self.sched)

    def step(self, report_after: bool = False,
             between: Callable[[str], None] = lambda where: None) -> float:
        """One step of a nanoGPT-shaped loop: the batch drawn from the global generator at the
        top; ``between(where)`` called at each point a fault could come."""
        x = torch.randn(3, 4)
        loss = self.model(x).square().mean()
        loss.backward()
        value = loss.item()
        if report_after:  # torchtitan's order: update, schedule, then report
            self.opt.step()
            between("updated")
            self.sched.step()
            between("scheduled")
            self.run.step(loss=value)
        else:
            if self.run.step(loss=value):
                self.opt.step()
            between("updated")
            self.opt.zero_grad()
            self.sched.step()
        between("scheduled")
        self.opt.zero_grad()
        return value

    def train(self, to: int, report_after: bool = False) -> dict[int, float]:
        losses = {}
        while self.run.step_count < to:
            loss = self.step(report_after)
            losses[self.run.step_count] = loss
        return losses

    def events(self, kind: str) -> list[dict[str, Any]]:
        return [m.data for m in self.intake.drain()
                if isinstance(m, protocol.WorkerEvent) and m.type == kind]


@pytest.mark.parametrize("report_after", [False, True], ids=["report-first", "update-first"])
def test_a_while_loop_is_saved_on_its_cadence_and_resumes_bit_exact(
        tmp_path: Path, intake: Intake, monkeypatch: pytest.MonkeyPatch,
        report_after: bool) -> None:
    job = Job(tmp_path, intake, monkeypatch, every=3)
    losses = job.train(9, report_after)
    job.run.close()  # step 9's checkpoint is owed until the next step's start: the close
    assert [e["step"] for e in job.events("checkpoint")] == [3, 6, 9]
    assert job.run.cursor == 9  # one global batch a step

    # A fresh process resumes from step 6 (other weights, other streams until the restore).
    resumed = Job(tmp_path, intake, monkeypatch, seed=1, every=3,
                  resume=Resume(path=str(step_dir(tmp_path / "ckpt", 6)), step=6, cursor=6))
    assert (resumed.run.step_count, resumed.run.cursor) == (6, 6)
    assert resumed.train(9, report_after) == {s: losses[s] for s in (7, 8, 9)}
    resumed.run.close()


def test_a_while_loop_saves_the_final_checkpoint_a_preemption_asks_for(
        tmp_path: Path, intake: Intake, monkeypatch: pytest.MonkeyPatch) -> None:
    """The supervisor's request before a SIGTERM's stop (the control file): saved at the next
    step's end, waited for and announced as final."""
    job = Job(tmp_path, intake, monkeypatch, every=1000)
    job.train(2)
    control = Path(job.run._checkpointer.control or "")
    control.write_text(json.dumps({"final_checkpoint": "sigterm-1"}))
    job.train(4)
    job.run.close()
    assert [(e["step"], e.get("final")) for e in job.events("checkpoint")] == [(3, True)]


def test_the_keepers_state_is_the_steps_from_its_end_and_loads_back_bit_exact(
        tmp_path: Path, intake: Intake, monkeypatch: pytest.MonkeyPatch) -> None:
    """The mark comes at the optimizer's post-hook, before the script's sched.step(): a fault
    between the two keeps nothing; after it, the state is the step's, and a resume from it
    trains on exactly as the run did."""
    job = Job(tmp_path, intake, monkeypatch, keep=True)
    keeper = job.run._keeper
    assert keeper.view()["consistent"] and keeper.view()["step"] == 0  # attach()'s mark
    seen: dict[str, dict[str, Any]] = {}
    job.step(between=lambda where: seen.setdefault(f"1 {where}", keeper.view()))
    job.step(between=lambda where: seen.setdefault(f"2 {where}", keeper.view()))
    # Step 1, the attempt's first: whether the scheduler steps after opt.step() is not known.
    assert "not known yet" in seen["1 updated"]["why"]
    # Step 2: learned from step 1's end and step 2's start.
    assert "between optimizer.step() and the scheduler's step" in seen["2 updated"]["why"]
    assert seen["2 scheduled"]["consistent"] and seen["2 scheduled"]["step"] == 2
    x = torch.randn(3, 4)  # step 3's batch drawn; its forward settles the scheduler's epoch
    loss = job.model(x).square().mean()
    loss.backward()
    assert keeper.view()["consistent"] and keeper.view()["step"] == 2

    root = tmp_path / "jit"
    stage = just_in_time.staging_dir(root, 2)
    answer = keeper.write(str(stage), 2, True)  # as the node asks after a fault here
    assert answer["ok"], answer
    files = [FileEntry(f["name"], f["size"], f["crc32"]) for f in answer["files"]]
    path = just_in_time.commit(root, just_in_time.Plan(2, 2, None, 1.0, writers=(0,)), files,
                               world_size=1, fault="crash")
    expected = {3: loss.item()}  # the run goes on as if nothing happened
    if job.run.step(loss=loss.item()):
        job.opt.step()
    job.opt.zero_grad()
    job.sched.step()
    expected.update(job.train(5))
    job.run.close()

    torch.manual_seed(5)
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Dropout(0.5),
                                torch.nn.Linear(8, 1))
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.01)
    fresh_sched = torch.optim.lr_scheduler.StepLR(fresh_opt, step_size=1, gamma=0.9)
    restored = load(path, fresh, fresh_opt, fresh_sched)
    assert (restored.step, restored.cursor) == (2, 2)
    again = {}
    for step in (3, 4, 5):
        loss = fresh(torch.randn(3, 4)).square().mean()
        loss.backward()
        again[step] = loss.item()
        fresh_opt.step()
        fresh_opt.zero_grad()
        fresh_sched.step()
    assert again == {s: expected[s] for s in (3, 4, 5)}


def test_a_scheduler_stepped_before_the_report_is_settled_at_the_end(
        tmp_path: Path, intake: Intake, monkeypatch: pytest.MonkeyPatch) -> None:
    """torchtitan's order (update, schedule, report): the step ends at run.step(), with the
    scheduler already moved, so the state is the step's at once after the attempt's first."""
    job = Job(tmp_path, intake, monkeypatch, keep=True)
    keeper = job.run._keeper
    job.train(2, report_after=True)
    assert keeper.view()["consistent"] and keeper.view()["step"] == 2
    x = torch.randn(3, 4)
    job.model(x).square().mean().backward()
    job.opt.step()  # a fault inside step 3's update, or after it, keeps nothing of step 2
    assert "optimizer.step() ran since" in keeper.view()["why"]
    job.run.close()


def test_under_run_batches_a_step_is_marked_at_its_end_and_at_the_top_only_after_a_draw(
        tmp_path: Path, intake: Intake, monkeypatch: pytest.MonkeyPatch) -> None:
    """The top of ``run.batches()`` saves exactly as ever; the step's end is marked at the
    optimizer's hook, so a fault in the loop's tail (after ``sched.step()``, before the next
    batch) finds the step done, and the top marks again only where the script drew in between
    (the resumed run will not repeat a draw made in the tail)."""
    job = Job(tmp_path, intake, monkeypatch, keep=True, every=2)
    keeper = job.run._keeper
    assert keeper.view()["step"] == 0  # the first step's start: marked at attach()'s end
    marks: list[tuple[int, bool]] = []
    mark = keeper.mark

    def counted(step: int, *args: Any, settled: bool = True, **kw: Any) -> None:
        marks.append((step, settled))
        mark(step, *args, settled=settled, **kw)

    keeper.mark = counted
    tails = []
    data = [torch.randn(3, 4) for _ in range(5)]
    for x in job.run.batches(data):
        if job.run.step_count >= 4:
            break
        loss = job.model(x).square().mean()
        loss.backward()
        if job.run.step(loss=loss.item()):
            job.opt.step()
        job.opt.zero_grad()
        job.sched.step()
        if job.run.step_count == 2:
            torch.rand(1)  # the script draws between steps
        tails.append(keeper.view())
    job.run.close()
    assert marks == [(1, False), (2, False), (2, True), (3, False), (4, False)]
    assert "not known yet" in tails[0]["why"]  # the attempt's first step: as before
    assert [(v["consistent"], v["step"]) for v in tails[1:]] == [(True, 2), (True, 3), (True, 4)]
    assert [e["step"] for e in job.events("checkpoint")] == [2, 4]  # at the top, once each
    assert job.run.cursor == 5  # counted by the loader: the batch drawn before the break


def test_run_batches_drawn_with_next_saves_its_last_step_at_close(
        tmp_path: Path, intake: Intake, monkeypatch: pytest.MonkeyPatch) -> None:
    """torchtitan's shape: ``next(data_iter)`` at each step's start. The top of the loop after
    the last step never comes; the checkpoint due there is saved at ``run.close()``."""
    job = Job(tmp_path, intake, monkeypatch, every=2)
    data_iter = job.run.batches([torch.randn(3, 4) for _ in range(10)])
    while job.run.step_count < 4:
        loss = job.model(next(data_iter)).square().mean()
        loss.backward()
        if job.run.step(loss=loss.item()):
            job.opt.step()
        job.opt.zero_grad()
        job.sched.step()
    job.run.close()
    assert [e["step"] for e in job.events("checkpoint")] == [2, 4]
    assert load(step_dir(tmp_path / "ckpt", 4), job.model).cursor == 4


def test_a_run_that_can_take_no_checkpoint_says_so_at_its_first_step(
        tmp_path: Path, intake: Intake, monkeypatch: pytest.MonkeyPatch) -> None:
    job = Job(tmp_path, intake, monkeypatch, every=3, optimizer=False)
    job.train(4)
    job.run.close()
    said = job.events("checkpoints_off")
    assert len(said) == 1 and said[0]["step"] == 1  # once, at the first step
    assert "attach() got no optimizer" in said[0]["why"]  # the supervisor warns with it
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.filterwarnings("ignore:Detected call of:UserWarning")
def test_a_run_whose_optimizer_never_ends_a_step_says_so_once_the_first_save_was_due(
        tmp_path: Path, intake: Intake, monkeypatch: pytest.MonkeyPatch) -> None:
    job = Job(tmp_path, intake, monkeypatch, every=2)
    other = torch.optim.SGD(job.model.parameters(), lr=0.01)  # not the one attach() got
    job.opt = other
    job.train(4)
    job.run.close()
    said = job.events("checkpoints_off")
    assert [e["step"] for e in said] == [3]
    assert "the checkpoint due at step 2 was not saved" in said[0]["why"]


@pytest.mark.parametrize("report_after", [False, True], ids=["report-first", "update-first"])
def test_a_resumed_attempt_whose_steps_end_is_told_nothing(
        tmp_path: Path, intake: Intake, monkeypatch: pytest.MonkeyPatch,
        report_after: bool) -> None:
    """A resumed attempt's first ``run.step()`` comes before its first ``opt.step()`` (the
    worker-API page's loop): it counts step 7 with no step ended in this attempt yet, which
    is no sign of a run that cannot save. It saves on its cadence and says nothing."""
    job = Job(tmp_path, intake, monkeypatch, every=3)
    job.train(6, report_after)
    job.run.close()
    assert [e["step"] for e in job.events("checkpoint")] == [3, 6]
    resumed = Job(tmp_path, intake, monkeypatch, seed=1, every=3,
                  resume=Resume(path=str(step_dir(tmp_path / "ckpt", 6)), step=6, cursor=6))
    resumed.train(10, report_after)
    resumed.run.close()
    said = [m for m in intake.drain() if isinstance(m, protocol.WorkerEvent)]
    assert [m.data["step"] for m in said if m.type == "checkpoint"] == [9]
    assert [m.data for m in said if m.type == "checkpoints_off"] == []


@pytest.mark.filterwarnings("ignore:Detected call of:UserWarning")
def test_a_resumed_attempt_whose_optimizer_never_ends_a_step_says_so_after_its_own_first_save(
        tmp_path: Path, intake: Intake, monkeypatch: pytest.MonkeyPatch) -> None:
    job = Job(tmp_path, intake, monkeypatch, every=3)
    job.train(6)
    job.run.close()
    intake.drain()
    resumed = Job(tmp_path, intake, monkeypatch, seed=1, every=3,
                  resume=Resume(path=str(step_dir(tmp_path / "ckpt", 6)), step=6, cursor=6))
    resumed.opt = torch.optim.SGD(resumed.model.parameters(), lr=0.01)  # not attach()'s
    resumed.train(11)
    resumed.run.close()
    said = resumed.events("checkpoints_off")
    assert [e["step"] for e in said] == [10]  # step 9 was this attempt's first save
    assert "in 3 steps since its resume at step 6" in said[0]["why"]
    assert "the checkpoint due at step 9 was not saved" in said[0]["why"]


def test_a_framework_that_saves_its_own_checkpoints_is_told_nothing(
        tmp_path: Path, intake: Intake, monkeypatch: pytest.MonkeyPatch) -> None:
    Directive(checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=2).write(
        tmp_path / "directive.json")
    monkeypatch.setenv(protocol.ENV_DIRECTIVE, str(tmp_path / "directive.json"))
    run = attach()
    run.framework_loop()
    for _ in range(3):
        run.step(loss=1.0)
    run.close()
    assert run.cursor == 0  # the framework counts it
    assert not [m for m in intake.drain()
                if isinstance(m, protocol.WorkerEvent) and m.type == "checkpoints_off"]
