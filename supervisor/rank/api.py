"""The worker API: the few calls a training script makes so babysit can watch and steer it.

A training loop with the API stays a training loop::

    from babysit import attach

    run = attach(model=model, optimizer=opt, scheduler=sched)
    for batch in run.batches(loader):       # counts the data cursor, skips bad ranges
        loss = compute_loss(batch)
        loss.backward()
        gnorm = clip_grad_norm_(model.parameters(), 1.0)
        if run.step(loss=loss.item(), grad_norm=gnorm):   # report; False = skip this step
            opt.step()
        opt.zero_grad()
        sched.step()
    run.close()

Calling rules:

- ``attach()`` once per process, after the model and optimizer exist. Under plain ``torchrun`` or
  ``python train.py`` (no babysit environment) it returns a ``Run`` that reports nothing and skips
  nothing, so the script trains unchanged.
- ``step()`` exactly once per optimizer step, on every rank, after the backward pass (before
  ``opt.step()``, so that its False can skip the update, or after it). It sends one message and
  never waits: if the supervisor is behind, the report is dropped and counted. It converts its
  arguments with ``float()``: a CUDA tensor would synchronise, so pass the Python float you
  already have (``loss.item()``) where you already sync, or accept that cost knowingly.
- ``batches()`` wraps the loader each rank iterates (with ``for``, or ``next()`` at each step's
  start); every rank's loader yields that rank's shard of the same global batch, so one local
  batch advances the global data cursor by one. A loop without it (``while run.step_count <
  n:``) passes ``attach()`` the optimizer it steps: babysit finds where each step ends from the
  optimizer's hooks (``rank.boundary``), and counts one global batch per ``step()``.
- ``close()`` once, on every rank, after the last step.
- ``phase(name)`` around work that is not a training step (checkpoint, eval): the hang detector
  grants it a longer allowance and step times exclude it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from babysit.supervisor.contract import protocol
from babysit.supervisor.contract.directive import (
    CLOSED_DIR,
    CONTROL_FILE,
    Directive,
    LrRamp,
    Resume,
    SkipRange,
    merge_skips,
)
from babysit.supervisor.rank import elastic_data
from babysit.supervisor.rank.forward_clock import forward_clock
from babysit.supervisor.rank.saving import Checkpointer

if TYPE_CHECKING:
    from babysit.supervisor.rank.keeper import Keeper, PartWriter

T = TypeVar("T")

_perf = time.perf_counter
_wall = time.time
# The presence bit of each optional field, bound once: step() is the training loop's hot path.
(_HAS_LOSS, _HAS_GRAD_NORM, _HAS_LR, _HAS_TOKENS, _HAS_SAMPLES, _HAS_STEP_TIME, _HAS_DATA_WAIT,
 _HAS_FORWARD_TIME) = (protocol.PRESENT[name] for name in protocol.OPTIONAL_FIELDS)


class Run:
    """What ``attach()`` returns: the training script's handle on babysit.

    ``step`` is the number of optimizer steps completed (restored from a checkpoint on resume);
    ``cursor`` the number of global batches consumed. ``dropped`` counts reports the supervisor
    was too busy to take.
    """

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        directive: Directive,
        sock: socket.socket | None,
        token: bytes,
        model: Any = None,
        optimizer: Any = None,
        scheduler: Any = None,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.directive = directive
        self.step_count = directive.resume.step if directive.resume else 0
        self.cursor = directive.resume.cursor if directive.resume else 0
        self.dropped = 0
        self._sock = sock
        self._token = token
        self._optimizer = optimizer
        self._last_step: float | None = None
        self._data_wait = 0.0
        self._phase_time = 0.0
        self._skips = _by_batches(directive.skip)
        self._hooks: list[Any] = []
        self._closed = False
        self._closed_marker: Path | None = None
        """Where a clean close is recorded for a supervisor that may not be listening
        (``directive.CLOSED_DIR``)."""
        self._checkpointer = Checkpointer(directive, rank, model, optimizer, scheduler,
                                          self._event)
        self._guard = _grad_guard(directive.grad_guard)
        self._fingerprint = _fingerprinter(directive.sdc_every, model, rank)
        self._fingerprinted = -1
        self._model = model
        self._forward = forward_clock(model) if sock is not None else None
        """The model's training forward time, each step's own compute (``forward_clock``)."""
        self._restored: str | None = None
        """The digest of the parameters ``attach()`` restored, until the first forward checks
        that they are still the ones training (``_check_restore``)."""
        self._restore_hook: Any = None
        self._sampler: elastic_data.ElasticSampler | None = None
        """The ``ElasticSampler`` ``batches()`` placed, once (``rank.elastic_data``)."""
        self._keeper: Any = None
        """The keeper of the last completed step (``rank.just_in_time``), when babysit keeps
        one; ``attach()`` starts it."""
        self._marked = -1
        """The step the keeper last marked the start after, at the end of ``attach()`` or the
        top of ``batches()`` (once per step: not per micro-batch of a gradient
        accumulation)."""
        self._between: Any = None
        """The point between steps found from the optimizer's hooks (``rank.boundary``):
        ``attach()`` installs it; under ``batches()`` it only marks each step's end."""
        self._by_loader = False
        """The script draws its batches from ``batches()``, which counts the cursor."""
        self._topped = -1
        """The step after which the top of ``batches()`` last ran."""
        self._framework = False
        """A framework integration owns the loop: it counts the cursor and saves through the
        framework's own checkpoints (``framework_loop``)."""
        self._told_off = False
        """This attempt said why babysit takes no checkpoint (``_checkpoints_off``)."""
        self._began = self.step_count
        """The step this attempt began at: its resume's (``attach()`` sets it after the
        restore), 0 on a fresh start."""
        if optimizer is not None and (directive.lr_scale != 1.0 or directive.lr_ramp):
            self._install_lr_scale(optimizer)

    @property
    def resume(self) -> Resume | None:
        """The checkpoint this attempt resumes from (None on a fresh start). A checkpoint that
        babysit saved is already restored by ``attach()``; one the script registered itself
        with ``checkpoint_saved()`` is the script's to load from ``resume.path``."""
        return self.directive.resume

    @property
    def active(self) -> bool:
        """True when a babysit supervisor is listening (False under plain torchrun/python)."""
        return self._sock is not None

    # -- the data cursor ------------------------------------------------------------------------

    def batches(self, loader: Iterable[T]) -> Iterator[T]:
        """Yield the loader's batches, fast-forwarding to the resume cursor and skipping ranges.

        A loader with a ``seek(cursor)`` method (after which ``iter(loader)`` starts at global
        batch ``cursor``) is repositioned for free; any other iterable is advanced by consuming
        and discarding batches. Time spent waiting in ``next()`` is reported as data wait.
        An ``ElasticSampler`` (``babysit.ElasticSampler``, itself or as a ``DataLoader``'s
        ``batch_sampler``) is told where the resumed checkpoint left the data, in samples, so a
        resume on another world size goes on at the next sample (``rank.elastic_data``).

        From this call on, the top of its loop is the point between steps (saves, the SDC
        check), whether the script iterates it with ``for`` or draws it with ``next()`` at
        each step's start; each step's end is marked where its optimizer update is done, and
        marked again at the top where the script drew from a random stream in between
        (``rank.boundary``).
        """
        if not self._by_loader:
            self._by_loader = True
            if self._between is not None:
                self._between.by_loader()
        return self._batches(loader)

    def _batches(self, loader: Iterable[T]) -> Iterator[T]:
        seek = getattr(loader, "seek", None)
        sampler = elastic_data.find(loader)
        if sampler is not None:
            if sampler is not self._sampler:  # placed once: a second loop goes on where it is
                before = self._sampler
                if before is not None:
                    sampler.anchor(self.cursor, before.samples_at(self.cursor))
                else:
                    sampler.anchor(*self._resume_point(sampler))
                    self._place_skips(sampler)
                self._sampler = sampler
            seek = sampler.seek
        self._checkpointer.samples_at = sampler.samples_at if sampler is not None else None
        it = self._position(loader, seek, 0, self.cursor)
        while True:
            # Between steps: the previous step's optimizer and scheduler updates are done and the
            # next batch is not drawn, so a checkpoint here is exactly (step, cursor).
            if self._between is not None:
                self._between.starting()  # the step's end's mark settled: the scheduler stepped
            if self._keeper is not None and self.step_count != self._marked:
                self._marked = self.step_count
                samples = sampler.samples_at(self.cursor) if sampler is not None else None
                if not self._keeper.holds(self.step_count, self.cursor, samples, self.lr_scale):
                    self._keeper.mark(self.step_count, self.cursor, samples, self.lr_scale)
            self._topped = self.step_count
            self._checkpointer.maybe_save(self.step_count, self.cursor, self.lr_scale,
                                          self.phase)
            self._check_integrity(self.step_count)
            skip = self._skip_at(self.cursor)
            if skip is not None:
                self._event("skip", start=skip.start, end=skip.end, **(
                    {"samples": [sampler.samples_at(skip.start), sampler.samples_at(skip.end)]}
                    if sampler is not None else {}))
                it = self._position(loader, seek, self.cursor, skip.end, it)
                self.cursor = skip.end
            t0 = _perf()
            try:
                batch = _draw_batch(it)
            except StopIteration:
                return
            self._data_wait += _perf() - t0
            self.cursor += 1
            yield batch

    def _samples(self) -> int | None:
        """The samples of the data stream consumed at the cursor, where ``batches()`` draws
        from an ``ElasticSampler``; else None."""
        samples_at = self._checkpointer.samples_at
        return samples_at(self.cursor) if samples_at is not None else None

    def _place_skips(self, sampler: elastic_data.ElasticSampler) -> None:
        """The stream's place, told once per attempt (rank 0: every rank's is the same), so
        that a rollback's skip of the batches met here is given to the next attempt in
        samples; and the skips and LR re-warm given in samples, placed in this world size's
        global batches."""
        if self.rank == 0:
            self._event("stream", cursor=self.cursor, samples=sampler.samples_at(self.cursor),
                        global_batch=sampler.global_batch)
        self._skips = _by_batches(
            SkipRange(*sampler.batches_holding(*r.samples)) if r.samples else r
            for r in self.directive.skip)
        ramp = self.directive.lr_ramp
        if ramp is not None and ramp.samples is not None:
            cut, start, end = ramp.samples
            self.directive = replace(self.directive, lr_ramp=LrRamp(
                sampler.batch_of(cut), sampler.batch_from(start), sampler.batch_from(end),
                ramp.to, ramp.samples))

    def _resume_point(self, sampler: elastic_data.ElasticSampler) -> tuple[int, int]:
        """(cursor, samples consumed there) where this attempt's stream position is known: the
        resumed checkpoint's record; without one (a fresh start, or a checkpoint saved before
        the script used the sampler), as many global batches of this world size as the
        cursor counts."""
        resume = self.directive.resume
        if resume is not None and resume.samples is not None:
            return resume.cursor, resume.samples
        return self.cursor, self.cursor * sampler.global_batch

    def _watch_restore(self) -> None:
        """After a resume, check once, at the model's first forward (before any optimizer step,
        whenever the script reports its steps), that the parameters it computes with are the
        ones the checkpoint restored. Ahead of every other hook: an FSDP2 module gathers its
        shards in its own, and the restore left shards."""
        from babysit.supervisor.rank.fingerprint import local_digest

        register = getattr(self._model, "register_forward_pre_hook", None)
        if register is None:
            return
        self._restored = local_digest(self._model)
        if self._restored is not None:
            self._restore_hook = register(lambda module, args: self._check_restore(),
                                          prepend=True)

    def _check_restore(self) -> None:
        """Are the parameters of the first forward after a resume the ones the checkpoint
        restored? A script that loads weights over them after ``attach()`` (a "load
        pretrained" line placed after it) resumes from something else entirely, and says
        nothing; the supervisor judges the answer (``resume_check``)."""
        from babysit.supervisor.rank.fingerprint import local_digest

        if self._restore_hook is not None:
            self._restore_hook.remove()
            self._restore_hook = None
        restored, self._restored = self._restored, None
        seen = local_digest(self._model)
        self._event("resume_check", step=self.step_count, took=seen == restored,
                    restored=restored, seen=seen)

    def _check_integrity(self, step: int) -> None:
        """The silent-data-corruption check, between steps: every rank's parameters are the
        same here (step k's update is done, step k+1's not begun), so the supervisor can
        compare their digests at this step across ranks."""
        fp = self._fingerprint
        if fp is None or step == self._fingerprinted or not fp.due(step):
            return
        self._fingerprinted = step
        self._event("fingerprint", step=step, digests=fp.digests())

    def _position(
        self,
        loader: Iterable[T],
        seek: Any,
        current: int,
        target: int,
        it: Iterator[T] | None = None,
    ) -> Iterator[T]:
        if target == current and it is not None:
            return it
        if seek is not None:
            seek(target)
            return iter(loader)
        it = iter(loader) if it is None else it
        for _ in range(target - current):
            next(it, None)
        return it

    def skip_at(self, cursor: int) -> SkipRange | None:
        """For frameworks that own the data loop (``babysit.integrations``): the skip range the
        batch at ``cursor`` falls in, reported to the supervisor, or None. Call with increasing
        cursors; the caller then moves its data to ``range.end`` and sets ``cursor`` there."""
        skip = self._skip_at(cursor)
        if skip is not None:
            self._event("skip", start=skip.start, end=skip.end)
        return skip

    def framework_loop(self) -> None:
        """For frameworks that own the training loop (``babysit.integrations``): they count
        ``cursor`` themselves and save through the framework's own checkpoints
        (``checkpoint_saved``), so ``step()`` counts no batch and says nothing of babysit's
        own checkpoints. Call once, right after ``attach()``."""
        self._framework = True

    def scale_lr(self, optimizer: Any) -> None:
        """Apply the LR scale a rollback set to ``optimizer``, for frameworks that build it
        after ``attach()`` (inside ``fit`` or ``train``). Call once per optimizer."""
        self._optimizer = optimizer
        if self.directive.lr_scale != 1.0 or self.directive.lr_ramp:
            self._install_lr_scale(optimizer)

    def keep(self, model: Any, optimizer: Any = None, scheduler: Any = None, *,
             writer: PartWriter | None = None, why_not: str | None = None) -> Keeper | None:
        """Start keeping the last completed step (``rank.just_in_time``), for a loop whose
        optimizer exists only after ``attach()`` (a framework builds it inside ``fit`` or
        ``train``: ``babysit.integrations``): ``attach(keep_later=True)``, then this once, on
        every rank, once the optimizer and scheduler exist. Returns the keeper, started, when
        the run keeps the last step (the caller then marks every step boundary with
        ``keeper.mark``), else None.

        ``writer``: writes the state in a format of the caller's (a framework's) in place of
        babysit's. ``why_not``: why this loop's state cannot be kept (a framework's strategy
        whose state dicts are collectives): nothing starts, and the journal says why
        (``just_in_time_off``), as the supervisor learns either way from a ``keeps`` event."""
        keeper: Keeper | None = self._keeper
        if keeper is not None or not self.directive.just_in_time or self._sock is None:
            return keeper
        if why_not is None:
            keeper = self._keeper = _keeper(self, self.directive, self._token.hex(), model,
                                            optimizer, scheduler, writer)
        if keeper is not None:  # the next step starts from the state restored
            keeper.mark(self.step_count, self.cursor, None, self.lr_scale)
            self._event("keeps", keeps=True)
        else:
            self._event("keeps", keeps=False, keeps_not=why_not or "keep() got no model")
        return keeper

    def _skip_at(self, cursor: int) -> SkipRange | None:
        while self._skips and self._skips[0].end <= cursor:
            self._skips.pop(0)
        if self._skips and cursor in self._skips[0]:
            return self._skips.pop(0)
        return None

    # -- the per-step report (hot path) ---------------------------------------------------------

    def step(
        self,
        loss: Any = None,
        grad_norm: Any = None,
        lr: Any = None,
        tokens: Any = None,
        samples: Any = None,
        scalars: Mapping[str, Any] | None = None,
    ) -> bool:
        """Report one optimizer step; return False when this optimizer step should be skipped.

        Units: loss as the script computes it, grad_norm the total L2 norm, lr the base LR before
        babysit's scale (read from the optimizer's first param group when omitted), tokens and
        samples processed by this rank in this step.

        ``scalars``: any other numbers of this step by name (``{"eval_loss": 2.1}``), for the
        report; pass them only at the steps that have them (an eval every N steps). They travel
        as a separate event message (a JSON datagram of at most 8 KB: a few hundred names), so
        the plain call stays as cheap as ever; values that are not numbers are dropped. Rank 0's
        are enough: the report shows the mean over the ranks that sent them.
        """
        now = _perf()
        last = self._last_step
        self._last_step = now
        between = self._between
        if between is not None:  # the step before ends no later than here (rank.boundary)
            between.starting()
        self.step_count += 1
        if not (self._by_loader or self._framework):
            self.cursor += 1  # no loader of babysit's: one global batch a step
        self._checkpointer.poll()
        keep = True
        if self._guard is not None and grad_norm is not None:
            # Every rank sees the same all-reduced grad norm, so every rank decides alike.
            keep = self._guard.observe_value(self.step_count, float(grad_norm)) is None
        if between is not None:
            between.reported(keep)
        if not self._told_off:
            self._checkpoints_off()
        sock = self._sock
        if sock is None:
            return keep
        flags = 0 if keep else protocol.FLAG_SKIPPED
        if loss is None:
            loss = 0.0
        else:
            loss = float(loss)
            flags |= _HAS_LOSS
        if grad_norm is None:
            grad_norm = 0.0
        else:
            grad_norm = float(grad_norm)
            flags |= _HAS_GRAD_NORM
        if lr is None and self._optimizer is not None:
            lr = self._optimizer.param_groups[0]["lr"]
        if lr is None:
            lr = 0.0
        else:
            lr = float(lr) * self.lr_scale
            flags |= _HAS_LR
        if tokens is None:
            tokens = 0.0
        else:
            tokens = float(tokens)
            flags |= _HAS_TOKENS
        if samples is None:
            samples = 0.0
        else:
            samples = float(samples)
            flags |= _HAS_SAMPLES
        if last is None:
            step_time = 0.0
        else:
            step_time = now - last - self._phase_time
            flags |= _HAS_STEP_TIME
        data_wait = self._data_wait
        flags |= _HAS_DATA_WAIT
        forward_time = self._forward.take() if self._forward is not None else None
        if forward_time is None:
            forward_time = 0.0
        else:
            flags |= _HAS_FORWARD_TIME
        self._data_wait = 0.0
        self._phase_time = 0.0
        message = protocol.STEP.pack(  # values in protocol.OPTIONAL_FIELDS order
            protocol.MAGIC, protocol.VERSION, protocol.KIND_STEP, self._token, self.rank, flags,
            self.step_count, self.cursor, _wall(), loss, grad_norm, lr, tokens, samples,
            step_time, data_wait, forward_time,
        )
        try:
            sock.send(message)
        except OSError:
            # Full queue (BlockingIOError) or supervisor gone: drop rather than wait.
            self.dropped += 1
        if scalars:
            self.scalars(scalars)
        return keep

    def _checkpoints_off(self) -> None:
        """Once per attempt, when the config asks for checkpoints and this run can take none,
        rank 0 says why and what to change in a ``checkpoints_off`` event: journaled, and a
        warning on the console and to the alert sinks.
        Called by ``step()`` until the answer is known (at the first step, or once the first
        checkpoint was due)."""
        from babysit.supervisor.rank.boundary import why_no_checkpoints

        ckpt = self._checkpointer
        between = self._between
        known, why = why_no_checkpoints(
            wanted=ckpt.enabled and not self._framework, model=self._model is not None,
            optimizer=self._optimizer is not None, by_loader=self._by_loader,
            ended=between.ends.ended if between is not None else 0,
            step=self.step_count, began=self._began, every=ckpt.every(self.step_count),
            rank=self.rank)
        self._told_off = known
        if why is not None and self.rank == 0:
            self._event("checkpoints_off", step=self.step_count, why=why)

    def scalars(self, scalars: Mapping[str, Any]) -> None:
        """Report other numbers of the newest step by name (``{"eval_loss": 2.1}``): call it
        after an eval that follows ``step()``, or pass ``scalars=`` to ``step()`` itself. For
        the report; never blocks, never raises (see ``step``)."""
        values = {}
        for name, value in scalars.items():
            try:
                values[str(name)] = float(value)
            except (TypeError, ValueError):
                continue  # a report must never break the training step
        if values:
            self._event("scalars", step=self.step_count, values=values)

    def checkpoint_saved(self, path: str | os.PathLike[str]) -> None:
        """Tell babysit the script saved a checkpoint of the current step and cursor at ``path``.

        For scripts that save and load themselves ("bring your own checkpoint"). Call it on
        every rank, after the save finished on every rank; it is collective. On a relaunch,
        ``run.resume.path`` is the checkpoint to load.
        """
        self._checkpointer.saved_externally(path, self.step_count, self.cursor,
                                            self.lr_scale)

    # -- phases, events, shutdown ---------------------------------------------------------------

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Mark work that is not a training step (``"checkpoint"``, ``"eval"``, ...)."""
        self._event("phase", name=name, begin=True)
        t0 = _perf()
        try:
            yield
        finally:
            self._phase_time += _perf() - t0
            self._event("phase", name=name, begin=False)

    def _event(self, type_: str, **data: Any) -> None:
        if self._sock is None:
            return
        try:
            self._sock.send(protocol.encode_event(self._token, self.rank, type_, _wall(), **data))
        except (OSError, protocol.ProtocolError):  # full queue, gone, or too big: dropped
            self.dropped += 1

    def close(self) -> None:
        """Tell the supervisor this rank finished cleanly. Call it on every rank, after the
        last step (a checkpoint due at that step is saved here, a collective). Safe to call
        twice."""
        if self._closed:
            return
        self._closed = True
        # A checkpoint due at the last step is saved now: a loop that draws from batches()
        # with next() at each step's start ends before the top after its last step.
        if self._between is not None:
            self._between.close()
            self._between = None
        if self._by_loader and self._topped != self.step_count:
            self._checkpointer.maybe_save(self.step_count, self.cursor, self.lr_scale,
                                          self.phase)
        if self._keeper is not None:  # a clean end: nothing of this attempt to keep
            self._keeper.close()
        self._checkpointer.close()
        self._event("close", step=self.step_count, cursor=self.cursor, dropped=self.dropped)
        if self._closed_marker is not None:
            # The supervisor may be gone (killed while the job trained on): a supervisor
            # taking over learns from this file that the job finished, not from the socket.
            with contextlib.suppress(OSError):
                self._closed_marker.parent.mkdir(exist_ok=True)
                self._closed_marker.write_text(json.dumps(
                    {"rank": self.rank, "world_size": self.world_size, "step": self.step_count}))
        for hook in self._hooks:
            hook.remove()
        if self._forward is not None:
            self._forward.remove()
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def lr_scale(self) -> float:
        """babysit's LR multiplier for the current step (1.0 unless a rollback cut it; after
        one it wears off over the directive's ``lr_ramp``)."""
        return self.directive.scale_at(self.cursor)

    def _install_lr_scale(self, optimizer: Any) -> None:
        # Scale just around optimizer.step() and restore right after, so LR schedulers (which
        # read and write group["lr"]) never see the scale and any scheduler keeps working.
        saved: list[Any] = []

        def pre(opt: Any, args: Any, kwargs: Any) -> None:
            saved[:] = [group["lr"] for group in opt.param_groups]
            scale = self.lr_scale
            for group in opt.param_groups:
                group["lr"] = group["lr"] * scale

        def post(opt: Any, args: Any, kwargs: Any) -> None:
            for group, lr in zip(opt.param_groups, saved, strict=True):
                group["lr"] = lr

        self._hooks.append(optimizer.register_step_pre_hook(pre))
        self._hooks.append(optimizer.register_step_post_hook(post))


def attach(
    model: Any = None,
    optimizer: Any = None,
    scheduler: Any = None,
    *,
    flops_per_token: float | None = None,
    param_count: int | None = None,
    peak_flops: float | None = None,
    keep_later: bool = False,
) -> Run:
    """Connect this rank to its babysit supervisor, or return a no-op ``Run`` if there is none.

    Call it after ``init_process_group`` and after building the model, optimizer and scheduler
    exactly as for a fresh start: on a relaunch it restores them from the checkpoint the
    supervisor chose (a collective). ``optimizer`` is also needed for the LR scale a rollback
    sets. Reads only ``BABYSIT_*`` and torchrun's ``RANK``/``WORLD_SIZE`` variables.

    In a warm standby (the next attempt, started by babysit while the current one trains:
    ``launch.warm_standby``) it waits here until a relaunch promotes it, then goes on as in a
    fresh attempt: what the script does before ``attach()`` runs ahead, whether the standby is
    ever used or not; what it does after runs only once promoted.

    MFU (model FLOPs utilisation) needs three numbers babysit cannot know, so it is reported
    only when the script gives them: ``tokens`` in each ``step()``, the training FLOPs per token
    (``flops_per_token``, forward plus backward; or ``param_count``, for the 6 x parameters
    rule of dense transformers, which ignores attention's share), and ``peak_flops``, one
    device's peak FLOP/s at the training precision (989e12 for an H100 SXM in dense BF16). A
    "token" is whatever unit ``tokens`` counts: a vision script passes images and FLOPs per
    image.

    ``keep_later``: the last completed step is kept from ``run.keep(...)`` on, once the loop's
    optimizer exists (a framework integration), not from here.
    """
    flops_per_token = _flops_per_token(flops_per_token, param_count)
    if peak_flops is not None:
        peak_flops = _positive("peak_flops", peak_flops)
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    path = os.environ.get(protocol.ENV_SOCKET)
    token_hex = os.environ.get(protocol.ENV_TOKEN)
    if not path or not token_hex:
        return Run(rank=rank, world_size=world_size, directive=Directive(), sock=None, token=b"",
                   optimizer=optimizer)
    standby = os.environ.get(protocol.ENV_STANDBY)
    if standby:  # a warm standby: everything above this call is done; the attempt's facts wait
        _await_promotion(Path(standby), world_size,
                         int(os.environ.get(protocol.ENV_SUPERVISOR_PID, "0")))
    directive_path = os.environ.get(protocol.ENV_DIRECTIVE)
    directive = Directive.read(directive_path) if directive_path else Directive()
    sock: socket.socket | None
    try:
        sock = protocol.connect(path)
    except OSError as exc:
        # Training must go on without its babysitter; the directive (skips, LR scale) still holds.
        print(f"babysit: rank {rank} cannot reach the supervisor at {path} ({exc}); training "
              f"continues unwatched", file=sys.stderr, flush=True)
        sock = None
    run = Run(rank=rank, world_size=world_size, directive=directive, sock=sock,
              token=bytes.fromhex(token_hex), model=model, optimizer=optimizer,
              scheduler=scheduler)
    if directive_path:
        run._checkpointer.control = Path(directive_path).with_name(CONTROL_FILE)
        run._closed_marker = Path(directive_path).with_name(CLOSED_DIR) / f"{rank}.json"
    loading = _perf()
    restored = run._checkpointer.resume()
    # How long the load took, for the goodput ledger's "restore" (0 on a fresh start).
    restore_s = round(_perf() - loading, 6) if restored is not None else 0.0
    if restored is not None:
        run.step_count, run.cursor = restored
        run._began = run.step_count
        if model is not None:  # checked at the first forward: did the restore take?
            run._watch_restore()
    run._keeper = _keeper(run, directive, token_hex, model, optimizer, scheduler)
    run._between = _between(run, model, optimizer)
    if run._keeper is not None:  # the first step starts from the restore, whatever the loop
        run._marked = run.step_count
        run._keeper.mark(run.step_count, run.cursor, None, run.lr_scale)
    keeps: dict[str, Any] = {}
    if directive.just_in_time:  # the node keeps the last step only with the ranks that can
        keeps = {"keeps": run._keeper is not None}
        if run._keeper is None:
            keeps["keeps_not"] = (
                "attach() got no model (a framework integration saves through the framework's "
                "own checkpoints)") if model is None else "the supervisor cannot be reached"
    if keep_later and run._keeper is None and directive.just_in_time:
        keeps = {"keeps_later": True}  # run.keep() says whether it does (its "keeps" event)
    run._event("hello", pid=os.getpid(), host=socket.gethostname(), world_size=world_size,
               local_rank=int(os.environ.get("LOCAL_RANK", "0")), step=run.step_count,
               cursor=run.cursor, flops_per_token=flops_per_token, peak_flops=peak_flops,
               restore_s=restore_s, **keeps)
    return run


_STANDBY_POLL_S = 0.01
"""How often a waiting standby rank looks for ``go``: a stat() every 10 ms costs nothing
measurable and bounds the promotion's latency."""
_ORPHAN_CHECK_S = 1.0


def _await_promotion(folder: Path, world_size: int, supervisor: int) -> None:
    """A warm standby rank (``node.standby``): say it is ready, then wait until babysit writes
    ``go`` (after the attempt's directive), or exit quietly when babysit is gone (a standby
    nobody can promote must not linger). Sends nothing and reads no directive before ``go``."""
    ready = folder / protocol.STANDBY_READY
    ready.mkdir(parents=True, exist_ok=True)
    mine = ready / os.environ.get("LOCAL_RANK", "0")
    tmp = mine.with_suffix(".tmp")
    tmp.write_text(json.dumps({"world_size": world_size, "time": _wall(), "pid": os.getpid()}))
    os.replace(tmp, mine)
    go = folder / protocol.STANDBY_GO
    checked = _perf()
    while not go.exists():
        time.sleep(_STANDBY_POLL_S)
        if supervisor > 0 and _perf() - checked >= _ORPHAN_CHECK_S:
            checked = _perf()
            try:
                os.kill(supervisor, 0)
            except (ProcessLookupError, PermissionError):  # gone (or its pid another user's)
                raise SystemExit(0) from None


def _positive(name: str, value: Any) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        number = math.nan
    if not (math.isfinite(number) and number > 0):
        raise ValueError(f"attach({name}={value!r}): give a positive, finite number")
    return number


def _flops_per_token(flops_per_token: Any, param_count: Any) -> float | None:
    if flops_per_token is not None:
        return _positive("flops_per_token", flops_per_token)
    if param_count is not None:
        return 6.0 * _positive("param_count", param_count)
    return None


def _fingerprinter(every: int, model: Any, rank: int) -> Any:
    """The SDC check's digests, when the run's config turns it on (``sdc.every_steps``)."""
    if not every:
        return None
    if model is None:
        if rank == 0:
            print("babysit: sdc.every_steps is set but attach() got no model; the silent data "
                  "corruption check is off. Pass attach(model=...).", file=sys.stderr, flush=True)
        return None
    from babysit.supervisor.rank.fingerprint import Fingerprinter

    return Fingerprinter(every, model)


def _keeper(run: Run, directive: Directive, token_hex: str, model: Any, optimizer: Any,
            scheduler: Any, writer: PartWriter | None = None) -> Any:
    """The keeper of the last completed step (``rank.just_in_time``), started, when the run
    keeps one (``checkpoints.just_in_time``) and there is a model to keep; else None.
    ``writer``: its state's format, when not babysit's (``Keeper``)."""
    settings = directive.just_in_time
    if not settings or model is None or run._sock is None:
        return None
    from babysit.supervisor.rank.keeper import Keeper

    keeper = Keeper(rank=run.rank, attempt=directive.attempt, token_hex=token_hex,
                    marks=Path(settings["marks"]), hold_s=float(settings["hold_s"]), model=model,
                    optimizer=optimizer, scheduler=scheduler, emit=run._event, writer=writer)
    keeper.start()
    return keeper


def _between(run: Run, model: Any, optimizer: Any) -> Any:
    """The point between steps found from the optimizer's hooks (``rank.boundary``), installed,
    when something is done there (checkpoints, the keeper's marks, the SDC check) and there is
    a model and an optimizer to hook; else None. After the keeper's start: its optimizer
    post-hook counts each update before this one's marks it."""
    if model is None or optimizer is None or not (
            run._checkpointer.enabled or run._keeper is not None or run._fingerprint is not None):
        return None
    from babysit.supervisor.rank.boundary import Between

    between = Between(model=model, optimizer=optimizer, keeper=run._keeper,
                      checkpointer=run._checkpointer,
                      where=lambda: (run.step_count, run.cursor, run._samples(), run.lr_scale),
                      check=run._check_integrity, phase=run.phase)
    between.install()
    return between


def _grad_guard(settings: dict[str, Any]) -> Any:
    """The in-process grad-norm detector, when the policy skips grad-norm spikes (without
    pydantic: the supervisor validated the settings)."""
    if not settings:
        return None
    from babysit.policies.detectors.grad_guard import GradGuard, GuardSettings

    return GradGuard(GuardSettings(**settings))


def _by_batches(ranges: Iterable[SkipRange]) -> list[SkipRange]:
    """Skip ranges as a rank walks them: ``merge_skips`` by their batches alone (a range given
    in samples and one given in batches may overlap once both are in this attempt's batches),
    so one jump clears each."""
    return list(merge_skips([SkipRange(r.start, r.end) for r in ranges]))


def _draw_batch(it: Iterator[T]) -> T:
    """The loader's next batch. Its own function so that a traceback through this frame says
    the data loader raised (``policies.detectors.crash``: a ``data`` crash, relaunched to see
    whether it comes back at the same batch)."""
    return next(it)
