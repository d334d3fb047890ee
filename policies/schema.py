"""The policy schema, declared once: what babysit watches and what it does about it.

A policy is YAML validated by these models. Every field has a docstring (it becomes the JSON
schema's description, so ``babysit schema`` and the docs read the same words); unknown keys are
errors. Built-in policies live next to this file (``default.yaml``, ``conservative.yaml``,
``aggressive.yaml``); ``load_policy`` in ``policies/loader.py`` reads them.

Layout::

    detectors:   per-detector settings (declared next to each detector)
    incidents:   per-incident response: action ladder, cooldowns, when the ladder resets
    rollback:    what a rollback skips and how it escalates when a region spikes again
    crash:       relaunch limits per crash class, backoff, stop on a deterministic repeat
    budget:      at most N disruptive interventions in W seconds, else stop and page
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from babysit.policies.detectors import (
    GradNormConfig,
    HangConfig,
    LossSpikeConfig,
    NonFiniteConfig,
    RankDepartureConfig,
    ResumeLossConfig,
    SdcConfig,
    SlowComputeConfig,
    SlowLinkConfig,
    StragglerConfig,
    ThroughputConfig,
)
from babysit.policies.section import Section
from babysit.policies.types import Action


class Detectors(Section):
    """Settings of each detector; see the detector modules for how each one decides."""

    loss_spike: LossSpikeConfig = LossSpikeConfig()
    """Loss breaks out of its robust moving baseline (policies/detectors/loss_spike.py)."""
    nonfinite: NonFiniteConfig = NonFiniteConfig()
    """Any rank reports a NaN/Inf loss or grad norm."""
    grad_norm: GradNormConfig = GradNormConfig()
    """Grad norm far above its moving median (also run in-process by the worker)."""
    hang: HangConfig = HangConfig()
    """No progress for longer than an adaptive allowance."""
    straggler: StragglerConfig = StragglerConfig()
    """One rank's own work persistently slower than its peers'."""
    throughput: ThroughputConfig = ThroughputConfig()
    """Steps/s, tokens/s or MFU persistently below the moving baseline."""
    slow_compute: SlowComputeConfig = SlowComputeConfig()
    """One rank's (or node's) forward time lagging the others' for minutes: a slow machine
    (policies/detectors/slow_compute.py); on a multi-node run its node may be evicted."""
    slow_link: SlowLinkConfig = SlowLinkConfig()
    """One node's network round trip (as the leader's kernel measures its babysitter's
    connection) lagging the other nodes' for minutes: a slow link
    (policies/detectors/slow_link.py); its node may be evicted. Multi-node runs of three or
    more nodes only."""
    rank_departure: RankDepartureConfig = RankDepartureConfig()
    """One rank's loss leaves its own level while its peers' stay
    (policies/detectors/rank_departure.py)."""
    sdc: SdcConfig = SdcConfig()
    """Per-rank parameter and probe digests that must agree (policies/detectors/sdc.py)."""
    resume_loss: ResumeLossConfig = ResumeLossConfig()
    """After a resume, the first steps' loss against what the run recorded at the
    checkpoint's step: far above, the restore did not take (policies/detectors/resume_loss.py)."""


class Response(Section):
    """How babysit answers one kind of incident."""

    ladder: list[Action] = Field(min_length=1)
    """Actions for successive interventions: the first finding gets ladder[0], the next one
    ladder[1], ...; past the end the last rung repeats."""
    act_on: Literal["warning", "critical"] = "critical"
    """Findings at or above this severity climb the ladder."""
    below: Action = Action.ALERT
    """What findings below act_on get (alert or ignore)."""
    cooldown_s: float = Field(default=0.0, ge=0.0)
    """After an intervention, further findings of this incident within this many seconds are
    only journaled."""
    cooldown_steps: int = Field(default=0, ge=0)
    """...or within this many steps after the intervention's step. Steps replayed after a
    rollback are earlier than the intervention, so a spike that comes back in the replayed
    region is never swallowed by the cooldown."""
    reset_after_steps: int | None = Field(default=None, ge=1)
    """The ladder goes back to its first rung when a finding comes this many steps after the
    last intervention (None: never by steps)."""
    reset_after_s: float | None = Field(default=None, gt=0.0)
    """...or this many seconds after it (None: never by time)."""

    @model_validator(mode="after")
    def _sensible_below(self) -> Response:
        if self.below not in (Action.ALERT, Action.IGNORE):
            raise ValueError(f"below must be alert or ignore, not {self.below.value}: findings "
                             "under act_on are not worth an intervention")
        return self


def _ladder(*actions: Action, **kw: object) -> Response:
    return Response.model_validate({"ladder": list(actions), **kw})


A = Action


class Incidents(Section):
    """Per-incident responses. Crashes are configured under ``crash`` instead."""

    loss_spike: Response = _ladder(A.ROLLBACK, A.ROLLBACK, A.ROLLBACK, A.STOP,
                                   reset_after_steps=2000)
    """A loss spike that did not recover within the detector's patience."""
    nonfinite: Response = _ladder(A.ROLLBACK, A.ROLLBACK, A.STOP, cooldown_steps=100,
                                  reset_after_steps=2000)
    """NaN/Inf loss or grad norm (it fires every step it lasts: the cooldown absorbs that)."""
    grad_spike: Response = _ladder(A.SKIP_STEP, A.SKIP_STEP, A.SKIP_STEP, A.ROLLBACK, A.STOP,
                                   act_on="warning", reset_after_steps=200)
    """Grad-norm spikes: the worker skips the step; repeated spikes escalate to a rollback."""
    hang: Response = _ladder(A.RELAUNCH, A.RELAUNCH, A.STOP, reset_after_s=3600.0)
    """No progress: dump stacks, kill the group, relaunch from the newest good checkpoint."""
    straggler: Response = _ladder(A.ALERT, act_on="warning", cooldown_s=600.0)
    """A rank lagging its peers: tell a human."""
    throughput: Response = _ladder(A.ALERT, act_on="warning", cooldown_s=600.0)
    """The job got slower: tell a human."""
    rank_departure: Response = _ladder(A.ALERT, act_on="warning", cooldown_s=600.0)
    """One rank's loss left its own level (a bad shard, a bad GPU): tell a human, naming it."""
    sdc: Response = _ladder(A.ROLLBACK, A.STOP)
    """Replicas disagree on bits they must share: roll back to before the last agreeing check
    (no batches skipped, LR kept: the data is fine, the hardware is not); again -> stop."""
    node_lost: Response = _ladder(A.RELAUNCH, A.RELAUNCH, A.STOP, reset_after_s=3600.0)
    """A node's babysitter vanished (multi-node runs): relaunch from the newest good checkpoint
    on the nodes left when ``launch.nnodes`` (MIN:MAX) allows that few, else wait for the lost
    node to rejoin (``nodes.rejoin_timeout_s``), paging a human; stop to never relaunch."""
    node_joined: Response = _ladder(A.RELAUNCH, act_on="warning")
    """A node joined a multi-node run that runs on fewer nodes than ``launch.nnodes`` allows
    (a lost node back, a new one): once the attempt has saved its next checkpoint, relaunch
    from it on every node present, so the job grows back (the relaunch costs a cold start and
    the steps since that checkpoint; it is not charged to the budget). ``alert`` (or
    ``ignore``) keeps the job at its size until the next relaunch for another reason."""
    slow_node: Response = _ladder(A.RELAUNCH, act_on="warning")
    """A node whose compute or link lagged the others' for minutes (``detectors.slow_compute``,
    ``detectors.slow_link``), and
    whose cost to the job over the rest of the run exceeds a relaunch without it
    (``nodes.evict_slow``): once the attempt has saved its next checkpoint, relaunch from it
    without that node (a spare in its place, or on the nodes left). Charged to the budget like
    any remedy. ``alert`` keeps the node and only tells."""
    gpu_fault: Response = _ladder(A.ROLLBACK, A.STOP)
    """A GPU reported a machine fault (uncorrectable ECC errors, a hardware Xid; read through
    NVML every ``schedule.health_every_s``): roll back, nothing skipped, LR kept (the data is
    fine, the GPU is not): to before the last clean look at the GPUs for a memory error (what
    was computed since may be wrong), to the newest good checkpoint for a GPU that stopped
    (off the bus, NVLink, its GSP); on a multi-node run without that node (evicted at once, a
    spare in its place); again -> stop."""
    resume: Response = _ladder(A.ROLLBACK, A.STOP)
    """A resume that did not take (a rank's parameters at its first step are not the ones it
    restored, or the first steps' loss is far above the one recorded at the checkpoint): roll
    back once to the next older good checkpoint (nothing skipped, LR kept); again, or with no
    older one -> stop, naming the likely causes. Never loop rollbacks over a broken restore."""

    @model_validator(mode="after")
    def _skip_only_for_grad(self) -> Incidents:
        for name in ("loss_spike", "nonfinite", "hang", "straggler", "throughput",
                     "rank_departure", "sdc", "node_lost", "node_joined", "slow_node", "resume"):
            if Action.SKIP_STEP in getattr(self, name).ladder:
                raise ValueError(
                    f"incidents.{name}.ladder: skip_step only makes sense for grad_spike (the "
                    "worker skips the optimizer step in-process before it happens); use "
                    "rollback, relaunch, alert or stop"
                )
        return self


class Rollback(Section):
    """What a rollback skips, in data-cursor batches around the onset, and how it escalates."""

    skip_before: int = Field(default=10, ge=0)
    """Batches before the onset to skip (the ones that may have pushed the model off)."""
    skip_after: int = Field(default=50, ge=1)
    """Batches from the onset on to skip. 50 suits small runs; large pretraining runs whose
    spikes last tens of steps usually want a few hundred."""
    lr_factor: float = Field(default=0.5, gt=0.0, le=1.0)
    """A rollback cuts the LR scale by this factor (1.0: keep the LR). The cut is temporary
    (see lr_rewarm_steps) unless the same region spikes again."""
    lr_rewarm_steps: int = Field(default=50, ge=0)
    """After the skipped batches, the LR scale returns linearly to its earlier value over this
    many steps (batches). 0 restores it at once, right after the skipped batches."""
    escalation_window: int = Field(default=200, ge=0)
    """A new onset within this many batches of a previous rollback's skip range is the same
    region spiking again: the skip range widens, and the LR scale is cut by lr_factor once
    more and stays cut for the rest of the run."""
    escalation_skip_factor: float = Field(default=2.0, ge=1.0)
    """Skip ranges grow by this factor each time the same region spikes again."""
    rerun_max_steps: int = Field(default=500, ge=0)
    """Before skipping batches for a loss spike, a grad-norm spike or a NaN, rerun the same
    steps once to see whose fault it is: roll back to the same checkpoint, skip nothing, keep
    the LR, replay the same batches. Back at the same batches -> the data's: roll back again,
    skip them, cut the LR. Not back -> a transient fault of the machine: nothing skipped, the
    LR unchanged, the run goes on from the rerun. Only when the rerun (from the checkpoint to
    the detection) is at most this many steps; 0: never rerun, skip at once."""
    rerun_max_s: float | None = Field(default=1800.0, gt=0.0)
    """...and at most this many seconds at the run's measured median step time (None: no
    limit in time)."""
    skip_repeated_faults: bool = True
    """A hang or a crash that comes back at the same global batch on the same rank (a crash:
    with the same error) follows the data, say a corrupt file its loader deadlocks on: roll back
    to the newest checkpoint before it and skip the batches of that step, with the LR untouched.
    One that comes back at the same step over other batches follows the step count (an
    evaluation or a save at that step): the code's, and the run stops. False: repeats climb
    the hang ladder and the crash limits like any other (a crash repeated at the same step
    stops the run when crash.stop_on_deterministic)."""


class CrashLimits(Section):
    """Relaunches allowed per crash class before babysit stops and pages."""

    oom: int = Field(default=1, ge=0)
    """Out of memory: rarely fixed by retrying unchanged, but fragmentation sometimes is."""
    network: int = Field(default=5, ge=0)
    """NCCL/gloo/c10d errors, connection resets, timeouts: usually transient."""
    numerical: int = Field(default=2, ge=0)
    """FloatingPointError, NaN in a check: retried as a rollback when rollback_numerical."""
    hardware: int = Field(default=2, ge=0)
    """Xid, ECC, illegal memory access: a relaunch may land on healthy hardware."""
    user_code: int = Field(default=0, ge=0)
    """A Python exception in the script: a retry replays the same bug."""
    data: int = Field(default=1, ge=0)
    """A Python exception from the data loader (raised as ``run.batches()`` drew a batch): one
    relaunch shows whether it comes back at the same batch, the data's (that batch is then
    skipped, ``rollback.skip_repeated_faults``), or follows the step, the code's (stop)."""
    signal: int = Field(default=3, ge=0)
    """Killed by a signal with nothing in the log (preemption, OOM killer, a person)."""
    unknown: int = Field(default=2, ge=0)
    """Anything else."""


class CrashPolicy(Section):
    """How worker crashes are answered (the class comes from the crash classifier)."""

    max_relaunches: CrashLimits = CrashLimits()
    """Relaunches allowed per class; one more crash of that class stops the run."""
    first_relaunch_at_once: bool = True
    """The first crash of a class (within forget_after_s) is relaunched without waiting: one
    crash is not yet a crash loop, and every second waited is every rank idle. The backoff
    starts with the second."""
    backoff_base_s: float = Field(default=5.0, ge=0.0)
    """Wait before the first relaunch of a class that waits (the second crash of the class when
    first_relaunch_at_once, else the first); doubles with each further one."""
    backoff_max_s: float = Field(default=300.0, ge=0.0)
    """Upper bound of the backoff."""
    stop_on_deterministic: bool = True
    """Stop when a crash repeats with the same signature at the same step: retrying from the
    same checkpoint would reproduce it. With rollback.skip_repeated_faults (and a data cursor)
    a repeat on the same batch is first taken for the data's and that batch skipped; back at
    the step over the next batch, it stops the run as the code's."""
    rollback_numerical: bool = True
    """Numerical crashes roll back (skipping the batches, lowering the LR) instead of
    relaunching from the newest checkpoint, which would replay the same numbers."""
    forget_after_s: float | None = Field(default=21600.0, gt=0.0)
    """Crashes older than this stop counting against max_relaunches (None: never forget), so
    a week-long run is not stopped by its sixth network blip."""

    @model_validator(mode="after")
    def _backoff_order(self) -> CrashPolicy:
        if self.backoff_max_s < self.backoff_base_s:
            raise ValueError(f"backoff_max_s ({self.backoff_max_s}) must be >= backoff_base_s "
                             f"({self.backoff_base_s})")
        return self


class Budget(Section):
    """A ceiling on disruptive interventions (rollbacks and relaunches, crash relaunches
    included; in-process step skips and alerts are free)."""

    max_interventions: int = Field(default=6, ge=1)
    """More than this many interventions within window_s -> stop and page a human."""
    window_s: float = Field(default=21600.0, gt=0.0)
    """The sliding window, in seconds."""


class Policy(Section):
    """A complete policy: detector settings and the responses to what they find."""

    description: str = ""
    """One line saying what this policy is for."""
    detectors: Detectors = Detectors()
    """Per-detector settings."""
    incidents: Incidents = Incidents()
    """Per-incident action ladders, cooldowns and resets."""
    rollback: Rollback = Rollback()
    """Rollback skip ranges, LR lowering and escalation."""
    crash: CrashPolicy = CrashPolicy()
    """Crash relaunch limits, backoff and deterministic-repeat handling."""
    budget: Budget = Budget()
    """The intervention budget."""
