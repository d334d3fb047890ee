"""What a preemption (SIGTERM) leaves behind: the final checkpoint, or why there is none.

The loop asks the ranks for a final checkpoint through the control file
(``{"final_checkpoint": id}``: "at the next step boundary you can all reach"; the ranks agree
on the step among themselves, ``babysit.supervisor.rank.saving``) and waits for it within
``checkpoints.final_grace_s``. When it does not come, the user must hear it, with the
checkpoint the next run will resume from: a silent loss of the last minutes of training is the
failure this module exists to prevent. Pure: the loop journals, prints and alerts the result.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from babysit.checkpoints import Catalog, Verdict


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


def request_id() -> str:
    """A fresh id for one final-checkpoint request (the ranks save once per id)."""
    return f"{time.time_ns():x}"


def missing_message(why: str, resume: Fallback) -> str:
    """The warning for a preemption without a final checkpoint: why, and what the next run
    resumes from."""
    return f"SIGTERM: no final checkpoint ({why}); {resume.describe()}"
