"""Lightning under babysit: ``lightning_fit(trainer, model, ...)`` in place of
``trainer.fit(model, ...)``.

Everything goes through Lightning's own machinery:

- telemetry: after each optimizer step, the step's loss (what ``training_step`` returned), the
  gradient norm (measured in ``on_before_optimizer_step``) and the first optimizer's LR, at
  ``trainer.global_step``, on every rank.
- checkpoints babysit chooses: every ``checkpoints.every_steps`` steps of babysit's config the
  callback calls ``trainer.save_checkpoint`` (a ``.ckpt`` under ``default_root_dir/babysit``)
  and registers it with babysit's catalog; a relaunch resumes through ``fit(ckpt_path=...)``
  from the one babysit chose.
- skipping: babysit's data cursor counts training batches; a batch in a rollback's bad range
  never reaches ``training_step``. Lightning refuses a skipped ``training_step`` under DDP, so
  the wrapper returns a zero loss that touches every parameter (every rank's all-reduce still
  matches) and the gradients are dropped before the optimizer step, which then leaves every
  parameter and its optimizer state alone. Such a batch is not reported.
- the LR scale a rollback sets: step hooks on every optimizer (schedulers never see it).
- phases: validation and checkpoint saves are declared, so the hang detector allows for them.

- just-in-time state (``checkpoints.just_in_time``): once ``fit`` set up its optimizer and
  schedulers (``on_train_start``), each rank keeps its last completed step, marked at the
  optimizer step's boundary: ``on_train_batch_end`` of a batch that stepped, which Lightning
  calls after the optimizer's step and after the step-interval schedulers' step. After a hang
  or a crash the live ranks write it as Lightning's own ``.ckpt`` (``lightning_state``), and
  the relaunch resumes from it through ``fit(ckpt_path=...)``: the fault costs the step it
  interrupted.

What Lightning's own features mean for it:

- gradient accumulation (``accumulate_grad_batches``): the step is the optimizer step; a fault
  between micro-batches keeps the step before, and the resumed fit draws its micro-batches
  again.
- mixed precision: the precision plugin's state (fp16's grad scaler) is in the checkpoint, as
  in any of Lightning's; bf16 has none.
- DeepSpeed, FSDP, ModelParallel and XLA strategies, a ``ZeroRedundancyOptimizer``: their
  state dicts are gathered with collectives, which a rank whose peer died cannot join; manual
  optimization steps where babysit does not look. Such a run keeps the periodic path, and the
  journal says why (``just_in_time_off``).
- data position on resume is Lightning's business, from periodic and just-in-time checkpoints
  alike: exact when the train dataloader is resumable (``state_dict``/``load_state_dict``) or a
  checkpoint ends an epoch; Lightning warns otherwise.
- random streams: Lightning's checkpoints keep none, so a resumed rank draws on from its own.

Calling rules: one ``lightning_fit`` per process, automatic optimization. Under plain torchrun it
just fits. Needs ``pip install 'babysit[lightning]'``.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from babysit.supervisor.rank.api import Run, attach
from babysit.supervisor.rank.integrations import lightning_state


class BabysitLightningCallback(Callback):  # type: ignore[misc]
    """The callback ``lightning_fit`` installs; see the module docstring."""

    def __init__(self, run: Run | None = None) -> None:
        self.run = run if run is not None else attach(keep_later=True)
        self.run.framework_loop()  # the framework counts the cursor and saves its checkpoints
        self._skip_end: int | None = None
        self._skipped = False
        """The current batch was skipped: drop its gradients, report nothing."""
        self._grad_norm: float | None = None
        self._reported = -1
        self._saved = -1
        self._phase: contextlib.ExitStack | None = None
        self._writer: lightning_state.LightningStateWriter | None = None
        self._keeper: Any = None
        """The keeper of the last completed step, from ``on_train_start`` (``Run.keep``)."""
        self._marked = -1
        self._updates: lightning_state.UpdateHooks | None = None

    def wrap(self, module: LightningModule) -> None:
        """Count the data cursor and skip bad ranges in ``module.training_step``."""
        step = module.training_step
        run = self.run

        @functools.wraps(step)
        def training_step(*args: Any, **kwargs: Any) -> Any:
            cursor = run.cursor
            run.cursor += 1
            if self._skip_end is None or cursor >= self._skip_end:
                skip = run.skip_at(cursor)
                self._skip_end = skip.end if skip is not None else None
            self._skipped = self._skip_end is not None and cursor < self._skip_end
            if self._skipped:
                return sum((p.sum() * 0.0 for p in module.parameters() if p.requires_grad),
                           torch.zeros(()))
            return step(*args, **kwargs)

        module.training_step = training_step

    # -- callback hooks -------------------------------------------------------------------------

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        for optimizer in trainer.optimizers:
            self.run.scale_lr(optimizer)
        self._reported = self._saved = self._marked = trainer.global_step
        if self._keeper is None:
            self._writer = lightning_state.LightningStateWriter(trainer)
            self._writer.at_mark()
            self.run.step_count = trainer.global_step
            schedulers = trainer.lr_scheduler_configs
            if trainer.optimizers:
                self._updates = lightning_state.UpdateHooks(trainer.optimizers[0])
            self._keeper = self.run.keep(
                pl_module, self._updates, schedulers[0].scheduler if schedulers else None,
                writer=self._writer, why_not=lightning_state.keeps_not(trainer))

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule,
                                 optimizer: Any) -> None:
        if self._updates is not None:  # the closure (forward, backward) is done: the update
            self._updates.updating()
        if self._skipped:  # torch optimizers leave parameters without a gradient untouched
            for p in pl_module.parameters():
                p.grad = None
            return
        grads = [p.grad.detach() for p in pl_module.parameters() if p.grad is not None]
        self._grad_norm = (float(torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g) for g in grads]))) if grads else None)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if self._updates is not None:
            self._updates.ended()
        if step != self._marked and self._keeper is not None and self._writer is not None:
            # The optimizer and the step-interval schedulers have stepped (Lightning's order).
            self._marked = step
            self._writer.at_mark()
            self._keeper.mark(step, self.run.cursor, None, self.run.lr_scale)
        if self._skipped:
            self._skipped, self._reported = False, step
        if step == self._reported:  # skipped, or accumulating gradients
            return
        self._reported = step
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        value = float(loss.detach()) if isinstance(loss, torch.Tensor) else None
        lr = trainer.optimizers[0].param_groups[0]["lr"] if trainer.optimizers else None
        self.run.step_count = step - 1  # step() counts the report as one step
        self.run.step(loss=value, grad_norm=self._grad_norm, lr=lr)
        every = self.run.directive.checkpoint_every
        if every and step % every == 0 and step != self._saved:
            self._save(trainer, step)

    def _save(self, trainer: Trainer, step: int) -> None:
        self._saved = step
        path = os.path.join(trainer.default_root_dir, "babysit", f"step-{step}.ckpt")
        with self.run.phase("checkpoint"):
            trainer.save_checkpoint(path)
        self.run.checkpoint_saved(path)

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking:
            self._phase = contextlib.ExitStack()
            self._phase.enter_context(self.run.phase("eval"))

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._phase is not None:
            self._phase.close()
            self._phase = None

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.run.close()


def lightning_fit(trainer: Trainer, model: LightningModule, **kwargs: Any) -> None:
    """``trainer.fit(model, **kwargs)`` under babysit: resumes from the checkpoint babysit chose
    on a relaunch (``ckpt_path``), reports, saves, skips and scales as the module docstring
    says."""
    callback = BabysitLightningCallback()
    callback.wrap(model)
    trainer.callbacks.append(callback)
    resume = callback.run.resume
    if resume is not None and "ckpt_path" not in kwargs:
        kwargs["ckpt_path"] = resume.path
    trainer.fit(model, **kwargs)
