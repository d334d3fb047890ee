"""The Trainer's own checkpoint as babysit's just-in-time state: a ``checkpoint-N`` folder's
files, written by a rank's keeper (``rank/keeper.py``) from its own thread, without any
collective, which ``trainer.train(resume_from_checkpoint=...)`` resumes from like any of the
Trainer's own checkpoints.

What ``Trainer._save_checkpoint`` writes, and what its resume reads (``_load_from_checkpoint``,
``_load_optimizer_and_scheduler``, ``_load_scaler``, ``_load_rng_state``, ``TrainerState``):

- the weights as ``save_pretrained`` writes them (``model.safetensors`` and ``config.json``, or
  a plain module's state dict), the processing class and ``training_args.bin``;
- ``optimizer.pt``, ``scheduler.pt``, and ``scaler.pt`` under fp16 mixed precision;
- ``trainer_state.json`` as it stood at the mark (``TrainerStateWriter.at_mark``: the global
  step, epoch and tokens seen move again inside the next step);
- ``rng_state_<process>.pth`` (``rng_state.pth`` for one process) for every rank whose mark
  file this node holds: the writer's own streams and each other rank's, dead or alive, as the
  step started (``checkpoints.mark``), in the Trainer's layout. A rank on another node of a
  multi-node job has its mark beside them (``mark_<r>.bin``, copied by its node), which the
  integration restores where the Trainer finds no file of its own (``restore_from_mark``).

``save_pretrained`` writes on global rank 0 only; a writer of another rank (rank 0 died) has it
write all the same, its single-process path, which gathers nothing.

Where it cannot keep the step (``keeps_not``): DeepSpeed and FSDP (their state dicts gather
across ranks), a model sharded by transformers at load time (tensor parallel), SageMaker model
parallelism and XLA: those runs keep the periodic path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import warnings
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, Trainer
from transformers.trainer_callback import ExportableState
from transformers.training_args import ParallelMode
from transformers.utils import is_sagemaker_mp_enabled, is_torch_xla_available

from babysit.checkpoints.just_in_time import Format
from babysit.checkpoints.manifest import hash_file
from babysit.checkpoints.mark import MarkError
from babysit.checkpoints.mark import read as read_mark

FORMAT = Format("transformers", ".")
"""The folder itself is what ``resume_from_checkpoint`` takes."""
OPTIMIZER, SCHEDULER, SCALER = "optimizer.pt", "scheduler.pt", "scaler.pt"
TRAINER_STATE, TRAINING_ARGS = "trainer_state.json", "training_args.bin"


def keeps_not(trainer: Trainer) -> str | None:
    """Why this Trainer's state cannot be written without a collective, or None."""
    if trainer.is_deepspeed_enabled:
        return ("DeepSpeed's state dicts gather across ranks (collectives): the Trainer's "
                "periodic checkpoints are kept")
    if trainer.is_fsdp_enabled or getattr(trainer, "is_fsdp_xla_enabled", False):
        return ("FSDP's state dicts gather across ranks (collectives): the Trainer's periodic "
                "checkpoints are kept")
    if getattr(trainer, "is_distributed_loading_by_transformers", False):
        return ("the model was sharded by transformers at load time (tensor parallel): its "
                "weights gather across ranks to be saved")
    if is_sagemaker_mp_enabled() or is_torch_xla_available():
        return "SageMaker model parallelism and XLA save through collectives"
    return None


def rng_name(world_size: int, rank: int) -> str:
    """The Trainer's file of a process's random streams."""
    return "rng_state.pth" if world_size <= 1 else f"rng_state_{rank}.pth"


def trainer_rng(rng: dict[str, Any], distributed: bool) -> dict[str, Any]:
    """A rank's streams as babysit keeps them (``checkpoints.rng``, ``Mark.rng``) in the
    layout of ``Trainer._save_rng_state``. Raises ``ValueError`` when Python's or numpy's
    stream is missing, which the Trainer's resume cannot do without."""
    if rng.get("python") is None or rng.get("numpy") is None:
        raise ValueError("a mark without Python's or numpy's random stream")
    state = {"python": rng["python"], "numpy": rng["numpy"], "cpu": rng["torch"]}
    cuda = rng.get("cuda")
    if cuda:  # every device's under DDP, the current one's in a single process
        state["cuda"] = list(cuda) if distributed else cuda[torch.cuda.current_device()]
    return state


class TrainerStateWriter:
    """The ``PartWriter`` of a Trainer's loop (``rank.just_in_time``). ``at_mark`` at each
    step boundary, on the training thread, just before the keeper's own mark; the keeper calls
    the writer itself from its thread."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self._at: dict[str, Any] | None = None

    def at_mark(self) -> None:
        """The step boundary: keep what of ``trainer.state`` the next step moves before its
        optimizer step (its tokens seen; the global step and epoch after it)."""
        state = self.trainer.state
        self._at = {"global_step": state.global_step, "epoch": state.epoch,
                    "num_input_tokens_seen": state.num_input_tokens_seen}

    def __call__(self, dest: Path, rank: int, *, rng: dict[str, Any], marks: Path, step: int,
                 with_model: bool) -> tuple[list[dict[str, Any]], Format]:
        at = self._at
        if at is None or at["global_step"] != step:
            raise RuntimeError(f"the Trainer's state was not marked at step {step} "
                               f"({at and at['global_step']})")
        trainer = self.trainer
        dest.mkdir(parents=True, exist_ok=True)
        names: list[str] = []
        if with_model:
            names += _weights(trainer, dest, rank)
            _save(trainer.optimizer.state_dict(), dest, OPTIMIZER, names)
            _save(trainer.lr_scheduler.state_dict(), dest, SCHEDULER, names)
            scaler = getattr(trainer.accelerator, "scaler", None)
            if scaler is not None:
                _save(scaler.state_dict(), dest, SCALER, names)
            _write(dest, TRAINER_STATE, _state_json(trainer, at, step).encode(), names)
        world = trainer.args.world_size
        distributed = trainer.args.parallel_mode == ParallelMode.DISTRIBUTED
        streams = {rank: rng} | ({} if world <= 1 else _others(marks, world, rank, step))
        for r, its in sorted(streams.items()):
            _save(trainer_rng(its, distributed), dest, rng_name(world, r), names)
        return [asdict(hash_file(dest, n)) for n in names], FORMAT


def restore_from_mark(checkpoint: str, world_size: int, rank: int) -> bool:
    """Restore this rank's streams from its mark beside a just-in-time checkpoint that has no
    Trainer file of them (its node was not the writer's); True when it did."""
    from babysit.checkpoints.just_in_time import mark_name
    from babysit.checkpoints.rng import restore_rng

    folder = Path(checkpoint)
    mark = folder / mark_name(rank)
    if (folder / rng_name(world_size, rank)).exists() or not mark.is_file():
        return False
    try:
        streams = read_mark(mark).rng()
    except MarkError:  # hashed at the commit: only a file damaged since; fresh streams then
        return False
    restore_rng(streams)
    return True


def _others(marks: Path, world: int, rank: int, step: int) -> dict[int, dict[str, Any]]:
    """Every other rank's streams as its step started, from its mark on this node (the dead
    ones' too); a rank whose mark is elsewhere, torn or of another step has none here."""
    out = {}
    for r in range(world):
        if r == rank:
            continue
        try:
            mark = read_mark(marks / str(r))
        except MarkError:
            continue
        if mark.step == step:
            out[r] = mark.rng()
    return out


def _weights(trainer: Trainer, dest: Path, rank: int) -> list[str]:
    """The model as ``Trainer._save`` writes it (weights, config, processing class, training
    arguments), moved into ``dest`` from a folder of this writer's own (so that the files
    listed are exactly its, whatever a node copies into ``dest`` meanwhile)."""
    own = dest / f".transformers-{rank}"
    shutil.rmtree(own, ignore_errors=True)
    own.mkdir()
    model = trainer.model
    unwrapped = trainer.accelerator.unwrap_model(model, keep_torch_compile=False)
    state_dict = None if isinstance(model, PreTrainedModel) else model.state_dict()
    if isinstance(unwrapped, PreTrainedModel) or hasattr(unwrapped, "save_pretrained"):
        with _on_any_rank(unwrapped):
            unwrapped.save_pretrained(own, state_dict=state_dict, is_main_process=True)
    else:
        import safetensors.torch

        safetensors.torch.save_file(state_dict or model.state_dict(), own / "model.safetensors",
                                    metadata={"format": "pt"})
    if trainer.processing_class is not None:
        trainer.processing_class.save_pretrained(own)
    torch.save(trainer.args, own / TRAINING_ARGS)
    names = []
    for path in sorted(own.iterdir()):
        os.replace(path, dest / path.name)
        names.append(path.name)
    own.rmdir()
    return names


@contextlib.contextmanager
def _on_any_rank(model: Any) -> Iterator[None]:
    """``save_pretrained`` writes only where ``should_save_on_this_rank`` says so: global rank
    0. Any writer writes here (no collective is involved without a distributed config, which
    ``keeps_not`` refuses), so the instance answers yes while it saves."""
    model.should_save_on_this_rank = lambda is_main_process: True
    try:
        yield
    finally:
        del model.should_save_on_this_rank


def _state_json(trainer: Trainer, at: dict[str, Any], step: int) -> str:
    """``trainer_state.json`` of the marked step, as ``_save_checkpoint`` writes it: the
    state's fields (those the next step moves as they were at the mark, its log entries up to
    the step) and the state of every callback that exports one (``ExportableState``)."""
    data = dataclasses.asdict(trainer.state)
    data.update(at)
    data["log_history"] = [e for e in data["log_history"] if e.get("step", 0) <= step]
    states: dict[str, Any] = {}
    for callback in [*trainer.callback_handler.callbacks, trainer.control]:
        if isinstance(callback, ExportableState):
            name = type(callback).__name__
            if name in states:  # several of one kind: a list, as TrainerState builds it
                states[name] = [*(states[name] if isinstance(states[name], list)
                                  else [states[name]]), callback.state()]
            else:
                states[name] = callback.state()
    data["stateful_callbacks"] = states
    return json.dumps(data, indent=2, sort_keys=True) + "\n"


def _save(obj: Any, dest: Path, name: str, names: list[str]) -> None:
    with warnings.catch_warnings():  # the scheduler's "save the optimizer too" reminder
        warnings.simplefilter("ignore")
        torch.save(obj, dest / f".{name}.tmp")
    os.replace(dest / f".{name}.tmp", dest / name)
    names.append(name)


def _write(dest: Path, name: str, data: bytes, names: list[str]) -> None:
    (dest / f".{name}.tmp").write_bytes(data)
    os.replace(dest / f".{name}.tmp", dest / name)
    names.append(name)
