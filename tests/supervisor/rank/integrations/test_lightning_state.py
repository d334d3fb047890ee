"""Lightning's own checkpoint as just-in-time state (``rank/integrations/lightning_state.py``), in
one process with the real Trainer: written by a real keeper from its own thread while the next
step runs, committed, and resumed through ``fit(ckpt_path=...)``, which goes on exactly as the
fit that was never stopped. The same against a real fault in a torchrun job is
``tests/e2e/test_integrations.py``'s."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch", reason="needs the lightning extra")

from babysit.checkpoints import just_in_time, read_manifest, verify_manifest  # noqa: E402
from babysit.checkpoints.manifest import FileEntry  # noqa: E402
from babysit.supervisor.contract import keeper as contract  # noqa: E402
from babysit.supervisor.rank.integrations import lightning_state  # noqa: E402
from babysit.supervisor.rank.keeper import Keeper  # noqa: E402

TOKEN = "ef" * 16


class Batches:
    """Batches 0, 1, 2, ... of a pure function of their index; resumable (``state_dict``)."""

    def __init__(self) -> None:
        self.next = 0

    def __len__(self) -> int:
        return 32

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while self.next < 32:
            g = torch.Generator().manual_seed(self.next)
            self.next += 1
            x = torch.randn(4, 8, generator=g)
            yield x, x.sum(dim=1, keepdim=True)
        self.next = 0

    def state_dict(self) -> dict[str, int]:
        return {"next": self.next}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.next = state["next"]


class Net(pl.LightningModule):  # type: ignore[misc]
    """SGD with momentum and a step-interval StepLR: every part of the state moves. No
    dropout: Lightning's checkpoints keep no random streams, its own or babysit's."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                       torch.nn.Linear(16, 1))
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        return {"optimizer": opt, "lr_scheduler": {
            "scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
            "interval": "step"}}

    def train_dataloader(self) -> Batches:
        return Batches()


def fit(steps: int, seed: int, *callbacks: Any, ckpt_path: str | None = None) -> Net:
    torch.manual_seed(seed)
    model = Net()
    trainer = pl.Trainer(accelerator="cpu", max_steps=steps, max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=list(callbacks))
    trainer.fit(model, ckpt_path=ckpt_path)
    return model


def states(trainer: Any, module: Any) -> dict[str, Any]:
    return copy.deepcopy({"model": module.state_dict(),
                          "optimizer": trainer.optimizers[0].state_dict(),
                          "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
                          "global_step": trainer.global_step})


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


class KeptAt(pl.Callback):  # type: ignore[misc]
    """A real keeper with Lightning's writer, marked at every optimizer step's end, told of
    each update's start as the integration tells it (``UpdateHooks``); in the backward of the
    step after ``step``, inside ``optimizer.step(closure)`` (where a rank whose peer died is
    stuck: the loader and the loop's counters have moved on), its node asks it, over its
    socket, to write: its own thread writes while this one waits."""

    def __init__(self, root: Path, step: int) -> None:
        self.root, self.step = root, step
        self.keeper: Keeper | None = None
        self.writer: lightning_state.LightningStateWriter | None = None
        self.answer: dict[str, Any] = {}
        self.written: dict[str, Any] = {}
        self.after: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_start(self, trainer: Any, module: Any) -> None:
        self.writer = lightning_state.LightningStateWriter(trainer)
        self.updates = lightning_state.UpdateHooks(trainer.optimizers[0])
        self.keeper = Keeper(rank=0, attempt=1, token_hex=TOKEN, marks=self.root / "marks",
                             hold_s=5.0, model=module, optimizer=self.updates,
                             scheduler=trainer.lr_scheduler_configs[0].scheduler,
                             emit=lambda *a, **k: None, writer=self.writer)
        self.keeper.start()

    def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
        assert self.keeper is not None and self.writer is not None
        self.writer.at_mark()
        self.keeper.mark(trainer.global_step, trainer.global_step, None, 1.0)
        self.after[trainer.global_step] = copy.deepcopy(module.state_dict())

    def on_before_optimizer_step(self, *args: Any) -> None:
        self.updates.updating()

    def on_before_backward(self, trainer: Any, module: Any, loss: Any) -> None:
        if trainer.global_step == self.step:
            self.written = states(trainer, module)
            self.answer = contract.ask(
                contract.address(TOKEN, 1, 0), TOKEN, contract.WRITE,
                {"dir": str(just_in_time.staging_dir(self.root, self.step)),
                 "step": self.step, "model": True}, timeout=60)

    def on_train_end(self, *args: Any) -> None:
        assert self.keeper is not None
        self.keeper.close()


class Loaded(pl.Callback):  # type: ignore[misc]
    """What a resumed fit holds when its training starts."""

    def __init__(self) -> None:
        self.states: dict[str, Any] = {}

    def on_train_start(self, trainer: Any, module: Any) -> None:
        self.states = states(trainer, module)


@pytest.fixture(scope="module")
def kept(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[KeptAt, Path, Net]]:
    """An uninterrupted fit of 7 steps whose keeper wrote the state of step 3, committed."""
    tmp = tmp_path_factory.mktemp("lightning")
    run = KeptAt(tmp / "ckpt", 3)
    model = fit(7, 0, run)
    assert run.answer.get("ok"), run.answer
    files = [FileEntry(**f) for f in run.answer["files"]]
    path = just_in_time.commit(tmp / "ckpt", just_in_time.Plan(3, 3, None, 1.0, (0,)), files,
                               world_size=1, fault="hang",
                               form=just_in_time.Format.from_json(run.answer["format"]))
    yield run, path, model


def test_its_ckpt_is_lightnings_checkpoint_committed_as_an_external_one(
        kept: tuple[KeptAt, Path, Net]) -> None:
    run, path, _ = kept
    manifest = read_manifest(path)
    assert run.answer["format"] == {"name": "lightning", "resume": "step-3.ckpt"}
    assert manifest.kind == "external" and manifest.is_just_in_time
    assert manifest.external_path == str(path.absolute() / "step-3.ckpt")
    assert manifest.external_is_file and [f.name for f in manifest.files] == ["step-3.ckpt"]
    assert verify_manifest(manifest, path, full=True) == []


def test_a_fit_resumed_from_it_holds_the_written_state_and_goes_on_as_if_never_stopped(
        kept: tuple[KeptAt, Path, Net]) -> None:
    run, path, uninterrupted = kept
    loaded = Loaded()
    resumed = fit(7, 1, loaded, ckpt_path=read_manifest(path).external_path)

    for part in ("model", "optimizer", "scheduler", "global_step"):
        assert same(loaded.states[part], run.written[part]), part
    # Steps 4 to 7 drew the same batches (the loader's position is the mark's, not the one the
    # interrupted step had moved it to) with the same schedule: the same losses, the same weights.
    assert resumed.losses == uninterrupted.losses[3:]
    assert same(resumed.state_dict(), run.after[7])


class Manual(Net):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        opt = self.optimizers()
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return loss


def test_a_loop_that_steps_where_babysit_does_not_look_is_kept_by_the_periodic_path() -> None:
    said: list[str | None] = []

    class Ask(pl.Callback):  # type: ignore[misc]
        def on_train_start(self, trainer: Any, module: Any) -> None:
            said.append(lightning_state.keeps_not(trainer))

    for module in (Net(), Manual()):
        pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False,
                   callbacks=[Ask()]).fit(module)
    assert said[0] is None
    assert said[1] is not None and said[1].startswith("manual optimization steps its optimizers")


def test_the_keeper_sees_an_update_from_its_start_after_the_closure_to_its_end(
        tmp_path: Path) -> None:
    """Through ``UpdateHooks``: the closure inside ``optimizer.step(closure)`` (the forward and
    the backward) is still the step before's state; from ``on_before_optimizer_step`` the
    update is half done until the optimizer's post-hook, or until the step's end when the grad
    scaler skipped the update (no post-hook then)."""
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hooks = lightning_state.UpdateHooks(opt)
    keeper = Keeper(rank=0, attempt=2, token_hex=TOKEN, marks=tmp_path / "marks", hold_s=5.0,
                    model=model, optimizer=hooks, scheduler=None, emit=lambda *a, **k: None)
    keeper.start()
    seen: list[str | None] = []

    def closure() -> torch.Tensor:  # Lightning's: the step's forward and backward
        loss = model(torch.ones(1, 2)).sum()
        loss.backward()
        seen.append(keeper.view()["why"])
        hooks.updating()  # on_before_optimizer_step
        seen.append(keeper.view()["why"])
        return loss

    try:
        keeper.mark(1, 1, None, 1.0)
        opt.step(closure)
        hooks.ended()  # on_train_batch_end: the post-hook ended it already
        seen.append(keeper.view()["why"])
        keeper.mark(2, 2, None, 1.0)
        hooks.updating()  # the scaler skips this one: no optimizer.step() at all
        hooks.ended()
        seen.append(keeper.view()["why"])
        keeper.mark(3, 3, None, 1.0)
        seen.append(keeper.view()["why"])
    finally:
        keeper.close()
    assert seen == [None, "inside optimizer.step(): its update is half done",
                    "optimizer.step() ran since the step started",
                    "optimizer.step() ran since the step started", None]
