"""The resume directive: what the supervisor tells every rank of a new attempt.

The supervisor writes one JSON file per attempt (``attempts/<n>/directive.json``) before it
launches the workers and passes its path in ``BABYSIT_DIRECTIVE``. Workers only read it. It says
where to resume from, which data-cursor ranges to skip and how much to scale the LR, so a rollback
needs no cooperation from the training script beyond the worker API.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

CONTROL_FILE = "control.json"
"""Beside ``directive.json``: the supervisor's requests to the running attempt, one JSON object.

Each rank ``stat``s it between steps and re-reads it whenever it changes (``saving.Checkpointer``).
The supervisor writes it whole and atomically (temp file + ``os.replace``), and every key is
optional; both may be present:

- ``"final_checkpoint": ID``: save one checkpoint at the next step boundary every rank can
  still reach (before a preemption). The ranks agree on the step themselves: rank 0 publishes
  the step after the boundary where it read the request in the job's c10d store, and the others
  look it up (``rank.saving.Checkpointer``). Once per ID; the save is announced with
  ``final: true`` and never left in flight.
- ``"checkpoint_at_step": N``: save a checkpoint at step N as well as on the cadence. Only the
  current version counts: a version without it asks for nothing.
- ``"checkpoint_every": K, "from_step": S``: from step S on, save at each step that is a multiple
  of K (K >= 1); steps before S keep the cadence they had. The change persists until another one
  replaces it, even when a later version of the file leaves these keys out. Without
  ``from_step`` it applies from the step after the one at which the file was read.

Ranks read the file at different moments, yet every save is collective, so both steps must be
ones no rank has reached yet when the file is written: ahead of the newest step reported by more
than the ranks' spread plus the telemetry lag. Write a new cadence only after every rank passed
the previous change's ``from_step``: a rank that never saw that change would disagree about the
steps between. Library saves must be on in the directive (``checkpoint_every`` > 0) for any of
this to apply. The file is per attempt; a new attempt starts from its directive's cadence.
"""

CLOSED_DIR = "closed"
"""Beside ``directive.json``: ``closed/<rank>.json`` (``{"rank", "world_size", "step"}``) is
written by each rank whose ``run.close()`` ran, so a supervisor that was not listening (killed
while the job trained on) can tell that the attempt finished."""


def closed_ranks(attempt_dir: Path) -> dict[int, dict[str, Any]]:
    """Rank -> its ``closed`` record in ``attempt_dir`` (unreadable records are left out)."""
    out: dict[int, dict[str, Any]] = {}
    for path in (attempt_dir / CLOSED_DIR).glob("*.json"):
        try:
            record = json.loads(path.read_text())
            out[int(record["rank"])] = record
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


@dataclass(frozen=True, slots=True)
class SkipRange:
    """Global batches ``start <= cursor < end`` are not trained on.

    ``samples``: the same batches as a span of the data stream, ``[first, end)`` samples
    consumed (``rank/elastic_data.py``), when the attempt that met them drew its data with an
    ``ElasticSampler``. A rank drawing with one skips the global batches of *its* world size
    that hold those samples; the cursors are then only what the attempt that met them counted
    (another world size counts other batches)."""

    start: int
    end: int
    samples: tuple[int, int] | None = None

    def __contains__(self, cursor: object) -> bool:
        return isinstance(cursor, int) and self.start <= cursor < self.end

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> SkipRange:
        """A range as ``asdict`` wrote it (a directive, a journal entry; ``samples`` optional)."""
        span = obj.get("samples")
        return cls(int(obj["start"]), int(obj["end"]),
                   (int(span[0]), int(span[1])) if span else None)


@dataclass(frozen=True, slots=True)
class Resume:
    """A committed checkpoint to restore before the first step.

    ``external``: the script saved it itself (``run.checkpoint_saved``) and ``path`` is what it
    saved; otherwise ``path`` is babysit's checkpoint folder, restored by ``attach()``.
    """

    path: str
    step: int
    cursor: int
    external: bool = False
    samples: int | None = None
    """Samples of the data stream consumed at ``cursor`` (``ElasticSampler``), if counted."""
    memory: str | None = None
    """A memory copy (``checkpoints/memory.py``): ``path`` is its manifest's folder in the
    checkpoint root, and this its folder in the node's shared memory (each node's own,
    written into the directive by the node)."""
    verified_on: int | None = None
    """A memory copy's: the node whose supervisor checked the files it holds byte for byte
    when it chose the copy (its ranks need not check them again as they load)."""


@dataclass(frozen=True, slots=True)
class LrRamp:
    """A rollback's temporary LR cut, in data-cursor space. Up to cursor ``cut`` (where the
    skipped batches begin) the scale is ``to``: the replayed steps before the bad region trained
    well the first time. Past it the directive's ``lr_scale`` holds until ``start`` (the end of
    the skipped batches), then moves linearly back to ``to`` by ``end``, and stays there.

    ``samples``: ``cut``, ``start`` and ``end`` as samples of the data stream, when the attempt
    that planned it drew with an ``ElasticSampler`` (as ``SkipRange.samples``): a rank drawing
    with one places the ramp in its own world size's batches."""

    cut: int
    start: int
    end: int
    to: float
    samples: tuple[int, int, int] | None = None

    def bare(self) -> LrRamp:
        """The ramp in the planning attempt's batches only (what the plan compares)."""
        return LrRamp(self.cut, self.start, self.end, self.to)

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> LrRamp:
        span = obj.get("samples")
        return cls(int(obj["cut"]), int(obj["start"]), int(obj["end"]), float(obj["to"]),
                   (int(span[0]), int(span[1]), int(span[2])) if span else None)


@dataclass(frozen=True, slots=True)
class Directive:
    """Everything a rank needs to know about the attempt it belongs to."""

    attempt: int = 0
    resume: Resume | None = None
    skip: tuple[SkipRange, ...] = ()
    lr_scale: float = 1.0
    """Multiplies every param group's LR at each optimizer step (schedulers never see it); with
    ``lr_ramp``, the scale until the ramp starts."""
    lr_ramp: LrRamp | None = None
    """The re-warm after a rollback's LR cut: see ``scale_at``."""
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    """Save a checkpoint every N steps through the worker API; 0 disables library saves."""
    checkpoint_async: bool = False
    grad_guard: dict[str, Any] = field(default_factory=dict)
    """Settings of the in-process grad-norm guard; empty disables it."""
    sdc_every: int = 0
    """Send the silent-data-corruption digests every N steps (``sdc.every_steps``); 0: off."""
    reshard: bool = False
    """The job may resume at another world size than its checkpoint's: an elastic multi-node
    run (``launch.nnodes`` MIN:MAX) relaunched on the nodes it has (``checkpoints.load``)."""
    save_at: int | None = None
    """Save a checkpoint when the data cursor reaches this, whatever the cadence, and wait for
    it to commit: a rerun's, where the data's remedy would skip from (``policies/rerun.py``),
    so that remedy need not train the same steps a third time."""
    just_in_time: dict[str, Any] = field(default_factory=dict)
    """Keep the last completed step for a just-in-time checkpoint (``rank/keeper.py``):
    ``marks``, the folder of the ranks' mark files, and ``hold_s``, how long a rank that is
    ending waits for its node; empty: off."""
    memory: dict[str, Any] = field(default_factory=dict)
    """Copy the state every few steps into the node's shared memory (``checkpoints/memory.py``):
    ``root``, the node's folder, and ``every``, the steps between copies; empty: off."""
    lineage: tuple[tuple[str, int | None], ...] = ()
    """The attempt's timeline and its chain back to the run's root (``checkpoints/lineage.py``):
    ``(timeline, limit)`` links, this attempt's first. Every state the ranks keep records the
    first; a memory copy off the chain is swept from the node. Empty: none recorded."""

    @property
    def timeline(self) -> str | None:
        """The timeline this attempt's states belong to (None: none recorded)."""
        return self.lineage[0][0] if self.lineage else None

    def scale_at(self, cursor: int) -> float:
        """The LR scale of the optimizer step that trains on the batch before data cursor
        ``cursor`` (global batches consumed so far): ``lr_scale``, moving to ``lr_ramp.to``
        over the ramp. Pure and cheap: the rank calls it every step."""
        ramp = self.lr_ramp
        if ramp is None:
            return self.lr_scale
        if cursor <= ramp.cut:
            return ramp.to
        if cursor <= ramp.start:
            return self.lr_scale
        if cursor >= ramp.end:
            return ramp.to
        return self.lr_scale + (ramp.to - self.lr_scale) * (cursor - ramp.start) / (
            ramp.end - ramp.start)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        # Spans in samples only where the ranks drew with an ElasticSampler.
        for item in [*out["skip"], *([out["lr_ramp"]] if out["lr_ramp"] else [])]:
            if item["samples"] is None:
                del item["samples"]
        return out

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Directive:
        resume = obj.get("resume")
        return cls(
            attempt=int(obj.get("attempt", 0)),
            resume=Resume(**resume) if resume else None,
            skip=tuple(SkipRange.from_json(s) for s in obj.get("skip", ())),
            lr_scale=float(obj.get("lr_scale", 1.0)),
            lr_ramp=LrRamp.from_json(ramp) if (ramp := obj.get("lr_ramp")) else None,
            checkpoint_dir=obj.get("checkpoint_dir"),
            checkpoint_every=int(obj.get("checkpoint_every", 0)),
            checkpoint_async=bool(obj.get("checkpoint_async", False)),
            grad_guard=dict(obj.get("grad_guard", {})),
            sdc_every=int(obj.get("sdc_every", 0)),
            reshard=bool(obj.get("reshard", False)),
            save_at=None if obj.get("save_at") is None else int(obj["save_at"]),
            just_in_time=dict(obj.get("just_in_time", {})),
            memory=dict(obj.get("memory", {})),
            lineage=tuple((str(t), None if limit is None else int(limit))
                          for t, limit in obj.get("lineage", ())),
        )

    def write(self, path: Path) -> None:
        """Write atomically: a rank that starts early must never read half a file."""
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=2))
        os.replace(tmp, path)

    @classmethod
    def read(cls, path: str | Path) -> Directive:
        return cls.from_json(json.loads(Path(path).read_text()))


def merge_skips(ranges: list[SkipRange]) -> tuple[SkipRange, ...]:
    """Sort and coalesce overlapping or touching ranges, so the worker checks each once. Two
    ranges with sample spans merge when the spans overlap or touch too; a range with a span and
    one without stay apart (a rank may skip them in different units; overlaps are harmless)."""
    merged: list[SkipRange] = []
    for r in sorted(ranges, key=lambda r: r.start):
        last = merged[-1] if merged else None
        if last is not None and r.start <= last.end and _spans_merge(last.samples, r.samples):
            span = None if r.samples is None or last.samples is None else (
                min(last.samples[0], r.samples[0]), max(last.samples[1], r.samples[1]))
            merged[-1] = SkipRange(last.start, max(last.end, r.end), span)
        else:
            merged.append(r)
    return tuple(merged)


def _spans_merge(a: tuple[int, int] | None, b: tuple[int, int] | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a[0] <= b[1] and b[0] <= a[1]
