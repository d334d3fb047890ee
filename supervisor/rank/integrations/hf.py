"""Hugging Face ``Trainer`` under babysit: ``hf_train(trainer)`` in place of ``trainer.train()``.

Everything goes through the Trainer's own machinery:

- telemetry: each dict the Trainer logs (``loss``, ``grad_norm``, ``learning_rate``, and tokens
  when ``include_num_input_tokens_seen`` is on) is a report at the Trainer's global step, on
  every rank; set ``logging_steps`` to how often babysit should judge (1 for every step).
- checkpoints babysit chooses: every ``checkpoints.every_steps`` steps of babysit's config the
  callback sets ``control.should_save``; the Trainer saves ``output_dir/checkpoint-N`` its own
  way, and every save (the Trainer's own ``save_steps`` too) is registered with babysit's
  catalog. A relaunch resumes through ``resume_from_checkpoint`` from the one babysit chose.
- skipping: a rollback's bad ranges are drawn and discarded in ``get_batch_samples``, before any
  forward pass. babysit's data cursor counts optimizer steps' worth of batches here.
- the LR scale a rollback sets: step hooks on the Trainer's optimizer (its scheduler never sees
  it).
- phases: evaluation and checkpoint saves are declared, so the hang detector allows for them.

Calling rules: one ``hf_train`` per process, with the Trainer fully built; under plain torchrun
it just trains. Needs ``pip install 'babysit[hf]'``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from typing import Any

from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from babysit.supervisor.rank.api import Run, attach


class BabysitTrainerCallback(TrainerCallback):  # type: ignore[misc]
    """The callback ``hf_train`` installs; see the module docstring. ``install`` also wraps
    the Trainer's batch drawing (skips) and its evaluation and save (phases)."""

    def __init__(self, run: Run | None = None) -> None:
        self.run = run if run is not None else attach()
        self.run.framework_loop()  # the framework counts the cursor and saves its checkpoints
        self._tokens_seen = 0
        self._last_logged = 0
        self._aligned = False

    def install(self, trainer: Trainer) -> BabysitTrainerCallback:
        trainer.add_callback(self)
        trainer.get_batch_samples = self._skipping(trainer, trainer.get_batch_samples)
        for name, phase in (("evaluate", "eval"), ("_save_checkpoint", "checkpoint")):
            setattr(trainer, name, self._in_phase(phase, getattr(trainer, name)))
        return self

    # -- wrapped Trainer methods ------------------------------------------------------------------

    def _in_phase(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with self.run.phase(name):
                return method(*args, **kwargs)
        return wrapped

    def _skipping(self, trainer: Trainer,
                  draw: Callable[[Iterator[Any], int, Any], Any]) -> Callable[..., Any]:
        run = self.run

        @functools.wraps(draw)
        def get_batch_samples(epoch_iterator: Iterator[Any], num_batches: int,
                              device: Any) -> Any:
            if not self._aligned:
                # The Trainer resumed its data at its global step; babysit's cursor also counts
                # what earlier rollbacks skipped.
                self._aligned = True
                for _ in range(max(0, run.cursor - trainer.state.global_step)):
                    draw(epoch_iterator, num_batches, device)
            while (skip := run.skip_at(run.cursor)) is not None:
                for _ in range(skip.end - run.cursor):
                    draw(epoch_iterator, num_batches, device)
                run.cursor = skip.end
            run.cursor += 1
            return draw(epoch_iterator, num_batches, device)
        return get_batch_samples

    # -- callback events --------------------------------------------------------------------------

    def on_train_begin(self, args: TrainingArguments, state: TrainerState,
                       control: TrainerControl, optimizer: Any = None, **kwargs: Any) -> None:
        if optimizer is not None:  # accelerate wraps the torch optimizer, which has the hooks
            self.run.scale_lr(getattr(optimizer, "optimizer", optimizer))
        self._tokens_seen = int(getattr(state, "num_input_tokens_seen", 0) or 0)
        self._last_logged = state.global_step

    def on_step_end(self, args: TrainingArguments, state: TrainerState,
                    control: TrainerControl, **kwargs: Any) -> None:
        every = self.run.directive.checkpoint_every
        if every and state.global_step % every == 0:
            control.should_save = True

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if not logs or "loss" not in logs or state.global_step <= self._last_logged:
            return
        tokens = None
        seen = int(getattr(state, "num_input_tokens_seen", 0) or 0)
        if seen > self._tokens_seen:  # every rank's tokens since the last report: this rank's
            tokens = (seen - self._tokens_seen) / max(1, args.world_size)
            self._tokens_seen = seen
        self._last_logged = state.global_step
        self.run.step_count = state.global_step - 1  # step() counts the report as one step
        self.run.step(loss=logs["loss"], grad_norm=logs.get("grad_norm"),
                      lr=logs.get("learning_rate"), tokens=tokens)

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                **kwargs: Any) -> None:
        self.run.step_count = state.global_step
        path = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        self.run.checkpoint_saved(path)

    def on_train_end(self, args: TrainingArguments, state: TrainerState,
                     control: TrainerControl, **kwargs: Any) -> None:
        self.run.close()


def hf_train(trainer: Trainer, **kwargs: Any) -> Any:
    """``trainer.train(**kwargs)`` under babysit: resumes from the checkpoint babysit chose on a
    relaunch (``resume_from_checkpoint``), reports, saves, skips and scales as the module
    docstring says. Returns what ``train`` returns."""
    callback = BabysitTrainerCallback().install(trainer)
    resume = callback.run.resume
    if resume is not None and "resume_from_checkpoint" not in kwargs:
        kwargs["resume_from_checkpoint"] = resume.path
    return trainer.train(**kwargs)
