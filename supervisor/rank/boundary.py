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
  is done. There the keeper marks the next step's start, and the cadence decides whether the
  step is saved, both with the random streams as they stood when the step's last training
  forward ended (below).
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

**Which random streams the next step starts from.** A resume runs the script again from its
top: what it draws before its loop, and in the loop before the step's first forward, it draws
again from the streams restored. A loop that draws each step's batch at its top (the
worker-API page's ``while`` loop) draws nothing between a step's last forward and its
``opt.step()``; nanoGPT's ``train.py`` draws the next step's batch right there, inside the last
micro-step of its gradient accumulation (``X, Y = get_batch('train')`` after the forward,
before the backward), and on a resume draws it once more before its loop. So the streams kept
are those as the step's last training forward ended (a forward post-hook takes them, about
4 us a forward; the step's end copies them into the mark), before any draw made after it: a
batch prefetched there is drawn again, the same, by the resumed script, and a loop that draws
at the top is unchanged (nothing drew in between). A loop that draws after its last forward
for the step itself (noise, sampling) and not again on a resume cannot be resumed exactly from
either point; babysit cannot tell the two apart as it trains, so the resume checks: as each
step's first training forward begins, a digest of the streams joins the keeper's mark and the
checkpoint saved there (``Streams.digest``), and a resumed attempt compares its own first
training forward's streams with it (``checkpoints.rng.expected_at_forward``). Where they differ,
the rank says so once, on its console, with the change that makes it exact. Under
``run.batches()`` the top of its loop is the point between steps: the streams are taken there.

``StepEnds`` is the bookkeeping (pure); ``Between`` installs the hooks and acts.
"""

from __future__ import annotations

import os
import sys
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
        self._forward_done_hook: Any = None
        from babysit.checkpoints.mark import Streams

        self._keeps_streams = keeper is not None or checkpointer.enabled
        """Marks or checkpoints keep the streams (not the SDC check alone)."""
        self._held = Streams()
        """The streams as the last training forward ended."""
        self._fresh = False
        """``_held`` was taken in the step in progress (since the last step's end)."""
        self._probe = Streams()
        """Where the streams' digest at a step's first training forward is taken."""
        self._note = False
        """The next training forward is the first since the keeper's newest mark: its streams'
        digest joins the mark (``Keeper.note_forward``)."""
        self._expect: int | None = None
        """The streams' digest the attempt's first training forward should see (a resume's)."""
        import torch

        self._grad_enabled = torch.is_grad_enabled

    def install(self) -> None:
        """Hook the optimizer and the model. After ``attach()``'s restore: the digest a resume
        expects at its first training forward is taken from it."""
        from babysit.checkpoints.rng import expected_at_forward

        self._expect = expected_at_forward()
        self._note = self.keeper is not None  # attach() marks the attempt's first step next
        self._hooks.append(self.optimizer.register_step_pre_hook(self._optimizer_starts))
        self._hooks.append(self.optimizer.register_step_post_hook(self._optimizer_done))
        register = getattr(self.model, "register_forward_pre_hook", None)
        if register is not None:
            import torch

            # Run as plain Python under torch.compile (a graph break): no part of the graph.
            eager: Any = torch.compiler.disable
            self._forward_hook = register(eager(self._forward), prepend=True)
            self._hooks.append(self._forward_hook)
            self._forward_done_hook = self.model.register_forward_hook(eager(self._forward_done))
            self._hooks.append(self._forward_done_hook)

    def by_loader(self) -> None:
        """``run.batches()`` took over (its first call, between steps): a checkpoint owed of
        the step that ended is saved now; from here on the top of its loop saves, checks and
        marks where something drew since the step's end (``Keeper.holds``), and the hooks
        here only mark each step's end, so a fault in the loop's tail (between the step's end
        and the next batch: the script's logging, eval or own checkpoint, a ``next()`` not
        reached yet) still finds the step it completed. The model's hooks come off: the
        streams are taken at the top of its loop."""
        self.starting()
        self.saves = False
        self._note = False
        self._expect = None
        for hook in (self._forward_hook, self._forward_done_hook):
            if hook is not None:
                hook.remove()
                self._hooks.remove(hook)
        self._forward_hook = self._forward_done_hook = None

    def remove(self) -> None:
        """The hooks off. Idempotent."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def reported(self, keep: bool) -> None:
        """``run.step()`` reported the step (after counting it), ``keep`` its answer."""
        self._note = False  # the step is under way: a forward now is not its first
        self._expect = None
        if self.ends.report(keep):
            self._ended()

    def starting(self, forward: int | None = None) -> None:
        """A sign that a step starts: at the first after a step ended, the scheduler's epoch
        settled, the owed checkpoint saved, the SDC digests sent. ``forward``: the streams'
        digest, where the sign is the step's first training forward (saved with them)."""
        if not self.ends.start():
            return
        if self.keeper is not None:
            self.keeper.settle()
        if not self.saves:
            return
        due, rng = self._due, self._rng
        if due is not None:
            self._due = self._rng = None
            if rng is not None and forward is not None:
                rng = {**rng, "forward": forward}
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
        # The streams as the step's last training forward ended (none seen: those of now).
        held = self._held if self.saves and self._fresh else None
        self._fresh = False
        if self.keeper is not None:
            self.keeper.mark(step, cursor, samples, lr_scale, settled=False, streams=held)
            self._note = self.saves
        if not self.saves:
            return
        self._due = self.checkpointer.due(step, cursor)
        if self._due is not None:
            from babysit.checkpoints.rng import capture_rng

            self._rng = held.rng() if held is not None else capture_rng()

    def _optimizer_starts(self, *args: Any) -> None:
        self._note = False
        self._expect = None
        self.starting()

    def _optimizer_done(self, *args: Any) -> None:
        if self.ends.update():
            self._ended()

    def _forward(self, module: Any, args: Any) -> None:
        if not (module.training and self._grad_enabled()):
            return
        starts = self.ends.open
        if not (starts or self._note or self._expect is not None):
            return  # a later micro-step's forward: nothing to do
        digest = None
        if self._note or self._expect is not None or (starts and self._due is not None):
            digest = self._probe.digest()
        if self._expect is not None:
            expected, self._expect = self._expect, None
            if digest != expected:
                _inexact(self._where()[0])
        if self._note and self.keeper is not None and digest is not None:
            self.keeper.note_forward(digest)
        self._note = False
        if starts:
            self.starting(digest)

    def _forward_done(self, module: Any, args: Any, output: Any) -> None:
        if self.saves and self._keeps_streams and module.training and self._grad_enabled():
            self._held.take()
            self._fresh = True


def _inexact(step: int) -> None:
    """Say, on the rank's console, that its streams at the resumed attempt's first training
    forward are not the run's there before it stopped, and what makes them so: once per
    attempt, by the first rank of each node (the loop is the same code on every rank)."""
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return
    rank = os.environ.get("RANK", "0")
    print(f"babysit: [warning] rank {rank}'s resume at step {step} is not exact: the random "
          "streams its first training forward began with are not those the run had there "
          "before it stopped. babysit restores each rank's streams as they stood when the "
          "step's last training forward ended, so that a batch drawn after it for the next "
          "step (nanoGPT's get_batch inside its gradient accumulation) is drawn again, the "
          "same, by the script's first draw; this loop draws something else between a step's "
          "last forward and the next step's first that it does not draw again after a resume. "
          "To resume exactly, draw each step's batch at its top (after opt.step()) or right "
          "after the previous step's last forward, and anything else a step draws (noise, "
          "sampling) before its last forward or from a torch.Generator of your own.",
          file=sys.stderr, flush=True)


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
