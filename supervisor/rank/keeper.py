"""A rank's keeper of its last completed step: marks each step's start, knows whether its state
is still that step's, writes it on its node's request, and keeps the rank alive until then.

After a fault the ranks that live usually still hold the model and optimizer of the last
completed step. The keeper makes that usable (``checkpoints/just_in_time.py`` says what is
written, ``node/last_step.py`` who asks):

- **marks** (``mark``, at the first top of ``Run.batches()`` after each step, or, in a loop
  without it, at each step's end found by the optimizer's hooks: ``rank.boundary``): the step,
  the data cursor and the LR scale the next step starts from, the rank's random streams into
  its mark file (``checkpoints.mark``: about 15 us; in a loop without ``run.batches()``, as
  they stood when the step's last training forward ended), the optimizer-step count and the
  scheduler's epoch; on a GPU, a CUDA event after the step's last kernels. As the next step's
  first training forward begins, a digest of the streams joins the mark (``note_forward``), for
  a resume from it to check its own first forward against.
- **knows** whether the state is still that of the mark: the optimizer's own hooks say whether
  ``optimizer.step()`` is running or ran since (then no), and the scheduler's epoch whether it
  stepped since. A mark at a step's end comes before the script's ``sched.step()``: its epoch
  is settled at the next step's start (``settle``), and until then the state is the step's
  only once the scheduler moved as far as it did after the step before (a fault between
  ``opt.step()`` and ``sched.step()`` keeps nothing).
- **answers** its node from a thread of its own (``contract/keeper.py``), so it writes while
  the main thread sits in a collective that will never finish; on a GPU it copies from a side
  stream once the mark's event completed, never waiting behind the kernel that is stuck.
- **writes** babysit's own format (``checkpoints.just_in_time.write_part``), or, where a
  framework owns the loop, that framework's (a ``PartWriter``: ``rank/integrations``), which
  the framework's own resume reads.
- **holds on**: a rank that would end (an uncaught exception: a peer's connection reset under
  gloo; a SIGTERM: torchrun stopping the survivors of a crash, or a scheduler's) first tells its
  node (``holding``) and waits, at most ``hold_s``, until the node released it; then it ends as
  it would have (the traceback printed, the same exit status). A SIGTERM handler is installed
  only where none is (the script's own wins), and only while the keeper is on.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import socketserver
import sys
import threading
import time
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

from babysit.checkpoints.just_in_time import shard_of
from babysit.supervisor.contract import keeper as contract

Emit = Callable[..., None]

if typing.TYPE_CHECKING:
    from babysit.checkpoints.just_in_time import Format
    from babysit.checkpoints.mark import Streams


class PartWriter(typing.Protocol):
    """Writes a rank's part of the just-in-time state in a format of its own, in place of
    babysit's: a framework's, which that framework's own resume reads (``rank/integrations``).

    Called by the keeper (``Keeper.write``) from its own thread, once its state is known to be
    that of the marked ``step``, while the training thread may sit in a collective that never
    ends: it must use none (no barrier, no gather, no ``torch.distributed`` call at all). It
    writes into ``dest`` only, creating it; with ``with_model`` the model and optimizer too, else
    only what is this rank's own. ``rng``: this rank's random streams as the step started;
    ``marks``: the folder of this node's ranks' mark files (``checkpoints.mark``, named by
    global rank), for the other ranks' streams where its format keeps them. Returns the files
    written (manifest entries, ``checkpoints.manifest.hash_file`` as dicts) and the format."""

    def __call__(self, dest: Path, rank: int, *, rng: dict[str, Any], marks: Path, step: int,
                 with_model: bool) -> tuple[list[dict[str, Any]], Format]: ...


@dataclass(frozen=True, slots=True)
class _Marked:
    """What the step in progress started from."""

    step: int
    cursor: int
    samples: int | None
    lr_scale: float
    optimizer_steps: int
    scheduler_epoch: Any
    """The scheduler's epoch at the mark; once ``settled``, that of the step's state."""
    settled: bool = True
    """Marked after the scheduler stepped (the top of ``run.batches()``, or ``settle``); a mark
    at a step's end found by its optimizer hook (``rank.boundary``) comes before the script's
    ``sched.step()``, and is settled at the next step's start."""


class Keeper:
    """One rank's keeper; ``start()`` after the restore, ``close()`` at ``run.close()``."""

    def __init__(self, *, rank: int, attempt: int, token_hex: str, marks: Path, hold_s: float,
                 model: Any, optimizer: Any, scheduler: Any, emit: Emit,
                 writer: PartWriter | None = None) -> None:
        """``writer``: writes this rank's part in a format of its own (a framework's) in place of
        babysit's (``checkpoints.just_in_time.write_part``)."""
        from babysit.checkpoints.mark import MarkWriter

        self.rank, self.hold_s = rank, hold_s
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self._emit = emit
        self._token = token_hex
        self._address = contract.address(token_hex, attempt, rank)
        self._mark_path = marks / str(rank)
        self._marks = MarkWriter(self._mark_path)
        self._marked: _Marked | None = None
        self._optimizer_steps = 0
        self._scheduler_moves: Any = None
        """How far the scheduler moved between a step's end and the next step's start, the
        last time a mark was settled (None: not seen yet in this attempt)."""
        self._in_optimizer = False
        self._hooks: list[Any] = []
        self._event, self._device = _cuda_event(model)
        self._shard, self._shards = shard_of(model, rank)
        self._unsupported = _unsupported(model)
        self._forward_moved = False
        """A forward ran since the mark in a model whose forward changes its buffers."""
        self._lock = threading.Lock()
        self._released = threading.Event()
        self._holding = False
        self._sigterm = False
        self._server: _Server | None = None
        self._previous_hook: Any = None
        self._installed_sigterm = False
        self._pid = os.getpid()
        """The rank's process: a child it forks (a DataLoader worker) inherits the handlers,
        which then do what they would have done without babysit."""
        self._writer = writer

    # -- the training thread ----------------------------------------------------------------------

    def start(self) -> None:
        """Hook the optimizer, listen, and hold on at an uncaught exception or a SIGTERM."""
        optimizer = self.optimizer
        if optimizer is not None:
            self._hooks.append(optimizer.register_step_pre_hook(self._entering))
            self._hooks.append(optimizer.register_step_post_hook(self._left))
        if _moves_buffers(self.model):
            self._hooks.append(self.model.register_forward_pre_hook(self._forwarding))
        self._server = _serve(self._address, self)
        self._previous_hook, sys.excepthook = sys.excepthook, self._on_exception
        self._take_sigterm()

    def mark(self, step: int, cursor: int, samples: int | None, lr_scale: float,
             settled: bool = True, streams: Streams | None = None) -> None:
        """The step after ``step`` starts here (the data at ``cursor``): record what it starts
        from. Call once per step, between steps, before its batch is drawn, after
        ``optimizer.step()`` returned. ``settled``: the scheduler has stepped for ``step``
        already (the top of ``run.batches()``); False at a step's end found by the optimizer's
        hook, which ``settle`` completes at the next step's start. ``streams``: the random
        streams the next step starts from, taken earlier (``rank.boundary``: as the step's last
        training forward ended), where not those of now."""
        self._marks.write(step, cursor, samples, lr_scale, streams)
        scheduler = self.scheduler
        self._marked = _Marked(step, cursor, samples, lr_scale, self._optimizer_steps,
                               getattr(scheduler, "last_epoch", None), settled)
        self._forward_moved = False
        if self._event is not None:
            self._event.record()

    def note_forward(self, digest: int) -> None:
        """The next step's first training forward begins, the streams' digest ``digest``
        (``checkpoints.mark.Streams.digest``): kept with the mark."""
        self._marks.note(digest)

    def holds(self, step: int, cursor: int, samples: int | None, lr_scale: float) -> bool:
        """The mark is of ``step`` with these values, and no random stream moved nor forward
        ran since: a mark now would record what it holds (the top of ``run.batches()`` after a
        step whose end the optimizer's hook marked, when nothing drew in between)."""
        marked = self._marked
        return marked is not None and not self._forward_moved and \
            (marked.step, marked.cursor, marked.samples, marked.lr_scale) == \
            (step, cursor, samples, lr_scale) and not self._marks.moved()

    def settle(self) -> None:
        """The step after the mark starts: the scheduler's epoch now is that of the marked
        step's state, and how far it moved since the mark is what the next step's end will
        move it too (``_scheduler_why``). Call at the next step's first sign, before its
        optimizer update; does nothing after a settled mark."""
        marked = self._marked
        if marked is None or marked.settled:
            return
        epoch = getattr(self.scheduler, "last_epoch", None)
        self._scheduler_moves = _moved(marked.scheduler_epoch, epoch)
        # A new record, swapped in whole: the keeper's thread may be reading the old one.
        self._marked = _Marked(marked.step, marked.cursor, marked.samples, marked.lr_scale,
                               marked.optimizer_steps, epoch, True)

    def close(self) -> None:
        """The run closed cleanly: nothing to keep. Idempotent."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self._server is not None:
            server, self._server = self._server, None
            server.stop()
        if sys.excepthook == self._on_exception:
            sys.excepthook = self._previous_hook
        if self._installed_sigterm:
            with contextlib.suppress(ValueError):
                if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)
            self._installed_sigterm = False
        self._marks.close()
        with contextlib.suppress(OSError):
            self._mark_path.unlink()

    def _entering(self, *args: Any) -> None:
        self._in_optimizer = True

    def _left(self, *args: Any) -> None:
        self._in_optimizer = False
        self._optimizer_steps += 1

    def _forwarding(self, *args: Any) -> None:
        self._forward_moved = True

    # -- holding on at the end --------------------------------------------------------------------

    def _take_sigterm(self) -> None:
        """Handle SIGTERM where nothing else does (its default action is set)."""
        with contextlib.suppress(ValueError):  # not the main thread: no handler of ours
            if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
                signal.signal(signal.SIGTERM, self._on_sigterm)
                self._installed_sigterm = True
                _forget_in_children()

    def _on_exception(self, kind: type[BaseException], value: BaseException, tb: Any) -> None:
        if os.getpid() == self._pid and not issubclass(kind, KeyboardInterrupt):
            # A framework's handler may have been taken down with the exception (Lightning's
            # teardown puts the default back): torchrun's SIGTERM must find the hold's.
            self._take_sigterm()
        (self._previous_hook or sys.__excepthook__)(kind, value, tb)
        if os.getpid() != self._pid:
            return
        if not issubclass(kind, KeyboardInterrupt):  # a person's Ctrl-C is babysit's to handle
            self.hold(f"{kind.__name__}: {value}"[:300])
        if self._sigterm:  # torchrun's SIGTERM came while holding: end by it, as it would have
            self._die_by_sigterm()

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        if self._holding:
            self._sigterm = True
            return
        if os.getpid() == self._pid:
            self.hold("SIGTERM")
        self._die_by_sigterm()

    def hold(self, why: str) -> None:
        """Tell the node this rank is ending and wait until it released it, or ``hold_s``."""
        if self._released.is_set() or self._server is None:
            return
        self._holding = True
        try:
            self._emit("holding", why=why, step=self._marked.step if self._marked else None)
            self._released.wait(self.hold_s)
        finally:
            self._holding = False

    def _die_by_sigterm(self) -> None:
        with contextlib.suppress(ValueError):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    def release(self) -> None:
        """The node is done with this rank: one holding on ends as it would have; one blocked
        elsewhere (a collective) ends by SIGTERM, as the stop that follows would end it. From a
        thread, where Python may not set a signal handler: the default is restored in libc."""
        self._released.set()
        if self._holding or not self._installed_sigterm:
            return  # holding: it ends now; the script's own handler: the stop ends it as ever
        libc = ctypes.CDLL(None, use_errno=True)
        libc.signal(int(signal.SIGTERM), ctypes.c_void_p(0))  # SIG_DFL
        os.kill(os.getpid(), signal.SIGTERM)

    # -- answering the node (the keeper's thread) -------------------------------------------------

    def view(self) -> dict[str, Any]:
        """What this rank holds (``checkpoints.just_in_time.RankView``)."""
        marked = self._marked
        why = self._inconsistent(marked)
        return {"rank": self.rank, "consistent": why is None, "why": why,
                "step": marked.step if marked else -1, "cursor": marked.cursor if marked else -1,
                "samples": marked.samples if marked else None,
                "lr_scale": marked.lr_scale if marked else 1.0,
                "shard": self._shard, "shards": self._shards, "pid": os.getpid()}

    def _inconsistent(self, marked: _Marked | None) -> str | None:
        if self._unsupported is not None:
            return self._unsupported
        if marked is None:
            return "no step started in this attempt"
        if self._in_optimizer:
            return "inside optimizer.step(): its update is half done"
        if self._optimizer_steps != marked.optimizer_steps:
            return "optimizer.step() ran since the step started"
        if self.scheduler is not None:
            why = _scheduler_why(marked, getattr(self.scheduler, "last_epoch", None),
                                 self._scheduler_moves)
            if why is not None:
                return why
        if self._forward_moved:
            return ("the interrupted step's forward changed the model's buffers (BatchNorm "
                    "running statistics)")
        return None

    def write(self, dest: str, step: int, with_model: bool) -> dict[str, Any]:
        """Write this rank's part of the state of ``step`` into ``dest`` (one write at a time);
        the files written, or why not."""
        with self._lock:
            marked = self._marked
            why = self._inconsistent(marked)
            if why is None and marked is not None and marked.step != step:
                why = f"its state is of step {marked.step}, not {step}"
            if why is not None or marked is None:
                return {"ok": False, "why": why}
            started = time.perf_counter()
            try:
                with self._after_mark():
                    files, form = self._write_part(Path(dest), marked, with_model)
            except Exception as exc:  # said to the node, which falls back
                return {"ok": False, "why": f"{type(exc).__name__}: {exc}"[:2000]}
            moved = self._inconsistent(marked)
            if moved is not None:  # the main thread was not stuck after all
                return {"ok": False, "why": f"it moved on while writing ({moved})"}
            return {"ok": True, "files": files, "seconds": round(time.perf_counter() - started, 6),
                    **({"format": form.to_json()} if form is not None else {})}

    def _write_part(self, dest: Path, marked: _Marked, with_model: bool
                    ) -> tuple[list[dict[str, Any]], Format | None]:
        """The part of the marked state, in babysit's format or in the writer's (its files,
        and the format: None for babysit's)."""
        from babysit.checkpoints import just_in_time
        from babysit.checkpoints.mark import read

        rng = read(self._mark_path).rng()
        if self._writer is not None:
            return self._writer(dest, self.rank, rng=rng, marks=self._mark_path.parent,
                                step=marked.step, with_model=with_model)
        return just_in_time.write_part(
            dest, self.rank, model=self.model, optimizer=self.optimizer,
            scheduler=self.scheduler, rng=rng, step=marked.step, cursor=marked.cursor,
            lr_scale=marked.lr_scale, with_model=with_model), None

    @contextlib.contextmanager
    def _after_mark(self) -> Iterator[None]:
        """On a GPU: once the mark's event completed (the step's last kernels ran), copy on a
        side stream, which does not queue behind the kernel that is stuck on the compute
        stream (a collective that never ends)."""
        if self._event is None:
            yield
            return
        import torch

        deadline = time.monotonic() + self.hold_s
        while not self._event.query():
            if time.monotonic() > deadline:
                raise TimeoutError("the step's last kernels never finished on the GPU")
            time.sleep(0.005)
        with torch.cuda.device(self._device), torch.cuda.stream(torch.cuda.Stream()):  # type: ignore[no-untyped-call]
            yield


def _moved(before: Any, after: Any) -> int | None:
    """How many epochs a scheduler moved (None where its epochs are not integers)."""
    if isinstance(before, int) and isinstance(after, int):
        return after - before
    return None


def _scheduler_why(marked: _Marked, epoch: Any, moves: int | None) -> str | None:
    """Why the scheduler's state is not that of the marked step, or None.

    A settled mark holds the step's epoch: any move since is the next step's. An unsettled
    one (a step's end found by the optimizer's hook) came before the script's ``sched.step()``
    for that step: the state is the step's once the scheduler moved as far as it did between
    the previous step's end and start (``moves``), and not while it is short of that (a fault
    between ``opt.step()`` and ``sched.step()``). In the attempt's first step nothing was
    learned yet, so a fault in that window keeps nothing."""
    if marked.settled:
        return None if epoch == marked.scheduler_epoch else \
            "the scheduler stepped since the step started"
    moved = _moved(marked.scheduler_epoch, epoch)
    if moved is None:  # epochs babysit cannot count: only no move is known to be the step's
        return None if epoch == marked.scheduler_epoch else \
            "the scheduler stepped since the step ended, and its epochs cannot be counted"
    if moves is None:
        return ("the step ended at optimizer.step() and the scheduler's step after it is not "
                "known yet (the attempt's first step)")
    if moved < moves:
        return "between optimizer.step() and the scheduler's step: the step is half done"
    if moved > moves:
        return "the scheduler stepped since the step ended"
    return None


_FORK_HOOKED = False


def _forget_in_children() -> None:
    """A process the rank forks (a DataLoader worker) starts with SIGTERM's default action, as
    it would have without babysit (a keeper's handler belongs to the rank alone). Once per
    process: fork hooks cannot be taken back, so the hook checks whose handler it finds."""
    global _FORK_HOOKED
    if _FORK_HOOKED:
        return
    _FORK_HOOKED = True

    def child() -> None:
        handler = signal.getsignal(signal.SIGTERM)
        if getattr(handler, "__self__", None).__class__ is Keeper:
            with contextlib.suppress(ValueError):
                signal.signal(signal.SIGTERM, signal.SIG_DFL)

    os.register_at_fork(after_in_child=child)


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:
        self._answer(lambda body: self.server.keeper.view() if self.path == contract.STATE
                     else None)

    def do_POST(self) -> None:
        keeper = self.server.keeper

        def act(body: dict[str, Any]) -> dict[str, Any] | None:
            if self.path == contract.WRITE:
                return keeper.write(str(body["dir"]), int(body["step"]), bool(body["model"]))
            if self.path == contract.RELEASE:
                threading.Timer(0.05, keeper.release).start()  # after the answer went out
                return {"ok": True}
            return None

        self._answer(act)

    def _answer(self, act: Callable[[dict[str, Any]], dict[str, Any] | None]) -> None:
        try:
            length = min(int(self.headers.get("Content-Length") or 0), 1 << 16)
            raw = self.rfile.read(length) if length else b""
        except ValueError:
            raw = b""
        if self.headers.get(contract.TOKEN_HEADER) != self.server.keeper._token:
            self._send(403, {"why": "wrong token"})
            return
        try:
            body = json.loads(raw or b"{}")
            answer = act(body)
        except (ValueError, KeyError, TypeError) as exc:
            self._send(400, {"why": str(exc)})
            return
        self._send(404, {"why": self.path}) if answer is None else self._send(200, answer)

    def _send(self, status: int, answer: dict[str, Any]) -> None:
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass  # the rank's log is the user's


class _Server(socketserver.ThreadingUnixStreamServer):
    """The keeper's socket, served by one thread that sleeps in ``select`` until a request
    comes (no timer: nothing wakes it while the rank trains) and a thread per request."""

    daemon_threads = True
    timeout = None
    keeper: Keeper
    _stopping = False
    _thread: threading.Thread

    def serve(self) -> None:
        while not self._stopping:
            self.handle_request()

    def stop(self) -> None:
        """End the serving thread at once (shutting the socket down wakes its ``select``) and
        free the socket's name."""
        self._stopping = True
        with contextlib.suppress(OSError):
            self.socket.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=1.0)
        self.server_close()


def _serve(address: str, keeper: Keeper) -> _Server:
    server = _Server(address, _Handler)
    server.keeper = keeper
    server._thread = threading.Thread(target=server.serve, name="babysit-keeper", daemon=True)
    server._thread.start()
    return server


def _cuda_event(model: Any) -> tuple[Any, Any]:
    """A CUDA event to record at each mark, and its device, when the model's parameters are on
    a GPU; (None, None) otherwise."""
    params = getattr(model, "parameters", None)
    first = next(iter(params()), None) if params is not None else None
    if first is None or not getattr(first, "is_cuda", False):
        return None, None
    import torch

    return torch.cuda.Event(), first.device  # type: ignore[no-untyped-call]


def _moves_buffers(model: Any) -> bool:
    """The model has layers whose forward updates running statistics in training (BatchNorm):
    after a forward since the mark, its buffers are no longer the step's."""
    from torch.nn.modules.batchnorm import _NormBase

    modules = getattr(model, "modules", None)
    return any(isinstance(m, _NormBase) and m.track_running_stats
               for m in (modules() if modules is not None else ()))


def _unsupported(model: Any) -> str | None:
    """Why this model's state cannot be written without collectives, or None."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    flat = getattr(fsdp, "FullyShardedDataParallel", None) if fsdp is not None else None
    modules = getattr(model, "modules", None)
    if flat is not None and modules is not None and any(isinstance(m, flat) for m in modules()):
        return ("FSDP1 (FullyShardedDataParallel) gathers its state dict with collectives; "
                "fully_shard (FSDP2) does not")
    return None
