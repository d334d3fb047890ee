"""The run configuration: one YAML file per run, declared once here.

Every field carries its documentation as the docstring under it; pydantic turns those into the
JSON Schema that ``babysit schema`` prints, so the reference can never drift from the code.
Keys may be spelled with dashes or underscores (``nproc-per-node`` or ``nproc_per_node``), as
torchrun accepts both. Unknown keys are errors. Relative paths are resolved against the folder
of the config file, except ``run_dir``, which is relative to where babysit is started.

Errors a user can cause become one ``ConfigError`` paragraph each, naming the file, the key path
and what to do; the CLI prints them without a traceback.
"""

from __future__ import annotations

import difflib
import os
import re
import time
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from babysit.policies.section import DashedSection
from babysit.supervisor.config.address import parse_address
from babysit.supervisor.services.alerts.config import AlertsConfig
from babysit.supervisor.services.dashboards import TensorBoardConfig, WandbConfig
from babysit.supervisor.services.exporter import ExporterConfig
from babysit.supervisor.services.health import HealthConfig
from babysit.supervisor.services.schedule import ScheduleConfig


class ConfigError(Exception):
    """A configuration mistake, with a message meant for the person who wrote the file."""


class LaunchConfig(DashedSection):
    """How to start the workers: torchrun's options, the script and its environment."""

    script: str | None = None
    """Training script to run on every rank (a path, relative to the config file's folder)."""
    module: str | None = None
    """Run a module instead of a script, like ``torchrun -m`` (``launch.script`` must be unset)."""
    args: list[str] = Field(default_factory=list)
    """Arguments passed to the script or module, after babysit's and torchrun's own."""
    env: dict[str, str] = Field(default_factory=dict)
    """Extra environment variables for the workers (names kept exactly as written)."""
    python: str | None = None
    """Python interpreter that runs torchrun and the workers; default: the one running babysit."""
    nproc_per_node: int | Literal["auto", "cpu", "gpu"] = 1
    """Workers per node, as torchrun's ``--nproc-per-node``."""
    nnodes: str = "1"
    """Number of nodes, or ``MIN:MAX`` for an elastic range, as torchrun's ``--nnodes``."""
    node_rank: int = Field(0, ge=0)
    """This node's rank among the nodes, as torchrun's ``--node-rank``."""
    rdzv_backend: str | None = None
    """Rendezvous backend, as torchrun's ``--rdzv-backend``; default: ``static`` for a run on
    one node (its store, without c10d's join protocol: 0.3 s less on every launch), ``c10d``
    for several (``rendezvous``)."""
    rdzv_endpoint: str | None = None
    """``host:port`` of the rendezvous for multi-node runs. Single-node runs leave it unset and
    babysit picks a fresh local port for every attempt."""
    rdzv_id: str | None = None
    """Rendezvous id shared by all nodes; default: the run's name plus the attempt number."""
    rdzv_conf: str | None = None
    """Extra rendezvous settings ``key=value,...``, as torchrun's ``--rdzv-conf``."""
    master_addr: str | None = None
    """As torchrun's ``--master-addr`` (only with ``rdzv_backend: static``)."""
    master_port: int | None = None
    """As torchrun's ``--master-port`` (only with ``rdzv_backend: static``)."""
    local_addr: str | None = None
    """As torchrun's ``--local-addr``."""
    start_method: Literal["spawn", "fork", "forkserver"] | None = None
    """As torchrun's ``--start-method``."""
    monitor_interval: float | None = Field(None, gt=0)
    """As torchrun's ``--monitor-interval`` (seconds)."""
    role: str | None = None
    """As torchrun's ``--role``."""
    no_python: bool = False
    """Run ``launch.script`` as an executable instead of through Python, as ``--no-python``."""
    torchrun_args: list[str] = Field(default_factory=list)
    """Further torchrun options passed through verbatim, for options babysit does not model."""
    local_ranks_filter: list[int] | None = None
    """Show only these local ranks' output on the console, as torchrun's
    ``--local-ranks-filter 0,1`` (babysit still reads and logs every rank's)."""
    stop_grace_s: float = Field(15.0, gt=0)
    """Seconds between SIGTERM and SIGKILL when babysit stops the workers."""
    teardown_idle_s: float = Field(30.0, gt=0)
    """Once every rank of a node has closed its run, seconds its processes may sit with no CPU
    progress before babysit calls the teardown stuck (a rank hung in gloo's teardown, say),
    stops torchrun and counts the attempt finished. A script still working after
    ``run.close()`` (saving, uploading) uses CPU and is waited for. Once every rank's process
    has exited and torchrun has reaped them, it gets 3 s to exit too (it takes about 0.5 s),
    whatever this says (before it has reaped them, a loaded machine's torchrun that has not
    looked yet, this long); on
    several nodes its exit barrier waits for the other nodes' (minutes for a node whose rank
    aborted), so a follower's gets this long more, and the leader's, which hosts the rendezvous
    store the others shut down on, as long as another node's torchrun runs, then 3 s."""
    warm_standby: bool | Literal["auto", "imports"] = "auto"
    """Keep the next attempt's workers started and waiting, so a relaunch (rollback, hang,
    crash) skips most of a cold start (docs/recovery.md). Once an attempt has trained a few
    seconds, babysit starts the next one's torchrun and its rendezvous. ``true``: its ranks run
    the script up to ``attach()`` and wait there; a relaunch then costs about a checkpoint load
    and a step. The cost: a second set of rank processes with torch imported and whatever the
    script built before ``attach()`` (about 0.3 GB resident per small CPU rank plus 0.2 GB for
    torchrun; on a GPU a CUDA context per rank and any model already on the device: 1.2 GB for
    two small ranks on an H200). Anything the script does before ``attach()`` (opening a
    logger's run, writing files) happens for the standby too. ``imports``: its ranks import
    torch (and ``torch._dynamo``, which DDP's constructor imports, and the checkpoint reader:
    about 70 MB more a rank) and wait before the script starts: no CUDA context, no GPU
    memory, nothing of the script run twice; a relaunch still runs the script's own start (its
    imports, the model build, CUDA and NCCL set-up, the checkpoint load). ``auto`` (the
    default): ``true``, or ``imports`` where the job can see NVIDIA GPUs. ``false``: every
    relaunch cold.
    Single-node runs of scripts that call ``attach()`` only (``imports`` needs a Python script:
    not ``no_python``); multi-node runs and a fixed ``rdzv_endpoint`` relaunch cold."""
    torchrun_ahead: bool = True
    """Where no warm standby serves a relaunch (``warm_standby: false``, a multi-node run, a
    fixed rendezvous endpoint), start the next attempt's torchrun ahead, once the running
    attempt made a step: its interpreter up and ``torch.distributed.run`` imported, waiting for
    its command line. A relaunch then skips torchrun's own start (about 1.2 s of a cold
    relaunch on a small CPU machine). It touches no GPU and runs no rank: one interpreter with
    torch imported (about 0.3 GB resident). The first attempt's torchrun is started the same
    way by ``babysit run`` itself, first thing, beside babysit's own start (about 0.5 s sooner
    to the first step on a small CPU machine); it is stopped unused where ``launch.python``
    is another interpreter or ``launch.env`` sets a ``PYTHON*`` or ``LD_*`` variable (read as
    an interpreter starts). ``false``: every launch starts torchrun anew."""
    max_restarts: int | None = Field(None, ge=0)
    """Relaunches allowed after crashes; overrides the policy's crash budget when set. babysit
    owns restarts, so torchrun itself always runs with ``--max-restarts 0``."""

    @field_validator("nproc_per_node", mode="before")
    @classmethod
    def _nproc_shape(cls, value: Any) -> Any:
        # One clear message instead of pydantic's one-per-union-branch.
        if value in ("auto", "cpu", "gpu") or (isinstance(value, int) and value >= 1):
            return value
        if isinstance(value, str) and value.isdigit() and int(value) >= 1:
            return int(value)
        raise ValueError("must be a positive number of workers, or one of auto, cpu, gpu")

    @field_validator("local_ranks_filter", mode="before")
    @classmethod
    def _ranks_list(cls, value: Any) -> Any:
        # torchrun's spelling: "0,2"
        if isinstance(value, str):
            try:
                return [int(v) for v in value.split(",") if v.strip()]
            except ValueError:
                raise ValueError("must be local ranks separated by commas, like 0,1") from None
        if isinstance(value, int):
            return [value]
        return value

    @field_validator("nnodes", mode="before")
    @classmethod
    def _nnodes_text(cls, value: Any) -> Any:
        return str(value) if isinstance(value, int) else value

    @field_validator("nnodes")
    @classmethod
    def _nnodes_shape(cls, value: str) -> str:
        if not re.fullmatch(r"\d+(:\d+)?", str(value)):
            raise ValueError("must be a number of nodes like 2, or a range MIN:MAX like 1:4")
        low, _, high = value.partition(":")
        if int(low) < 1 or int(high or low) < int(low):
            raise ValueError("needs 1 <= MIN <= MAX nodes")
        return str(value)

    @property
    def node_range(self) -> tuple[int, int]:
        """``nnodes`` as (fewest, most) nodes."""
        low, _, high = self.nnodes.partition(":")
        return int(low), int(high or low)

    @property
    def multinode(self) -> bool:
        return self.node_range[1] > 1

    @property
    def rendezvous(self) -> str:
        """The rendezvous backend torchrun is given (``rdzv_backend``, or its default)."""
        return self.rdzv_backend or ("c10d" if self.multinode else "static")

    @model_validator(mode="after")
    def _script_or_module(self) -> LaunchConfig:
        if (self.script is None) == (self.module is None):
            raise ValueError(
                "set exactly one of launch.script (a path) or launch.module (a module name)"
            )
        return self


class CadenceConfig(DashedSection):
    """Checkpoint cadence advice: the interval that minimises expected lost work (docs/cadence.md).

    babysit measures a checkpoint's blocking cost C on this run and the mean time between
    interruptions tau (this run's own crashes, hangs, rollbacks and preemptions, weighed against
    the prior), and journals the Young/Daly interval sqrt(2 C tau) beside the configured one."""

    auto: bool = False
    """Adopt the advised interval while the run goes on (within ``min_steps``..``max_steps``);
    by default babysit only reports it."""
    min_steps: int = Field(10, ge=1)
    """Fewest steps between checkpoints that ``auto`` may choose."""
    max_steps: int = Field(100_000, ge=1)
    """Most steps between checkpoints that ``auto`` may choose."""
    mtbf_prior_s: float = Field(86_400.0, gt=0)
    """Prior mean time between interruptions, seconds (a day); it counts as one interruption
    observed, so a few real ones soon outweigh it."""

    @model_validator(mode="after")
    def _bounds_in_order(self) -> CadenceConfig:
        if self.min_steps > self.max_steps:
            raise ValueError(f"min_steps ({self.min_steps}) must not exceed max_steps "
                             f"({self.max_steps})")
        return self


DEFAULT_EVERY_STEPS = 100
"""``checkpoints.every_steps: auto``'s first interval, before the cost model has measured."""


class CheckpointConfig(DashedSection):
    """Where and how often the worker API saves checkpoints."""

    dir: str | None = None
    """Checkpoint folder; default: ``checkpoints/`` inside the run directory."""
    every_steps: int = Field(DEFAULT_EVERY_STEPS, ge=0)
    """Save every N optimizer steps through the worker API (``attach(model=...,
    optimizer=...)``; docs/worker-api.md says what the loop must look like). ``auto`` (the
    default, in a config and on the command line alike): every 100 steps at first, then the
    interval the cadence's cost model gives from this run's measured save cost and
    interruptions (``cadence.auto`` on unless set); just-in-time state and memory copies come
    with it. 0 leaves saving to the script, and babysit keeps nothing (said at the start)."""
    keep: int = Field(3, ge=1)
    """How many recent checkpoints retention keeps (the newest good one is always kept)."""
    probation_steps: int = Field(50, ge=1)
    """Healthy steps after a checkpoint before it counts as *good*; until then it is *pending*,
    and an anomaly whose onset falls within this many steps of it makes it *suspect*."""
    async_save: bool = True
    """Save in the background (as ``torch.distributed.checkpoint.async_save`` does, on one writer
    thread per rank kept for the run, its collectives in a gloo process group of its own):
    training stalls only for the copy of the state into host memory, not for the write. Falls
    back to synchronous saves, and says so, where the ranks' copies would not fit in half the
    host's free memory at the first save."""
    just_in_time: bool = True
    """After a hang, a crash or a lost node, before anything is stopped, the ranks still alive
    write the state of the last completed step (model, optimizer, data cursor, random streams),
    and the relaunch resumes from it: one step lost instead of everything since the last
    checkpoint. Needs ``every_steps`` > 0 and ``attach(model=..., optimizer=...)``; what it
    costs a step is measured in docs/measured.md ("Just-in-time state")."""
    memory_every_steps: int | Literal["auto"] = "auto"
    """Every N steps each rank also copies its state (its shard, its optimizer's, its random
    streams, the cursor) into its node's shared memory, and a rank of the next node keeps a
    replica in its own: a rank or a node lost with the only holder of a shard (FSDP2) then
    costs the steps since that copy, not since the last checkpoint on disk. Training stalls
    only for the copy into host memory. ``auto``: on where a shard has a single holder, every N
    steps as the cadence's cost model chooses from the copy's measured stall and the run's
    interruptions (said at the start, with its figures); off under DDP, whose live replicas
    the just-in-time state already covers. 0: off. Needs ``every_steps`` > 0
    (docs/recovery.md, "Memory copies")."""
    just_in_time_timeout_s: float | None = Field(None, gt=0)
    """The most a just-in-time save may take before babysit gives up on it and resumes from the
    newest checkpoint. Default: four times the slowest save this run measured, plus 5 s, at
    least 10 s; after a crash at most 25 s (torchrun kills the survivors 30 s after its
    SIGTERM)."""
    final_grace_s: float = Field(120.0, ge=0)
    """On SIGTERM (what a scheduler sends before reclaiming the node), seconds babysit waits for
    the workers to save a final checkpoint before stopping them; 0 stops at once. The next
    ``babysit run`` with the same run directory resumes from it. When none comes in time while
    the workers still run (a rank stuck where no step boundary comes), the live ranks'
    just-in-time state of the last completed step stands in for it (``just_in_time``). SIGINT
    never waits. Under Slurm, a job being cancelled leaves at most its ``KillWait`` less
    ``launch.stop_grace_s`` and 3 s (12 s by default): the wait is cut to that, and leaves no
    time for a just-in-time save."""
    cadence: CadenceConfig = CadenceConfig()
    """Advice on ``every_steps`` from this run's measured costs, and its opt-in adoption."""
    auto_interval: bool = Field(True, exclude=True)
    """Set from ``every_steps``: it was ``auto`` (or left out), not a number."""

    def said(self) -> str:
        """What babysit keeps, in one plain line for the start of a run."""
        if self.every_steps == 0:
            return ("babysit: keeping no state (checkpoints.every_steps: 0): a fault restarts "
                    "the run from its first step unless the script saves its own")
        every = (f"a checkpoint every {self.every_steps} steps, then as this run's costs "
                 "advise" if self.auto_interval else
                 f"a checkpoint every {self.every_steps} steps")
        kept = [every]
        if self.just_in_time:
            kept.append("the last completed step after a fault")
        if self.memory_every_steps != 0:
            kept.append("memory copies where a shard has one holder"
                        if self.memory_every_steps == "auto" else
                        f"memory copies every {self.memory_every_steps} steps")
        return (f"babysit: keeping {', '.join(kept)} (when the script gives attach() its model "
                "and optimizer; checkpoints.every_steps: 0 turns this off)")

    @model_validator(mode="before")
    @classmethod
    def _auto_interval(cls, data: Any) -> Any:
        """``every_steps: auto`` (or none given): the first interval, and the cost model's
        adoption on unless the config says otherwise."""
        if not isinstance(data, dict):
            return data
        data = {k: v for k, v in data.items() if k not in ("auto_interval", "auto-interval")}
        every = data.get("every_steps", data.get("every-steps", "auto"))
        if every != "auto":
            return {**data, "auto_interval": False}
        cadence = data.get("cadence")
        cadence = dict(cadence.model_dump() if isinstance(cadence, BaseModel) else cadence or {})
        cadence.setdefault("auto", True)
        data = {k: v for k, v in data.items() if k not in ("every_steps", "every-steps")}
        return {**data, "every_steps": DEFAULT_EVERY_STEPS, "cadence": cadence,
                "auto_interval": True}


class SdcCheckConfig(DashedSection):
    """The silent-data-corruption check: ranks compare checksums of values that must agree."""

    every_steps: int = Field(0, ge=0)
    """Every N steps each rank checksums its replicated parameters and runs a fixed arithmetic
    probe on its device; the supervisor compares them across ranks and names the rank that
    disagrees. 0 (default) turns the check off. Needs ``attach(model=...)``."""


class NodesConfig(DashedSection):
    """How the babysitters of a multi-node run (``launch.nnodes`` above 1) find and trust each
    other. Every node runs ``babysit run`` with the same config and its own ``--node-rank``;
    node rank 0's babysitter leads first, and another node takes over if it is lost
    (docs/multinode.md)."""

    leader: str | None = None
    """``host:port`` where the leader's babysitter listens and the others connect. Default: the
    host of ``launch.rdzv_endpoint`` and the port after its port."""
    secret: str | None = None
    """The run's shared secret; better set ``BABYSIT_SECRET`` in every node's environment (it
    wins over this key). Babysitters prove they know it before they may join or command."""
    join_timeout_s: float = Field(600.0, gt=0)
    """How long the leader waits for the nodes to join at the start, and a follower for the
    leader to answer."""
    rejoin_timeout_s: float = Field(600.0, ge=0)
    """A relaunch that has fewer nodes than ``launch.nnodes`` allows waits this long for lost
    nodes to come back (paging a human meanwhile), then the run fails; 0 fails at once. Also how
    long a node cut off from a leader that lives keeps trying to rejoin it."""
    heartbeat_s: float = Field(2.0, gt=0)
    """Seconds between a babysitter's heartbeats to the leader, and back."""
    lost_after_s: float = Field(15.0, gt=0)
    """Silence after which a node (or, for a follower, the leader) counts as lost; and after
    which a babysitter's lease in the run directory counts as stale, so that the followers of a
    lost leader elect another (docs/multinode.md, "Who leads")."""
    evict_after: int = Field(2, ge=0)
    """Machine faults traced to one node (a hardware-class crash, a rank's SIGSEGV, SIGBUS or
    SIGILL, a spike its rerun did not reproduce whose first moving rank is there) after which
    the next attempt runs without that node, when ``launch.nnodes`` allows the nodes left; it
    goes on ``RUN_DIR/exclude_hosts`` too. A silent data corruption the SDC vote places on one
    node's ranks evicts it at once. 0: never evict."""
    evict_slow: bool = True
    """Evict a node whose compute lags the others' for minutes (``detectors.slow_compute``:
    its ranks' forward time), or its link (``detectors.slow_link``: its babysitter
    connection's round trip), when keeping it costs more than a relaunch without it: keeping
    costs the pace it takes off the job (``slowdown``) over the rest of the run
    (``run_left_s``); evicting costs a relaunch as measured in this run (launch to first step,
    plus the stop) and, with no spare to take its place, the share of the job's work the node
    did, over the rest of the run. Taken out at the attempt's next checkpoint
    (``incidents.slow_node``). The verdict and its numbers go into the finding and the journal
    (``slow_node_cost``) either way. False: only tell."""
    run_left_s: float | None = Field(None, gt=0)
    """How much longer the run will train, in seconds, for the slow-node cost. None: as long
    as it has run so far (of runs that have lasted that long, half last at least as long
    again); a node kept for it is weighed again each time the detector tells it again (once it
    has been slow twice as long as when last told), against the run's time by then."""
    spares: int = Field(0, ge=0)
    """Hot spares: babysitters beyond the job's size (the MAX of ``launch.nnodes``), at node
    ranks MAX to MAX+spares-1. They join the leader and wait, running nothing; when a node is
    lost or evicted, the next attempt takes a spare in its place and the job keeps its size. A
    spare can be elected leader like any node. A node that comes back waits as a spare."""
    settle_s: float = Field(3.0, ge=0)
    """After the first node reports a crash or hang, how long the leader waits for the other
    nodes' view of it before choosing the most telling one (the node with the failing rank
    explains it; the others see only a broken connection). Not waited for once a node reports
    a rank dead of SIGSEGV, SIGBUS, SIGILL or SIGKILL: that is the cause."""

    @field_validator("leader")
    @classmethod
    def _host_port(cls, value: str | None) -> str | None:
        if value is not None:
            parse_address(value)
        return value

    @model_validator(mode="after")
    def _beats_before_loss(self) -> NodesConfig:
        if self.lost_after_s <= 2 * self.heartbeat_s:
            raise ValueError(f"lost_after_s ({self.lost_after_s:g}) must exceed twice "
                             f"heartbeat_s ({self.heartbeat_s:g}), or a late beat loses a node")
        return self


PATTERN_GROUPS = ("step", "loss", "grad_norm", "lr", "tokens", "step_time", "step_time_ms")
"""Named groups a custom ``stdout.pattern`` may use; ``loss`` is required."""


def compile_pattern(pattern: str) -> re.Pattern[str]:
    """A custom progress pattern, checked: raises ``ValueError`` saying what to change."""
    try:
        compiled = re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"not a valid regular expression ({exc})") from None
    groups = set(compiled.groupindex)
    if "loss" not in groups:
        raise ValueError("it needs a named group for the loss, e.g. 'loss (?P<loss>[0-9.]+)'")
    unknown = groups - set(PATTERN_GROUPS)
    if unknown:
        raise ValueError(f"unknown named group(s) {sorted(unknown)}; known: "
                         f"{', '.join(PATTERN_GROUPS)}")
    return compiled


class StdoutConfig(DashedSection):
    """Stdout mode: progress read from what a script prints, for scripts that never call
    ``attach()`` (nanoGPT's ``iter N: loss X``, Hugging Face Trainer's logged dicts,
    Lightning's bar, torchtitan's step lines, a plain ``step N loss X``)."""

    progress: Literal["auto", "off"] = "auto"
    """``auto``: read the lowest printing rank's progress lines until a rank calls
    ``attach()``; ``off``: never (status, metrics and hang detection then need ``attach()``)."""
    pattern: str | None = None
    """A regular expression replacing the built-in formats, with named groups ``loss``
    (required) and optionally ``step``, ``grad_norm``, ``lr``, ``tokens``, ``step_time``
    (seconds) or ``step_time_ms``, e.g. ``'it=(?P<step>\\d+) L=(?P<loss>\\S+)'``."""
    checkpoint_dir: str | None = None
    """The folder the script saves its own checkpoints in (nanoGPT's ``out_dir``), relative to
    where babysit is started. babysit copies it each time it changes (into the run folder), so a
    rollback can put back the copy from before a spike and relaunch with ``resume_args``.
    Unset: spikes in stdout mode alert instead of rolling back."""
    resume_args: list[str] = Field(default_factory=list)
    """Arguments that make the script resume from ``checkpoint_dir``, appended to
    ``launch.args`` when babysit relaunches from a copy (nanoGPT: ``[--init_from=resume]``)."""
    keep: int = Field(3, ge=1)
    """Copies of ``checkpoint_dir`` kept (the newest ones)."""

    @field_validator("pattern")
    @classmethod
    def _pattern_shape(cls, value: str | None) -> str | None:
        if value is not None:
            compile_pattern(value)
        return value

    @model_validator(mode="after")
    def _resume_needs_folder(self) -> StdoutConfig:
        if (self.checkpoint_dir is None) != (not self.resume_args):
            raise ValueError("set both checkpoint_dir (where the script saves) and resume_args "
                             "(how it resumes from there), or neither")
        return self


class PolicyRef(DashedSection):
    """Which policy judges this run, and the fields it changes."""

    name: str = "default"
    """A built-in policy (``default``, ``conservative``, ``aggressive``) or a YAML file path."""
    overrides: dict[str, Any] = Field(default_factory=dict)
    """Fields of the policy to change, nested as in the policy file."""


class RunConfig(DashedSection):
    """One babysat run."""

    launch: LaunchConfig
    """How to start the workers."""
    name: str | None = None
    """Name of the run, used in alerts and the default run directory; default: the config file's
    name (or the script's name when launched without a config)."""
    run_dir: str | None = None
    """Folder for everything the run leaves behind (journal, logs, metrics, checkpoints). Default:
    ``runs/<name>-<date>-<time>`` under the current directory; under ``srun``,
    ``runs/<name>-<job id>``, the same on every node and when the job is requeued
    (docs/multinode.md#slurm). Reusing the folder of a run whose
    supervisor died (killed, OOM, reboot) takes it over: leftover workers are stopped and the
    run resumes from its newest checkpoint with the skips and LR scale it had; so does one that
    stopped on a signal or ended with a requeue (exit 75). Reusing a finished run's folder
    appends a new run to its journal."""
    checkpoints: CheckpointConfig = CheckpointConfig()
    """Checkpoint settings."""
    sdc: SdcCheckConfig = SdcCheckConfig()
    """The opt-in silent-data-corruption check."""
    policy: PolicyRef = PolicyRef()
    """The policy that maps incidents to actions."""
    alerts: AlertsConfig = AlertsConfig()
    """Where alerts go (Slack, webhooks). With no sinks, alerts are journaled only."""
    health: HealthConfig = HealthConfig()
    """Thresholds for host, worker and GPU health warnings (memory, disk, leaks, GPU)."""
    schedule: ScheduleConfig = ScheduleConfig()
    """How often the background jobs run (health sampling, the digest alert)."""
    prometheus: ExporterConfig = ExporterConfig()
    """The opt-in Prometheus ``/metrics`` endpoint."""
    nodes: NodesConfig = NodesConfig()
    """Multi-node runs: where the babysitters meet, and the secret they share."""
    stdout: StdoutConfig = StdoutConfig()
    """Stdout mode: progress, hangs and rollback for scripts that only print."""
    tensorboard: TensorBoardConfig = TensorBoardConfig()
    """The opt-in TensorBoard sink: babysit's metrics and incidents beside the script's own."""
    wandb: WandbConfig = WandbConfig()
    """The opt-in Weights & Biases sink: babysit's metrics and incidents in a run of their own,
    beside the script's."""

    @model_validator(mode="after")
    def _node_rank_in_range(self) -> RunConfig:
        node_rank, most, spares = self.launch.node_rank, self.launch.node_range[1], \
            self.nodes.spares
        if spares and most < 2:
            raise ValueError("nodes.spares needs a multi-node run (launch.nnodes 2 or more); "
                             "a one-node job with spare nodes is not supported yet")
        if node_rank >= most + spares:
            spare = f" plus nodes.spares ({spares})" if spares else ""
            raise ValueError(f"launch.node_rank {node_rank} is not below launch.nnodes' most "
                             f"({most}){spare}: node ranks count from 0")
        return self


def read_yaml(path: str | Path) -> dict[str, Any]:
    """The raw mapping in a config file, before validation."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file. Check the path to the config file.") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read it ({exc.strerror}).") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        where = ""
        mark = getattr(exc, "problem_mark", None)
        if mark is not None:
            where = f" line {mark.line + 1}, column {mark.column + 1}:"
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(
            f"{path}:{where} invalid YAML ({problem}). Fix the syntax there.") from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: expected a mapping with at least a 'launch' section, got "
            f"{type(data).__name__}. See `babysit schema` for the layout."
        )
    return data


def parse(data: dict[str, Any], source: str) -> RunConfig:
    """Validate a config mapping; ``source`` names it in errors (a path or ``command line``)."""
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError("\n".join(_describe(source, e) for e in exc.errors())) from None


def _describe(source: str, error: Any) -> str:
    loc = [str(part) for part in error["loc"]]
    key = ".".join(loc) or "(top level)"
    kind = error["type"]
    if kind == "extra_forbidden":
        known = _fields_at(RunConfig, loc[:-1])
        close = difflib.get_close_matches(loc[-1].replace("-", "_"), known, n=1)
        hint = f"Did you mean '{close[0]}'?" if close else f"Known keys here: {', '.join(known)}."
        return f"{source}: {key}: unknown key. {hint}"
    if kind == "missing":
        return f"{source}: {key}: required key is missing. Add it (see `babysit schema`)."
    got = error.get("input")
    message = error["msg"].removeprefix("Value error, ")
    shown = f" (got {got!r})" if not isinstance(got, dict) else ""
    return f"{source}: {key}: {message}{shown}. See `babysit schema` for what this key takes."


def _fields_at(model: type[BaseModel], loc: list[str]) -> list[str]:
    for part in loc:
        field = model.model_fields.get(part)
        annotation = field.annotation if field else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return list(model.model_fields)


def schema() -> dict[str, Any]:
    """The JSON Schema of the run config, with every field's documentation."""
    return RunConfig.model_json_schema()


# -- checks that need the file system (validate and run, never at parse time) --------------------


def resolve_script(config: RunConfig, base: Path) -> Path | None:
    """The absolute script path, or None for module launches."""
    if config.launch.script is None:
        return None
    return (base / config.launch.script).resolve()


def default_run_dir(name: str, now: float | None = None) -> Path:
    """``runs/<name>-<date>-<time>`` under the current directory."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    return Path("runs") / f"{name}-{stamp}"


def check_environment(config: RunConfig, base: Path, run_dir: Path, source: str) -> list[str]:
    """Problems that only the file system can reveal: a missing script, an unwritable folder.

    Returns one message per problem (empty when all is well). Creates nothing.
    """
    problems = []
    script = resolve_script(config, base)
    if script is not None and not script.is_file():
        problems.append(
            f"{source}: launch.script: file '{config.launch.script}' not found (looked at "
            f"{script}). Fix the path; relative paths start at the config file's folder."
        )
    if run_dir.exists() and run_dir.stat().st_uid != os.geteuid():
        # The run directory guards the telemetry socket (mode 0700) and holds the journal that
        # a takeover trusts: a folder someone else owns could hold either, planted.
        problems.append(
            f"{source}: run_dir: '{run_dir}' belongs to uid {run_dir.stat().st_uid}, not to you "
            f"(uid {os.geteuid()}). babysit only uses a run directory it owns; choose another "
            f"run_dir.")
    folders = (("run_dir", run_dir), ("checkpoints.dir", checkpoint_dir(config, base, run_dir)))
    for key, folder in folders:
        problem = _unwritable(folder)
        if problem:
            problems.append(
                f"{source}: {key}: cannot write to '{folder}' ({problem}). Choose a folder you "
                f"can write to, or fix its permissions."
            )
    return problems


def checkpoint_dir(config: RunConfig, base: Path, run_dir: Path) -> Path:
    if config.checkpoints.dir is None:
        return run_dir / "checkpoints"
    return (base / config.checkpoints.dir).resolve()


def _unwritable(folder: Path) -> str | None:
    """Why ``folder`` could not be created or written, or None. Looks, creates nothing."""
    probe = folder.resolve()
    while not probe.exists():
        if probe.parent == probe:
            return "no existing parent folder"
        probe = probe.parent
    if not probe.is_dir():
        return f"'{probe}' is a file, not a folder"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"no write permission on '{probe}'"
    return None
