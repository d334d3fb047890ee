"""What a preemption (SIGTERM) leaves behind: the final checkpoint, or why there is none.

On SIGTERM the loop asks the ranks for a final checkpoint through the control file
(``{"final_checkpoint": id}``: "at the next step boundary you can all reach"; the ranks agree
on the step among themselves, ``babysit.supervisor.rank.saving``) and keeps ticking, reading
telemetry but judging nothing, until ``Preemption.tick`` says the wait is over: the checkpoint came,
``checkpoints.final_grace_s`` passed, or the workers exited. A step boundary every rank reaches
may never come (a rank stuck in a collective, in its data loader, stopped): then the live ranks'
just-in-time state of the last completed step stands in for the final checkpoint, where the
scheduler leaves time for it. When neither comes, the user must hear it, with the checkpoint the
next run will resume from: a silent loss of the last minutes of training is the failure this
module exists to prevent.
"""

from __future__ import annotations

import signal as signals
import time
from collections.abc import Callable
from dataclasses import dataclass
from signal import SIGINT, SIGTERM
from types import FrameType
from typing import Any

from babysit.checkpoints import Catalog, Verdict
from babysit.supervisor.config.schema import CheckpointConfig
from babysit.supervisor.node.last_step import Outcome


@dataclass(frozen=True, slots=True)
class Fallback:
    """The checkpoint a run resumes from when the final one is missing (None: from scratch)."""

    step: int | None
    path: str | None

    def describe(self) -> str:
        if self.step is None:
            return "the next run starts from scratch (no checkpoint)"
        return f"the next run resumes from the checkpoint of step {self.step} ({self.path})"


def fallback(catalog: Catalog) -> Fallback:
    """The newest checkpoint a taking-over run would resume from (good or pending, as
    ``Recovery.resume_latest`` chooses; not verified here). Never raises."""
    try:
        usable = [c for c in catalog.checkpoints()
                  if c.verdict in (Verdict.GOOD, Verdict.PENDING)]
    except OSError:
        usable = []
    if not usable:
        return Fallback(None, None)
    newest = max(usable, key=lambda c: c.step)
    return Fallback(newest.step, str(newest.path))


def unavailable(every_steps: int, grace_s: float) -> str | None:
    """Why a SIGTERM can get no final checkpoint under this config, or None when it can."""
    if not every_steps:
        return "checkpoints.every_steps is 0: babysit does not save this run"
    if grace_s <= 0:
        return "checkpoints.final_grace_s is 0"
    return None


def request_id() -> str:
    """A fresh id for one final-checkpoint request (the ranks save once per id)."""
    return f"{time.time_ns():x}"


def missing_message(why: str, resume: Fallback) -> str:
    """The warning for a preemption without a final checkpoint: why, and what the next run
    resumes from."""
    return f"SIGTERM: no final checkpoint ({why}); {resume.describe()}"


class Preemption:
    """The loop's answer to a stop signal. SIGTERM while the workers run starts a wait for a
    final checkpoint (``signal`` returns no stop yet; ``tick`` returns it once the wait is
    over); any other signal, or a SIGTERM that can get no checkpoint, stops at once. The run
    reads telemetry during the wait but judges nothing (``waiting``).

    Calling rules: on the loop's thread (the main thread), ``catch()`` once, then each tick
    ``take()`` (``signal()`` for the signal caught since the last one) and ``tick()``;
    ``hear()`` each journal entry of ``EVENTS``."""

    EVENTS = ("checkpoint_saved",)

    def __init__(self, config: CheckpointConfig, catalog: Catalog, *,
                 journal: Callable[..., None], log: Callable[[str], None],
                 warn: Callable[[str], None], request: Callable[..., None],
                 newest_step: Callable[[], int],
                 grace: Callable[[float], float] = lambda grace_s: grace_s,
                 keep: Callable[[str], Outcome | None] = lambda fault: None) -> None:
        """``grace``: the wait a SIGTERM leaves, given ``final_grace_s`` (under Slurm, what
        the job's end leaves: ``slurm_job.sigterm_grace``). ``keep``: the live ranks' last
        completed step written (``Members.keep_last_step``)."""
        self.config, self.catalog = config, catalog
        self._grace, self._keep = grace, keep
        self._journal, self._log, self._warn, self._request = journal, log, warn, request
        self._newest_step = newest_step
        self._deadline = 0.0
        self._grace_s = config.final_grace_s
        self._signum: int | None = None
        """The signal that stops the run once the wait is over (None: not waiting)."""
        self.saved: int | None = None
        """The final checkpoint's step, once a rank reported it."""
        self.caught: int | None = None
        """The stop signal caught since the last ``take()`` (``catch``)."""

    @property
    def waiting(self) -> bool:
        return self._signum is not None

    def catch(self) -> None:
        """From now on SIGINT and SIGTERM are caught, not fatal: ``caught`` until ``take()``."""
        for sig in (SIGINT, SIGTERM):
            signals.signal(sig, self._catch)

    def _catch(self, signum: int, frame: FrameType | None) -> None:
        self.caught = signum

    def take(self, now: float, running: bool) -> int | None:
        """The signal caught since the last tick, answered (``signal``); None when none was."""
        signum, self.caught = self.caught, None
        return None if signum is None else self.signal(signum, now, running)

    def signal(self, signum: int, now: float, running: bool) -> int | None:
        """A stop signal; the signal to stop with now, or None while a final checkpoint is
        awaited. ``running``: the workers are up and training (state RUNNING)."""
        if self.waiting:  # the wait goes on; the last signal is the one that ends it
            self._signum = signum
            return None
        if signum != SIGTERM or not running:
            return signum
        c = self.config
        grace_s = self._grace(c.final_grace_s) if c.final_grace_s > 0 else 0.0
        why = unavailable(c.every_steps, c.final_grace_s)
        if why is None and grace_s <= 0:
            why = "the scheduler kills the job before a checkpoint could be waited for"
        if why is not None:
            self._missing(why)
            return signum
        self._signum, self._deadline, self.saved = signum, now + grace_s, None
        self._grace_s = grace_s
        self._request(final_checkpoint=request_id())
        self._journal("final_checkpoint_requested", grace_s=grace_s,
                      newest_step=self._newest_step())
        cut = f", all the scheduler leaves of final_grace_s {c.final_grace_s:g} s" \
            if grace_s < c.final_grace_s else ""
        self._log(f"babysit: SIGTERM: asking for a final checkpoint at the next step every "
                  f"rank reaches (waiting up to {grace_s:g} s{cut})")
        return None

    def hear(self, entry: dict[str, Any]) -> None:
        data = entry.get("data")
        if self.waiting and isinstance(data, dict) and data.get("final"):
            self.saved = int(data.get("step", entry.get("step", 0)))

    def tick(self, now: float, running: bool) -> int | None:
        """The signal to stop with once the wait is over (the checkpoint came, the grace
        passed, or the workers exited: ``running`` is False); None otherwise."""
        signum = self._signum
        if signum is None or (self.saved is None and now < self._deadline and running):
            return None
        self._signum = None
        late = f"none arrived within {self._grace_s:g} s (checkpoints.final_grace_s = " \
            f"{self.config.final_grace_s:g} s)"
        kept = self._keep_instead() if self.saved is None and running else None
        self._journal("final_checkpoint", saved=self.saved is not None,
                      checkpoint_step=self.saved, just_in_time=kept is not None)
        if kept is not None:
            self._log(f"babysit: no final checkpoint ({late}): the just-in-time state of step "
                      f"{kept} stands in for it")
        elif self.saved is not None:
            self._log(f"babysit: final checkpoint saved at step {self.saved}")
        elif running:
            self._missing(late)
        else:
            self._missing("the workers exited first")
        return signum

    def _keep_instead(self) -> int | None:
        """The step of the live ranks' just-in-time state, written now in place of the final
        checkpoint that never came; None when there is none, or when the scheduler cut the
        wait (its SIGKILL leaves no time for the save)."""
        if self._grace_s < self.config.final_grace_s:
            return None
        outcome = self._keep("preemption")
        if outcome is None:
            return None
        event, fields = outcome.entry()
        self._journal(event, **fields)
        if not outcome.saved:
            return None
        self.saved = int(outcome.fields["checkpoint_step"])
        return self.saved

    def _missing(self, why: str) -> None:
        resume = fallback(self.catalog)
        # The checkpoint the next run resumes from (null: none, it starts from scratch).
        self._journal("final_checkpoint_missing", reason=why, checkpoint_step=resume.step,
                      path=resume.path)
        self._warn(missing_message(why, resume))
