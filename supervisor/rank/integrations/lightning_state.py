"""Lightning's own checkpoint as babysit's just-in-time state: a ``.ckpt`` written by a rank's
keeper (``rank/keeper.py``) from its own thread, without any collective, which
``trainer.fit(model, ckpt_path=...)`` resumes from like any of Lightning's own checkpoints.

It is what ``trainer.save_checkpoint`` would have written from a callback's
``on_train_batch_end`` at the marked step (after the optimizer step and the step-interval
schedulers' step, as Lightning orders them): ``_checkpoint_connector.dump_checkpoint()``
(model, optimizer and scheduler states, the precision plugin's, callbacks', hyper-parameters,
the datamodule's, and the ``on_save_checkpoint`` hooks), written by the strategy's checkpoint
IO. Not through ``trainer.save_checkpoint``, which has a barrier before and after. The fit
loop's state (its progress counters, the train loader's ``state_dict``) and the epoch and
global step are those of the mark (``LightningStateWriter.at_mark``): the next step moves them
as soon as it draws its batch, before anything could fail. Lightning keeps no random streams in
its checkpoints, and neither does this: a resumed rank draws on from its own, as after
Lightning's own resume.

Where it cannot keep the step (``keeps_not``): DeepSpeed, FSDP, ModelParallel and XLA
strategies and a sharded optimizer (``ZeroRedundancyOptimizer``) gather their state dicts with
collectives; manual optimization may step where babysit does not look. Those runs keep the
periodic path. The keeper knows an update began from ``on_before_optimizer_step``, not from the
optimizer's own pre-hook (``UpdateHooks``).
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import asdict
from pathlib import Path
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning.pytorch.strategies import (
    DDPStrategy,
    DeepSpeedStrategy,
    SingleDeviceStrategy,
    SingleDeviceXLAStrategy,
    XLAStrategy,
)

from babysit.checkpoints.just_in_time import Format
from babysit.checkpoints.manifest import hash_file

NAME = "lightning"


def checkpoint_name(step: int) -> str:
    """The ``.ckpt`` of the state of ``step``, in the checkpoint folder."""
    return f"step-{step}.ckpt"


def keeps_not(trainer: Trainer) -> str | None:
    """Why this Lightning run's state cannot be written without a collective, or None."""
    strategy = trainer.strategy
    if isinstance(strategy, (DeepSpeedStrategy, XLAStrategy, SingleDeviceXLAStrategy)) or \
            not isinstance(strategy, (DDPStrategy, SingleDeviceStrategy)):
        return (f"the {type(strategy).__name__} strategy gathers its state dicts with "
                "collectives: Lightning's periodic checkpoints are kept")
    if any(hasattr(o, "consolidate_state_dict") for o in trainer.optimizers):
        return ("a sharded optimizer (ZeroRedundancyOptimizer) consolidates its state with "
                "collectives: Lightning's periodic checkpoints are kept")
    if not trainer.lightning_module.automatic_optimization:
        return ("manual optimization steps its optimizers where babysit does not look: "
                "Lightning's periodic checkpoints are kept")
    return None


class UpdateHooks:
    """A Lightning optimizer as the keeper hooks it (``Keeper(optimizer=...)``): its update
    begins at ``updating()``, which the integration calls from ``on_before_optimizer_step``,
    and ends at the optimizer's own step post-hook, or at ``ended()`` (the step's
    ``on_train_batch_end``) when it never ran.

    Lightning's automatic optimization runs ``optimizer.step(closure)``, whose closure is the
    step's forward and backward: the optimizer's own pre-hook fires before them, so a rank
    stuck in the backward's all-reduce would count as inside its update, and keep nothing.
    ``on_before_optimizer_step`` comes after the closure, right before the update itself. Under
    fp16 the grad scaler skips the update of a step whose gradients overflowed: the optimizer's
    post-hook never fires, and the step ends all the same."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self._pre: dict[int, Any] = {}
        self._post: dict[int, Any] = {}
        self._keys = itertools.count()
        self._open = False

    def register_step_pre_hook(self, hook: Any) -> _Removable:
        key = next(self._keys)
        self._pre[key] = hook
        return _Removable(lambda: self._pre.pop(key, None))

    def register_step_post_hook(self, hook: Any) -> _Removable:
        key = next(self._keys)
        self._post[key] = hook

        def stepped(*args: Any) -> None:
            self._open = False
            hook(*args)

        real = self.optimizer.register_step_post_hook(stepped)

        def remove() -> None:
            self._post.pop(key, None)
            real.remove()
        return _Removable(remove)

    def updating(self) -> None:
        """The update begins (the step's backward is done)."""
        self._open = True
        for hook in list(self._pre.values()):
            hook(self.optimizer, (), {})

    def ended(self) -> None:
        """The step is over: an update that began and never ran (skipped) ends here."""
        if self._open:
            self._open = False
            for hook in list(self._post.values()):
                hook(self.optimizer, (), {})


class _Removable:
    """What ``register_step_*_hook`` returns: ``remove()`` takes the hook off."""

    def __init__(self, remove: Any) -> None:
        self.remove = remove


class LightningStateWriter:
    """The ``PartWriter`` of a Lightning fit (``rank.just_in_time``). ``at_mark`` at each step
    boundary (``on_train_batch_end`` of a batch that stepped), on the training thread, just
    before the keeper's own mark; the keeper calls the writer itself from its thread."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self._at: tuple[int, int, dict[str, Any]] | None = None

    def at_mark(self) -> None:
        """The step boundary: keep the fit loop's state (``state_dict()``, a small nested dict
        built each step), the epoch and the global step, which the next step moves before its
        optimizer step."""
        trainer = self.trainer
        fit_loop = trainer.fit_loop.state_dict()
        # The loader's own state_dict() may hand out what it goes on changing.
        fit_loop["state_dict"] = copy.deepcopy(fit_loop.get("state_dict", {}))
        self._at = (trainer.global_step, trainer.current_epoch, fit_loop)

    def __call__(self, dest: Path, rank: int, *, rng: dict[str, Any], marks: Path, step: int,
                 with_model: bool) -> tuple[list[dict[str, Any]], Format]:
        name = checkpoint_name(step)
        if not with_model:  # one file holds everything: the writer of the model writes it
            return [], Format(NAME, name)
        if self._at is None or self._at[0] != step:
            raise RuntimeError(f"Lightning's state was not marked at step {step}")
        global_step, epoch, fit_loop = self._at
        trainer = self.trainer
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        checkpoint["loops"]["fit_loop"] = fit_loop
        checkpoint.update(global_step=global_step, epoch=epoch)
        io = trainer.strategy.checkpoint_io
        if isinstance(io, AsyncCheckpointIO):  # the file must be whole when the answer goes
            io = io.checkpoint_io
        dest.mkdir(parents=True, exist_ok=True)
        io.save_checkpoint(checkpoint, dest / name)
        return [asdict(hash_file(dest, name))], Format(NAME, name)
