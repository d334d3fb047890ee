"""The ranks and their torchrun kept from a scheduler's SIGTERM, so that it reaches babysit first.

Slurm signals every process of a step, not only its task: the SIGTERM of ``--signal`` before the
time limit, of ``scancel``, of the time limit itself reaches babysit, torchrun and every rank at
once (``proctrack`` finds them all). torchrun handles SIGTERM by stopping its workers, and a rank
without a handler of its own dies of it: the ranks would be gone before babysit could ask them
for the final checkpoint it waits ``checkpoints.final_grace_s`` for. So under ``srun`` (and where
torchrun lets a signal alone: ``--signals-to-handle``, torch 2.9 and later):

- torchrun and the ranks start with SIGTERM ignored (inherited across ``exec``; a script that
  sets its own SIGTERM handler still gets it), and torchrun is told to handle only SIGINT,
  SIGHUP and SIGQUIT;
- babysit stops them with SIGHUP instead (torchrun forwards it to its workers; a rank dies of it
  as it would of SIGTERM), then SIGKILL as before.

Slurm's SIGKILL, ``KillWait`` seconds after its SIGTERM, still ends everything.
"""

from __future__ import annotations

import functools
import importlib.util
import signal
from collections.abc import Callable
from pathlib import Path

from babysit.supervisor.config import slurm

SIGNALS_TO_HANDLE = "SIGINT,SIGHUP,SIGQUIT"
"""What torchrun handles under a shield: its defaults but SIGTERM."""


@functools.cache
def torchrun_can() -> bool:
    """This interpreter's torchrun takes ``--signals-to-handle`` (read from its source, without
    importing torch)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return False
    try:
        text = (Path(spec.origin).parent / "distributed" / "run.py").read_text()
    except OSError:
        return False
    return "--signals-to-handle" in text


def shielded() -> bool:
    """The workers babysit starts now are shielded: it runs under ``srun`` and torchrun can
    let SIGTERM alone."""
    return slurm.under_srun() and torchrun_can()


def stop_signal() -> signal.Signals:
    """The signal babysit stops its workers with: SIGHUP when they ignore SIGTERM."""
    return signal.SIGHUP if shielded() else signal.SIGTERM


def ignore_sigterm() -> None:
    """``preexec_fn`` of a shielded torchrun: SIGTERM ignored, for it and every rank it
    starts; SIGHUP, the stop, at its default (babysit itself may have been started with SIGHUP
    ignored, by ``nohup``: its tree would then ignore the stop too). Also of the Slurm commands
    babysit runs inside a job (``run.slurm_job``), which must outlive the job's SIGTERM."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def preexec() -> Callable[[], None] | None:
    """What a worker tree's ``Popen`` runs in the child before ``exec`` (None: nothing)."""
    return ignore_sigterm if shielded() else None


def torchrun_args(given: list[str]) -> list[str]:
    """torchrun's options for a shielded tree, unless the user gave their own."""
    if any(a.split("=", 1)[0] in ("--signals-to-handle", "--signals_to_handle") for a in given):
        return []
    return ["--signals-to-handle", SIGNALS_TO_HANDLE]
