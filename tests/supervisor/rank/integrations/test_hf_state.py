"""The Trainer's own checkpoint as just-in-time state (``rank/integrations/hf_state.py``), in one
process with the real Trainer: written by a real keeper from its own thread mid-training,
committed, and resumed through ``train(resume_from_checkpoint=...)``, which goes on exactly as
the run that was never stopped. The same against a real fault in a torchrun job is
``tests/e2e/test_integrations.py``'s."""

from __future__ import annotations

import copy
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs the hf extra")

from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from babysit.checkpoints import just_in_time, mark, read_manifest, verify_manifest  # noqa: E402
from babysit.checkpoints.manifest import FileEntry  # noqa: E402
from babysit.supervisor.contract import keeper as contract  # noqa: E402
from babysit.supervisor.rank.integrations import hf_state  # noqa: E402
from babysit.supervisor.rank.keeper import Keeper  # noqa: E402

TOKEN = "cd" * 16
LENGTH, VOCAB = 16, 64


class Sequences(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = (i + 3 * torch.arange(LENGTH)) % VOCAB
        return {"input_ids": ids, "labels": ids.clone()}


def trainer(out: Path, steps: int, seed: int, *callbacks: TrainerCallback) -> Trainer:
    """A tiny GPT-2 (dropout on: a resume is exact only with the random streams back), AdamW
    and a linear schedule: every part of the state moves at every step."""
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=VOCAB,
                                       n_positions=LENGTH))
    args = TrainingArguments(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=4, learning_rate=1e-2,
        warmup_steps=2, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
        disable_tqdm=True, seed=seed, train_sampling_strategy="sequential")
    return Trainer(model=model, args=args, train_dataset=Sequences(), callbacks=list(callbacks))


def states(model: Any, optimizer: Any, scheduler: Any) -> dict[str, Any]:
    return copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                          "scheduler": scheduler.state_dict()})


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


class KeptAt(TrainerCallback):  # type: ignore[misc]
    """A real keeper with the Trainer's writer, marked at every step's end; as the step after
    ``step`` begins (where a fault would strike), its node asks it, over its socket, to write:
    its own thread writes while this one waits."""

    def __init__(self, root: Path, step: int) -> None:
        self.root, self.step = root, step
        self.keeper: Keeper | None = None
        self.writer: hf_state.TrainerStateWriter | None = None
        self.answer: dict[str, Any] = {}
        self.written: dict[str, Any] = {}
        self.after: dict[int, dict[str, torch.Tensor]] = {}

    def attach(self, t: Trainer) -> KeptAt:
        self.writer = hf_state.TrainerStateWriter(t)
        t.add_callback(self)
        return self

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                       optimizer: Any = None, lr_scheduler: Any = None, **kw: Any) -> None:
        self.keeper = Keeper(rank=0, attempt=1, token_hex=TOKEN, marks=self.root / "marks",
                             hold_s=5.0, model=model, optimizer=optimizer.optimizer,
                             scheduler=lr_scheduler, emit=lambda *a, **k: None,
                             writer=self.writer)
        self.keeper.start()

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None,
                    optimizer: Any = None, lr_scheduler: Any = None, **kw: Any) -> None:
        assert self.keeper is not None and self.writer is not None
        self.writer.at_mark()
        self.keeper.mark(state.global_step, state.global_step, None, 1.0)
        self.after[state.global_step] = copy.deepcopy(model.state_dict())

    def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                      optimizer: Any = None, lr_scheduler: Any = None, **kw: Any) -> None:
        if state.global_step == self.step:
            self.written = states(model, optimizer, lr_scheduler)
            self.answer = contract.ask(
                contract.address(TOKEN, 1, 0), TOKEN, contract.WRITE,
                {"dir": str(just_in_time.staging_dir(self.root, self.step)),
                 "step": self.step, "model": True}, timeout=60)

    def on_train_end(self, *args: Any, **kw: Any) -> None:
        assert self.keeper is not None
        self.keeper.close()


class Loaded(TrainerCallback):  # type: ignore[misc]
    """What a resumed Trainer holds when its training begins (everything loaded but the random
    streams, which it restores after drawing its first batch)."""

    def __init__(self) -> None:
        self.states: dict[str, Any] = {}
        self.global_step = -1

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                       optimizer: Any = None, lr_scheduler: Any = None, **kw: Any) -> None:
        self.states = states(model, optimizer, lr_scheduler)
        self.global_step = state.global_step


@pytest.fixture(scope="module")
def kept(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[KeptAt, Path, Trainer]]:
    """An uninterrupted run of 5 steps whose keeper wrote the state of step 3, committed."""
    tmp = tmp_path_factory.mktemp("hf")
    t = trainer(tmp / "a", 5, seed=0)
    run = KeptAt(tmp / "ckpt", 3).attach(t)
    t.train()
    assert run.answer.get("ok"), run.answer
    files = [FileEntry(**f) for f in run.answer["files"]]
    path = just_in_time.commit(tmp / "ckpt", just_in_time.Plan(3, 3, None, 1.0, (0,)), files,
                               world_size=1, fault="crash",
                               form=just_in_time.Format.from_json(run.answer["format"]))
    yield run, path, t


def test_its_folder_is_the_trainers_checkpoint_committed_as_an_external_one(
        kept: tuple[KeptAt, Path, Trainer]) -> None:
    run, path, _ = kept
    manifest = read_manifest(path)
    assert run.answer["format"] == {"name": "transformers", "resume": "."}
    assert manifest.kind == "external" and manifest.is_just_in_time
    assert manifest.external_path == str(path.absolute()) and not manifest.external_is_file
    assert manifest.just_in_time and manifest.just_in_time["format"] == "transformers"
    names = {f.name for f in manifest.files}
    assert {"model.safetensors", "config.json", "optimizer.pt", "scheduler.pt",
            "trainer_state.json", "rng_state.pth", "training_args.bin"} <= names
    assert verify_manifest(manifest, path, full=True) == []


def test_a_trainer_resumed_from_it_holds_the_written_state_and_goes_on_as_if_never_stopped(
        kept: tuple[KeptAt, Path, Trainer], tmp_path: Path) -> None:
    run, path, uninterrupted = kept
    loaded = Loaded()
    resumed = trainer(tmp_path / "b", 5, 1, loaded)  # another seed: other weights and streams
    resumed.train(resume_from_checkpoint=read_manifest(path).external_path)

    assert loaded.global_step == 3
    for part in ("model", "optimizer", "scheduler"):
        assert same(loaded.states[part], run.written[part]), part
    # Steps 4 and 5 drew the same batches and dropout masks: the weights are the same, bit for
    # bit, and so is what the Trainer logged of them.
    assert same(resumed.model.state_dict(), run.after[5])
    logged = [{k: e[k] for k in ("step", "loss", "grad_norm", "learning_rate")}
              for e in uninterrupted.state.log_history if "loss" in e]
    assert [{k: e[k] for k in ("step", "loss", "grad_norm", "learning_rate")}
            for e in resumed.state.log_history if "loss" in e] == logged


def test_a_rank_s_mark_becomes_its_stream_file_which_the_trainer_restores(
        tmp_path: Path) -> None:
    """A dead rank's streams reach the Trainer only through its mark: converted into the
    Trainer's layout, they come back exactly, Python's, numpy's and torch's."""
    random.seed(5)
    np.random.seed(6)
    torch.manual_seed(7)
    writer = mark.MarkWriter(tmp_path / "marks" / "0")
    writer.write(12, 12, None, 1.0)
    writer.close()
    want = (random.random(), np.random.rand(), torch.rand(1))
    streams = hf_state.trainer_rng(mark.read(tmp_path / "marks" / "0").rng(), distributed=False)
    torch.save(streams, tmp_path / hf_state.rng_name(1, 0))
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)

    trainer(tmp_path / "t", 1, 0)._load_rng_state(str(tmp_path))

    got = (random.random(), np.random.rand(), torch.rand(1))
    assert got[:2] == want[:2] and torch.equal(got[2], want[2])


def test_a_rank_whose_streams_another_node_kept_takes_them_from_its_mark(tmp_path: Path) -> None:
    """In a multi-node job the writer converts only the marks of its own node; another node's
    rank finds its mark copied beside the Trainer's files (``mark_<r>.bin``) and no
    ``rng_state_<r>.pth``: ``hf_train`` restores its streams from the mark instead."""
    torch.manual_seed(7)
    writer = mark.MarkWriter(tmp_path / "marks" / "1")
    writer.write(12, 12, None, 1.0)
    writer.close()
    want = torch.rand(1)
    folder = tmp_path / "step_00000012"
    folder.mkdir()
    (folder / just_in_time.mark_name(1)).write_bytes((tmp_path / "marks" / "1").read_bytes())
    torch.manual_seed(0)

    assert hf_state.restore_from_mark(str(folder), world_size=2, rank=1)
    assert torch.equal(torch.rand(1), want)
    (folder / hf_state.rng_name(2, 1)).write_bytes(b"the Trainer's own")
    assert not hf_state.restore_from_mark(str(folder), world_size=2, rank=1)
