"""A resume whose data position means other samples: the global batch changed across it.

babysit's data cursor counts global batches (``Run.batches``): a checkpoint saved at cursor C
says "C global batches consumed". That is a position in the data only while a global batch
holds the same number of samples. A relaunch on another world size (a node lost or evicted
with no spare, a node back) changes it when each rank keeps its own batch size: 3 ranks of 4
samples consumed 12 C samples by cursor C; 2 ranks of 4 that seek to global batch C start at
sample 8 C, and train on 4 C samples a second time (the other way round, skip them). Keeping
the global batch fixed (each rank's batch = global / world size, or gradient accumulation) is
what makes a resized resume exact, and keeps the optimiser's hyperparameters right as well.

A script that draws its batches with ``ElasticSampler`` (``rank/elastic_data.py``) keeps its
own batch size and still resumes at the right sample: the checkpoint records the samples
consumed at its cursor. Its global batch changes all the same, and with it what the learning
rate was tuned for: the finding says so, without the data's part.

This check holds the first steps of a resumed attempt against the steps up to its checkpoint:
each step's samples (the sum of every rank's ``run.step(samples=...)``, only at steps every
rank reported) per global batch the cursor moved. When the two medians differ, a WARNING
finding of ``Incident.RESUME`` (policy ``incidents.resume``: below its ``act_on``, so an
alert) says by how much and what a loader that seeks by global batch did to the data. It says
nothing when the script does not report samples, or the steps up to the checkpoint are no
longer remembered.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import statistics
from collections import OrderedDict

from babysit.policies.types import Finding, Incident, JobStep, Severity

MEMORY = 4096
"""Steps whose global batch is remembered (a resume goes back at most a checkpoint interval)."""
SEEN = 3
"""Steps of a resumed attempt whose median global batch is compared, and of those before."""
STATE_RUNS = 256
"""Runs of steps alike kept in the journaled state (``GlobalBatch.state_dict``)."""


class GlobalBatch:
    """Samples per global batch of recent steps (``observe`` each merged step, in order)."""

    def __init__(self, memory: int = MEMORY) -> None:
        self._memory = memory
        self._by_step: OrderedDict[int, tuple[float, int]] = OrderedDict()
        """step -> (samples per global batch, world size), the newest pass of each step last."""
        self._last: tuple[int, int] | None = None

    def observe(self, record: JobStep) -> tuple[float, int] | None:
        """Remember ``record``'s global batch; return it, or None when it cannot be told: no
        samples reported (or not by every rank), not the step after the last one observed, or
        a cursor that did not move."""
        last, self._last = self._last, (record.step, record.cursor)
        samples = record.samples
        if samples is None or samples <= 0 or last is None or record.step != last[0] + 1 \
                or record.cursor <= last[1]:
            return None
        batch = (samples / (record.cursor - last[1]), record.world_size)
        self._by_step.pop(record.step, None)
        self._by_step[record.step] = batch
        while len(self._by_step) > self._memory:
            self._by_step.popitem(last=False)
        return batch

    def new_attempt(self) -> None:
        """A relaunch: its first step follows no step observed."""
        self._last = None

    def state_dict(self) -> list[list[float]]:
        """Its memory, as runs of consecutive steps alike: ``[first, last, batch, world]``
        (a job that keeps its global batch is one run per resize, a few hundred bytes, where
        step by step it was 4096 entries): journaled with the watch, so a supervisor taking
        over still checks the next resume's data. The newest ``STATE_RUNS`` runs: a global
        batch that changes every step (batches packed by tokens) keeps that many steps."""
        runs: list[list[float]] = []
        for step, (batch, world) in sorted(self._by_step.items()):
            if runs and runs[-1][1] == step - 1 and runs[-1][2:] == [batch, world]:
                runs[-1][1] = step
            else:
                runs.append([step, step, batch, world])
        return runs[-STATE_RUNS:]

    def load_state_dict(self, runs: list[list[float]]) -> None:
        self._by_step = OrderedDict(
            (step, (float(batch), int(world)))
            for first, last, batch, world in runs for step in range(int(first), int(last) + 1))
        while len(self._by_step) > self._memory:
            self._by_step.popitem(last=False)
        self._last = None

    def before(self, step: int) -> tuple[float, int] | None:
        """The median global batch of the last ``SEEN`` remembered steps at or before ``step``
        (with the world size of the newest of them), or None."""
        kept = sorted((s, b) for s, b in self._by_step.items() if s <= step)[-SEEN:]
        if not kept:
            return None
        return statistics.median(b for _, (b, _) in kept), kept[-1][1][1]


class ResumeData:
    """One resumed attempt's check: ``observe`` its steps' global batches (``GlobalBatch``)."""

    name = "resume_data"

    def __init__(self, checkpoint_step: int, cursor: int | None, batch: float,
                 world: int, samples: int | None = None) -> None:
        self.checkpoint_step, self.cursor = checkpoint_step, cursor
        self.batch, self.world = batch, world
        self.samples = samples
        """The samples of the data stream the checkpoint recorded at its cursor (the job's
        loader counts them: ``ElasticSampler``), or None."""
        self.seen: list[float] = []
        self.done = False

    @classmethod
    def start(cls, memory: GlobalBatch, checkpoint_step: int | None,
              cursor: int | None, samples: int | None = None) -> ResumeData | None:
        """The check of an attempt resumed from ``checkpoint_step`` (at data ``cursor`` and,
        when counted, ``samples``), or None: a fresh start, or no global batch remembered up to
        the checkpoint."""
        if checkpoint_step is None:
            return None
        before = memory.before(checkpoint_step)
        return cls(checkpoint_step, cursor, *before, samples=samples) \
            if before is not None else None

    def observe(self, step: int, batch: tuple[float, int] | None) -> Finding | None:
        """A step of the resumed attempt and its global batch (None: not told); the finding
        once ``SEEN`` of them differ from the checkpoint's (then it judges no more)."""
        if self.done or batch is None or step <= self.checkpoint_step:
            return None
        self.seen.append(batch[0])
        if len(self.seen) < SEEN:
            return None
        self.done = True
        now = statistics.median(self.seen)
        if abs(now - self.batch) <= 1e-6 * self.batch:
            return None
        s, c, was = self.checkpoint_step, self.cursor, self.batch
        changed = (f"resume from step {s}: a global batch was {was:.6g} samples at "
                   f"{self.world} ranks, it is {now:.6g} now at {batch[1]}")
        if self.samples is not None:
            # The loader counts samples: the data goes on exactly; the optimizer's batch did not.
            message = (f"{changed}; the checkpoint recorded sample {self.samples} of the "
                       "data stream, where an ElasticSampler goes on, none skipped or "
                       "repeated; but the optimizer now steps "
                       f"on {now / was:.3g}x the samples its learning rate was set for (scale "
                       "the LR, or keep the global batch fixed: each rank's batch = global / "
                       "world size, or accumulate)")
        else:
            where = "" if c is None else (
                f": a loader that seeks to global batch {c} by its own batch size starts at "
                f"sample {c * now:.0f}, not {c * was:.0f}, and "
                + (f"trains on {c * (was - now):.0f} samples a second time" if now < was
                   else f"never trains on {c * (now - was):.0f} samples"))
            message = (f"{changed}; babysit's data cursor counts global batches{where} (keep "
                       "the global batch fixed across world sizes: each rank's batch = global "
                       "/ world size, or accumulate; or draw batches with babysit's "
                       "ElasticSampler, which counts samples)")
        return Finding(
            incident=Incident.RESUME, detector=self.name, severity=Severity.WARNING, step=step,
            onset_step=s + 1, ranks=(), message=message,
            evidence={"checkpoint_step": s, "cursor": c, "batch_before": was,
                      "world_before": self.world, "batch_now": now, "world_now": batch[1],
                      "samples": self.samples})
