"""The vocabulary shared by detectors, rules and the control loop.

Everything here is plain data: frozen dataclasses with no I/O, so detectors and ``decide()``
stay pure and their tests need no processes.

How a loss spike travels through these types::

    worker  run.step(loss=...)          -> RankStep        (one rank, one step; sent as a datagram)
    intake  all ranks of a step arrived -> StepRecord      (the step, merged)
    leader  all nodes' summaries merged -> SummaryRecord   (multi-node: a JobStep, no ranks)
    detector.observe(record)            -> Finding | None  (what is wrong, where, since when)
    rules.on_finding(finding, now)      -> Remedy          (what the policy says to do about it)
    decide(state, event)                -> Transition      (new state + side effects to perform)
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class RankStep:
    """One rank's report for one optimizer step, as the worker API sends it.

    Times are seconds. ``time`` is the worker's wall clock (``time.time()``) when the step was
    reported. Optional signals the script did not report are ``None``; a reported non-finite value
    stays non-finite (that is what the NaN detector looks for).
    """

    rank: int
    step: int
    time: float
    cursor: int = 0
    """Global batches consumed so far (data-cursor space, not step space)."""
    loss: float | None = None
    grad_norm: float | None = None
    lr: float | None = None
    tokens: float | None = None
    samples: float | None = None
    step_time: float | None = None
    """Seconds since this rank's previous report (None for the first step of an attempt)."""
    data_wait: float | None = None
    """Seconds of ``step_time`` spent waiting for the next batch."""
    forward_time: float | None = None
    """Seconds of the model's training forward passes in this step, timed by hooks ``attach()``
    puts on the model: a rank's own compute, free of the collectives of DDP's backward (not of
    FSDP's all-gathers, which make every rank wait for the slowest)."""
    skipped: bool = False
    """The worker skipped this optimizer step (grad-norm guard)."""


@dataclass(frozen=True, slots=True)
class StepRecord:
    """Every reporting rank's ``RankStep`` for one step, merged by the intake.

    Detectors of global signals (loss, throughput) observe these. ``ranks`` is ordered by rank and
    may miss ranks whose datagrams were dropped.
    """

    step: int
    time: float
    ranks: tuple[RankStep, ...]
    world_size: int
    flops_per_token: float | None = None
    """Model FLOPs per token of training (forward + backward, about 6 x parameters for a dense
    transformer), when the job declared it. Used only for ``mfu``."""
    peak_flops: float | None = None
    """Peak FLOP/s of ONE device (e.g. 989e12 for an H100's dense bf16), when declared."""

    @property
    def loss(self) -> float | None:
        """Mean loss over reporting ranks; NaN if any rank reported a non-finite loss."""
        return _mean([r.loss for r in self.ranks])

    @property
    def grad_norm(self) -> float | None:
        """Largest grad norm reported (they agree under data parallelism); NaN if any is
        non-finite."""
        values = [r.grad_norm for r in self.ranks if r.grad_norm is not None]
        if not values:
            return None
        if any(not math.isfinite(v) for v in values):
            return math.nan
        return max(values)

    @property
    def step_time(self) -> float | None:
        """Slowest rank's step time: the step as the job experiences it."""
        values = [r.step_time for r in self.ranks if r.step_time is not None]
        return max(values) if values else None

    @property
    def tokens(self) -> float | None:
        """Tokens processed by the whole job in this step."""
        values = [r.tokens for r in self.ranks if r.tokens is not None]
        return sum(values) if values else None

    @property
    def samples(self) -> float | None:
        """Samples the whole job processed in this step; None unless every rank reported it
        (a dropped report would count a smaller batch)."""
        values = [r.samples for r in self.ranks if r.samples is not None]
        return sum(values) if values and len(values) == self.world_size else None

    @property
    def tokens_per_s(self) -> float | None:
        """Tokens per second of the whole job: ``tokens / step_time``; None when either is not
        reported (or the step time is not a positive number)."""
        return tokens_per_s(self.tokens, self.step_time)

    @property
    def mfu(self) -> float | None:
        """Model FLOPs utilisation, a fraction of the job's peak: ``tokens_per_s x
        flops_per_token / (peak_flops x world_size)``. None unless every input was reported or
        declared: an absent input is never guessed."""
        return mfu(self.tokens_per_s, self.flops_per_token, self.peak_flops, self.world_size)

    @property
    def cursor(self) -> int:
        return max((r.cursor for r in self.ranks), default=0)

    @property
    def slowest_forward(self) -> Spread | None:
        """The slowest rank's forward time against the ranks' median; None below 2 ranks."""
        values = sorted((r.forward_time, r.rank) for r in self.ranks
                        if r.forward_time is not None and math.isfinite(r.forward_time))
        if len(values) < 2:
            return None
        top = max(values, key=lambda v: (v[0], -v[1]))  # the lowest rank on a tie
        return Spread(rank=top[1], value=top[0], median=values[(len(values) - 1) // 2][0],
                      count=len(values))

    @property
    def slowest_link(self) -> Spread | None:
        """The slowest node's network round trip against the nodes' median: None here, every
        rank on one node (a multi-node leader's ``SummaryRecord`` carries it)."""
        return None


@dataclass(frozen=True, slots=True)
class Spread:
    """One signal of one step over ranks: the slowest rank, its value, and the (lower) median
    of every rank's value, ``count`` ranks in all."""

    rank: int
    value: float
    median: float
    count: int


def tokens_per_s(tokens: float | None, step_time: float | None) -> float | None:
    """``tokens / step_time``; None when either is missing or the time is not positive."""
    if tokens is None or step_time is None or not math.isfinite(step_time) or step_time <= 0.0:
        return None
    return tokens / step_time


def mfu(rate: float | None, flops_per_token: float | None, peak_flops: float | None,
        world_size: int) -> float | None:
    """``rate x flops_per_token / (peak_flops x world_size)``; None unless every input is
    known (an absent input is never guessed)."""
    if rate is None or flops_per_token is None or peak_flops is None or peak_flops <= 0.0 \
            or world_size <= 0:
        return None
    return rate * flops_per_token / (peak_flops * world_size)


class JobStep(Protocol):
    """What a detector of a job-wide signal (loss spike, grad norm, throughput) reads of a step.

    ``StepRecord`` (every rank's report, one node) and
    ``babysit.supervisor.node.sketch.SummaryRecord`` (the nodes' summaries merged on the leader)
    both provide it, with the same meanings and the same ``None`` rules as ``StepRecord``'s
    properties. Per-rank detectors (non-finite, straggler, rank departure) need ``StepRecord.ranks``
    and do not take it.
    """

    @property
    def step(self) -> int: ...
    @property
    def time(self) -> float: ...
    @property
    def cursor(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def loss(self) -> float | None: ...
    @property
    def grad_norm(self) -> float | None: ...
    @property
    def step_time(self) -> float | None: ...
    @property
    def tokens(self) -> float | None: ...
    @property
    def samples(self) -> float | None: ...
    @property
    def tokens_per_s(self) -> float | None: ...
    @property
    def mfu(self) -> float | None: ...
    @property
    def slowest_forward(self) -> Spread | None: ...
    @property
    def slowest_link(self) -> Spread | None: ...


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    if not present:
        return None
    if any(not math.isfinite(v) for v in present):
        return math.nan
    return sum(present) / len(present)


class Severity(enum.IntEnum):
    """How loud a finding is. Alert sinks route on it; ordering matters (``>=`` comparisons)."""

    INFO = 10
    WARNING = 20
    CRITICAL = 30


class Incident(str, enum.Enum):
    """The kinds of trouble babysit knows. Policies map each one to an action ladder."""

    LOSS_SPIKE = "loss_spike"
    NONFINITE = "nonfinite"
    GRAD_SPIKE = "grad_spike"
    HANG = "hang"
    CRASH = "crash"
    STRAGGLER = "straggler"
    THROUGHPUT = "throughput"
    RANK_DEPARTURE = "rank_departure"
    """One rank's loss moved away from its own past while its peers' did not."""
    SDC = "sdc"
    """Silent data corruption: ranks that must compute identical bits (parameter digests, a
    fixed probe) disagree."""
    NODE_LOST = "node_lost"
    """A node of a multi-node run vanished: its babysitter's connection closed or fell silent."""
    NODE_JOINED = "node_joined"
    """A node joined (or came back to) a multi-node run that runs on fewer nodes than it may:
    the job can grow back. Not trouble: an opportunity, taken at a checkpoint."""
    SLOW_NODE = "slow_node"
    """A node whose compute or link lags the others' for minutes, and keeping it costs the job
    more than a relaunch without it: taken out at the next checkpoint."""
    GPU_FAULT = "gpu_fault"
    """A GPU of a node reported a fault of the machine through NVML: new uncorrectable ECC
    errors, or an Xid of the hardware's (fallen off the bus, NVLink, row remapping, ...)."""
    RESUME = "resume"
    """A resume that did not take: a rank's parameters at its first step are not the ones its
    checkpoint restored (weights loaded over them after ``attach()``)."""


def r4(x: float) -> float:
    """Evidence numbers are for people: four significant digits are plenty."""
    return float(f"{x:.4g}")


@dataclass(frozen=True, slots=True)
class Finding:
    """A detector's verdict that something is wrong.

    ``step`` is where it was detected; ``onset_step`` is where the trouble began (rollback targets
    the newest good checkpoint strictly before the onset, not the detection). ``evidence`` holds
    the numbers a person needs to agree with the verdict; it must be JSON-serialisable.
    """

    incident: Incident
    detector: str
    severity: Severity
    step: int
    onset_step: int
    message: str
    ranks: tuple[int, ...] = ()
    evidence: dict[str, Any] = field(default_factory=dict)
    onset_cursor: int | None = None
    """Data cursor (global batches consumed) at the onset, when the detector knows it; rollback
    skip ranges and the "same region again" escalation are measured in cursor space."""

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Finding:
        """The inverse of ``to_json`` (a journal entry read back by a supervisor taking over)."""
        return cls(
            incident=Incident(d["incident"]), detector=str(d["detector"]),
            severity=Severity[str(d["severity"]).upper()], step=int(d["step"]),
            onset_step=int(d["onset_step"]), message=str(d["message"]),
            ranks=tuple(int(r) for r in d.get("ranks", ())),
            evidence=dict(d.get("evidence", {})),
            onset_cursor=None if d.get("onset_cursor") is None else int(d["onset_cursor"]),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "incident": self.incident.value,
            "detector": self.detector,
            "severity": self.severity.name.lower(),
            "step": self.step,
            "onset_step": self.onset_step,
            "onset_cursor": self.onset_cursor,
            "ranks": list(self.ranks),
            "message": self.message,
            "evidence": self.evidence,
        }


class Action(str, enum.Enum):
    """What a policy can tell babysit to do about a finding."""

    IGNORE = "ignore"
    """Journal it, nothing else (inside a cooldown, or below the policy's threshold)."""
    ALERT = "alert"
    """Tell a human; training continues untouched."""
    SKIP_STEP = "skip_step"
    """Worker-side: skip this optimizer step in-process, no restart."""
    RELAUNCH = "relaunch"
    """Stop the workers and start a new attempt from the newest good checkpoint."""
    ROLLBACK = "rollback"
    """Relaunch from the newest good checkpoint before the onset, skipping batches, lower LR."""
    STOP = "stop"
    """Stop the workers, page a human, exit non-zero."""


@dataclass(frozen=True, slots=True)
class Remedy:
    """The policy's answer to one finding: an action and its parameters.

    ``skip_before``/``skip_after`` are in data-cursor batches around the onset (rollback only);
    ``lr_scale`` multiplies the run's LR scale; ``lr_rewarm`` is the steps (batches) past the
    skipped ones over which that cut wears off again, None when it stays (the same region
    spiked again); ``backoff_s`` is how long to wait before a relaunch. ``reason`` says in words why
    this rung of the ladder was chosen.
    """

    action: Action
    finding: Finding
    reason: str
    skip_before: int = 0
    skip_after: int = 0
    lr_scale: float = 1.0
    backoff_s: float = 0.0
    lr_rewarm: int | None = None

    @classmethod
    def from_json(cls, d: dict[str, Any], finding: Finding) -> Remedy:
        """The inverse of ``to_json``, given the finding it answered."""
        return cls(
            action=Action(d["action"]), finding=finding, reason=str(d["reason"]),
            skip_before=int(d.get("skip_before", 0)), skip_after=int(d.get("skip_after", 0)),
            lr_scale=float(d.get("lr_scale", 1.0)), backoff_s=float(d.get("backoff_s", 0.0)),
            lr_rewarm=None if d.get("lr_rewarm") is None else int(d["lr_rewarm"]),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "action": self.action.value,
            "reason": self.reason,
            "skip_before": self.skip_before,
            "skip_after": self.skip_after,
            "lr_scale": self.lr_scale,
            "lr_rewarm": self.lr_rewarm,
            "backoff_s": self.backoff_s,
        }
