"""Where one training step ends and the next begins, found from the optimizer's hooks: the whole
point between steps in a loop that draws its batches without ``run.batches()`` (a ``while``
loop as nanoGPT's, an iterator drawn with ``next()`` inside a ``train_step`` as torchtitan's);
the step's end's mark in one that does.

``run.batches()`` knows the point between two steps exactly: the top of its loop, after the
script's ``opt.step()``, ``zero_grad()`` and ``sched.step()`` of step k, before batch k+1 is
drawn. A loop of its own makes no call of babysit's there, so the point is found from signs the
script gives anyway:

- **A step ends** once both its ``run.step()`` and its optimizer update came, in either order
  (``run.step()`` before ``opt.step()``, as the worker-API page shows, or after it, as
  torchtitan reports its metrics), or at a ``run.step()`` that said to skip the update (it
  returned False: no ``opt.step()`` follows). The optimizer's step post-hook says when the update
  is done. There the keeper marks the next step's start (the random streams as they are now:
  in a loop that draws its batch at the top of the step, nothing draws between ``opt.step()``
  and the next batch), and the cadence decides whether the step is saved (the streams taken
  now if so).
- **The next step starts** at the first of: the model's forward in training mode with autograd
  on (a forward pre-hook ahead of the model's others, FSDP2's all-gather among them), the
  optimizer's step pre-hook, or ``run.step()``. The script's ``sched.step()`` has run by then,
  so the keeper settles the scheduler's epoch of the step's state; and every rank gets there at
  the same step still holding the model and optimizer of the completed one, so the checkpoint
  decided at the end is saved here (a collective), with the random streams and data cursor of
  the end (the batch has been drawn since); the SDC digests are sent here too.
- ``run.close()`` starts no step, but a checkpoint decided at the last step's end is saved there.

The attempt's first step starts from ``attach()``'s restore, marked at its end (``attach``).
Once the script draws from ``run.batches()``, the top of its loop saves and checks, exactly as
ever; the hooks here still mark each step's end, and the top marks again only where a stream
moved since (the script drew between steps), so a fault in the tail of the loop's body (between
a step's end and the next batch) still finds the completed step marked, and no step is saved
twice nor marked twice alike. A step whose update the optimizer never ran (a ``GradScaler``
that found infinite gradients skips ``opt.step()`` while ``run.step()`` said keep) has no end
here: it is neither marked nor saved, and the keeper's state stays that of the step before
(not consistent once the scheduler stepped).

``StepEnds`` is the bookkeeping (pure); ``Between`` installs the hooks and acts.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from babysit.supervisor.rank.saving import Checkpointer, Due


class StepEnds:
    """Which signs of the step in progress came; each method says whether it ended or started a
    step there. Calling rules: ``report`` once per ``run.step()``, ``update`` once per finished
    optimizer update, ``start`` at every sign that a step may be starting."""

    def __init__(self) -> None:
        self.reported = False
        """``run.step()`` of the step in progress came, its update not yet."""
        self.updated = False
        """The optimizer update of the step in progress came, its ``run.step()`` not yet."""
        self.open = False
        """A step ended and the next has not started."""
        self.ended = 0
        """Steps ended so far."""

    def report(self, keep: bool) -> bool:
        """``run.step()`` came, ``keep`` its answer; True when the step ends here: its update
        came before, or is skipped. A second report without an update between (the optimizer
        skipped it unseen) is the next step's: the one before it never ends."""
        if self.updated or not keep:
            return self._end()
        self.reported = True
        return False

    def update(self) -> bool:
        """The optimizer's update is done; True when the step ends here (reported before)."""
        if self.reported:
            return self._end()
        self.updated = True
        return False

    def start(self) -> bool:
        """A sign that a step is starting; True at the first after a step ended."""
        if not self.open:
            return False
        self.open = False
        return True

    def _end(self) -> bool:
        self.reported = self.updated = False
        self.open = True
        self.ended += 1
        return True


Where = Callable[[], tuple[int, int, int | None, float]]
"""(steps completed, data cursor, samples consumed there or None, LR scale), now."""
Phase = Callable[[str], AbstractContextManager[None]]


class Between:
    """The point between steps of a loop without ``run.batches()``, for one rank's ``Run``.

    ``install()`` once, after ``attach()``'s restore and after the keeper started (its optimizer
    post-hook must count the update before this one marks); ``reported`` from each
    ``run.step()``, ``starting`` at its entry (and at the top of ``run.batches()``),
    ``by_loader`` when ``run.batches()`` takes over, ``close`` from ``run.close()``."""

    def __init__(self, *, model: Any, optimizer: Any, keeper: Any, checkpointer: Checkpointer,
                 where: Where, check: Callable[[int], None], phase: Phase) -> None:
        """``check(step)``: the SDC digests between steps (``Run._check_integrity``)."""
        self.model, self.optimizer, self.keeper = model, optimizer, keeper
        self.checkpointer = checkpointer
        self._where, self._check, self._phase = where, check, phase
        self.ends = StepEnds()
        self.saves = True
        """Saves and SDC checks are made here (False once ``run.batches()`` makes them)."""
        self._hooks: list[Any] = []
        self._forward_hook: Any = None
        self._step = -1
        """The step that ended last (``-1``: none in this attempt)."""
        self._lr_scale = 1.0
        self._due: Due | None = None
        self._rng: dict[str, Any] | None = None
        """This rank's random streams at the end of the step ``_due`` saves."""
        import torch

        self._grad_enabled = torch.is_grad_enabled

    def install(self) -> None:
        """Hook the optimizer and the model."""
        self._hooks.append(self.optimizer.register_step_pre_hook(self._optimizer_starts))
        self._hooks.append(self.optimizer.register_step_post_hook(self._optimizer_done))
        register = getattr(self.model, "register_forward_pre_hook", None)
        if register is not None:
            import torch

            # Run as plain Python under torch.compile (a graph break): no part of the graph.
            eager: Any = torch.compiler.disable
            self._forward_hook = register(eager(self._forward), prepend=True)
            self._hooks.append(self._forward_hook)

    def by_loader(self) -> None:
        """``run.batches()`` took over (its first call, between steps): a checkpoint owed of
        the step that ended is saved now; from here on the top of its loop saves, checks and
        marks where something drew since the step's end (``Keeper.holds``), and the hooks
        here only mark each step's end, so a fault in the loop's tail (between the step's end
        and the next batch: the script's logging, eval or own checkpoint, a ``next()`` not
        reached yet) still finds the step it completed. The model's hook comes off."""
        self.starting()
        self.saves = False
        if self._forward_hook is not None:
            self._forward_hook.remove()
            self._hooks.remove(self._forward_hook)
            self._forward_hook = None

    def remove(self) -> None:
        """The hooks off. Idempotent."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def reported(self, keep: bool) -> None:
        """``run.step()`` reported the step (after counting it), ``keep`` its answer."""
        if self.ends.report(keep):
            self._ended()

    def starting(self) -> None:
        """A sign that a step starts: at the first after a step ended, the scheduler's epoch
        settled, the owed checkpoint saved, the SDC digests sent."""
        if not self.ends.start():
            return
        if self.keeper is not None:
            self.keeper.settle()
        if not self.saves:
            return
        due, rng = self._due, self._rng
        if due is not None:
            self._due = self._rng = None
            self.checkpointer.save(due, self._lr_scale, self._phase, rng=rng)
        self._check(self._step)

    def close(self) -> None:
        """The run closes: a checkpoint owed of the last step is saved now (collective, as
        ``run.close()`` is on every rank), and the hooks come off."""
        self.starting()
        self.remove()

    def _ended(self) -> None:
        step, cursor, samples, lr_scale = self._where()
        self._step, self._lr_scale = step, lr_scale
        if self.keeper is not None:
            self.keeper.mark(step, cursor, samples, lr_scale, settled=False)
        if not self.saves:
            return
        self._due = self.checkpointer.due(step, cursor)
        if self._due is not None:
            from babysit.checkpoints.rng import capture_rng

            self._rng = capture_rng()

    def _optimizer_starts(self, *args: Any) -> None:
        self.starting()

    def _optimizer_done(self, *args: Any) -> None:
        if self.ends.update():
            self._ended()

    def _forward(self, module: Any, args: Any) -> None:
        if self.ends.open and module.training and self._grad_enabled():
            self.starting()


def why_no_checkpoints(*, wanted: bool, model: bool, optimizer: bool, by_loader: bool,
                       ended: int, step: int, began: int, every: int,
                       rank: int) -> tuple[bool, str | None]:
    """Whether it is known yet if a run can take babysit's checkpoints, and if it cannot, why,
    in words a user acts on (None: it can, or it was not asked to). Pure.

    ``wanted``: the config asks for them (``checkpoints.every_steps`` > 0; a framework
    integration saves through its own); ``model``, ``optimizer``: ``attach()`` got one;
    ``by_loader``: the loop draws from ``run.batches()``; ``ended``: the steps whose end the
    optimizer's hooks found so far, in this attempt; ``step``: the steps completed
    (``run.step()`` just counted the newest); ``began``: the step this attempt began at (its
    resume's, 0 on a fresh start), so that ``ended`` is weighed against this attempt's steps,
    never the run's; ``every``: the cadence. Known at the first step, except for a loop without
    ``run.batches()`` whose optimizer never ended a step yet: known once this attempt's first
    checkpoint was due and the next step was reported."""
    if not wanted or (by_loader and model):
        return True, None
    fix = "a fault resumes from the newest checkpoint there is, or from the start"
    if not model:
        return True, (
            f"checkpoints.every_steps is {every}, but attach() got no model (rank {rank}, "
            f"step {step}): babysit saves no checkpoint of its own and keeps no just-in-time "
            f"state, so {fix}. Pass attach(model=..., optimizer=..., scheduler=...); or, for "
            "a script that saves its own checkpoints, set checkpoints.every_steps: 0 and call "
            "run.checkpoint_saved(path) on every rank after each save.")
    if not optimizer:
        return True, (
            f"checkpoints.every_steps is {every}, but attach() got no optimizer and the loop "
            f"draws its batches without run.batches() (rank {rank}, step {step}): babysit "
            "cannot see where one training step ends and the next begins, so it saves no "
            f"checkpoint and keeps no just-in-time state, and {fix}. Pass the optimizer whose "
            "step() ends each training step to attach(optimizer=...), or draw the batches "
            "with run.batches(loader).")
    if ended:
        return True, None
    due = (began // max(every, 1) + 1) * max(every, 1)  # this attempt's first save
    if step <= due:
        return False, None
    since = f" since its resume at step {began}" if began else ""
    return True, (
        f"checkpoints.every_steps is {every}, but in {step - 1 - began} steps{since} no "
        f"training step ended where babysit can see it (rank {rank}): the optimizer passed to "
        "attach() never finished a step() between two run.step() calls, so the checkpoint due "
        f"at step {due} was not saved and no just-in-time state is kept; {fix}. Pass attach() the "
        "optimizer the loop steps (the one inside a wrapper; a GradScaler's scaler.step(opt) "
        "steps it unless it skips every step), or draw the batches with "
        "run.batches(loader).")
