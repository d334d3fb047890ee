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
- just-in-time state (``checkpoints.just_in_time``): once ``train()`` built its optimizer and
  scheduler (``on_train_begin``), each rank keeps its last completed step, marked at the
  optimizer step's boundary (``on_step_end``, after the optimizer's and the scheduler's step;
  marked again as the next step draws its batch, after that step's logging, evaluation and
  save). After a hang or a crash the live ranks write it as the Trainer's own checkpoint folder
  (``hf_state``), and the relaunch resumes from it through ``resume_from_checkpoint``, like
  from any of the Trainer's checkpoints: the fault costs the step it interrupted.

What the Trainer's own features mean for it:

- gradient accumulation: the step is the optimizer step; a fault between micro-batches keeps
  the step before, and the resumed run draws that step's micro-batches again (the Trainer
  skips ``global_step x gradient_accumulation_steps`` batches of the epoch).
- fp16 mixed precision: the grad scaler's state is written (``scaler.pt``), and read back by
  the Trainer. bf16 has no scaler. The keeper watches the torch optimizer inside accelerate's:
  a step whose update the scaler skipped (an overflow) is no optimizer step to it, though the
  scale moved; a fault in that instant, before the step's end, keeps the lowered scale.
- DeepSpeed, FSDP, a model sharded by transformers at load time (tensor parallel), SageMaker
  model parallelism, XLA: their state dicts are gathered with collectives, which a rank whose
  peer died cannot join. Such a run keeps the periodic path, and the journal says why
  (``just_in_time_off``).
- data position: the Trainer's own (it skips the batches of the epoch its global step has
  consumed), the same as from its periodic checkpoints; babysit's data cursor goes on from the
  mark's, so a rollback's skips stay where they were.

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
from babysit.supervisor.rank.integrations import hf_state


class BabysitTrainerCallback(TrainerCallback):  # type: ignore[misc]
    """The callback ``hf_train`` installs; see the module docstring. ``install`` also wraps
    the Trainer's batch drawing (skips) and its evaluation and save (phases)."""

    def __init__(self, run: Run | None = None) -> None:
        self.run = run if run is not None else attach(keep_later=True)
        self.run.framework_loop()  # the framework counts the cursor and saves its checkpoints
        self._tokens_seen = 0
        self._last_logged = 0
        self._aligned = False
        self._trainer: Trainer | None = None
        """The Trainer ``install`` hooked: its state is what the keeper writes."""
        self._writer: hf_state.TrainerStateWriter | None = None
        self._keeper: Any = None
        """The keeper of the last completed step, from ``on_train_begin`` (``Run.keep``)."""

    def install(self, trainer: Trainer) -> BabysitTrainerCallback:
        self._trainer = trainer
        trainer.add_callback(self)
        trainer.get_batch_samples = self._skipping(trainer, trainer.get_batch_samples)
        for name, phase in (("evaluate", "eval"), ("_save_checkpoint", "checkpoint")):
            setattr(trainer, name, self._in_phase(phase, getattr(trainer, name)))
        trainer._load_rng_state = self._streams(trainer, trainer._load_rng_state)
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
            # The step's logging, evaluation and save are done and its batch not drawn: the
            # random streams here are those the next step starts from.
            self._mark(trainer.state.global_step)
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

    def _streams(self, trainer: Trainer, load: Callable[[Any], None]) -> Callable[[Any], None]:
        """The Trainer's load of a process's random streams, then, in a just-in-time checkpoint
        that has no file of this process's (its node did not write it), from its mark."""

        @functools.wraps(load)
        def _load_rng_state(checkpoint: Any) -> None:
            load(checkpoint)
            if checkpoint is not None:
                hf_state.restore_from_mark(str(checkpoint), trainer.args.world_size,
                                           trainer.args.process_index)
        return _load_rng_state

    def _mark(self, step: int) -> None:
        """The step boundary after optimizer step ``step``: what the keeper writes is of it."""
        if self._keeper is not None and self._writer is not None:
            self._writer.at_mark()
            self._keeper.mark(step, self.run.cursor, None, self.run.lr_scale)

    # -- callback events --------------------------------------------------------------------------

    def on_train_begin(self, args: TrainingArguments, state: TrainerState,
                       control: TrainerControl, optimizer: Any = None, **kwargs: Any) -> None:
        inner = getattr(optimizer, "optimizer", optimizer)
        if optimizer is not None:  # accelerate wraps the torch optimizer, which has the hooks
            self.run.scale_lr(inner)
        self._tokens_seen = int(getattr(state, "num_input_tokens_seen", 0) or 0)
        self._last_logged = state.global_step
        trainer = self._trainer
        if trainer is None:  # added with add_callback() alone: the Trainer's state is unseen
            self.run.keep(None, why_not="the callback was added without install() (use "
                                        "hf_train): it cannot see the Trainer's state")
        elif self._keeper is None:
            self._writer = hf_state.TrainerStateWriter(trainer)
            self._writer.at_mark()
            self.run.step_count = state.global_step
            self._keeper = self.run.keep(kwargs.get("model"), inner,
                                         kwargs.get("lr_scheduler"), writer=self._writer,
                                         why_not=hf_state.keeps_not(trainer))

    def on_step_end(self, args: TrainingArguments, state: TrainerState,
                    control: TrainerControl, **kwargs: Any) -> None:
        self._mark(state.global_step)  # after the optimizer's and the scheduler's step
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
