"""What a Slurm step tells babysit about its run, read from ``srun``'s environment.

Under ``srun`` (one task per node: ``srun babysit run train.yaml``), every babysitter finds the
step in its environment, as Lightning and accelerate do. What the user did not give, babysit
takes from it, and says so (the ``launch`` entry's ``slurm``, the console)::

    launch.nnodes       SLURM_STEP_NUM_NODES       the step's node count (``N``; pass
                                                   ``--nnodes MIN:N`` for an elastic run)
    launch.node_rank    SLURM_NODEID               this node's index in the step (0 leads)
    nodes.leader        SLURM_STEP_NODELIST,       the step's first node, on a port made from
                        SLURM_JOB_ID               the job id (``leader_port``); the leader
                                                   picks the rendezvous port itself, as with no
                                                   ``launch.rdzv_endpoint``
    run_dir             SLURM_JOB_ID               ``runs/<name>-<job id>`` under the folder
                                                   babysit starts in: the same on every node,
                                                   and on a requeue (same job id)

What the user gives wins: a command-line option, then the config file's key. Outside ``srun``
(a batch script's own shell, a login node) nothing is read. The host babysit names a node by
(findings, ``exclude_hosts``) is the Slurm node name, ``SLURMD_NODENAME``: what a job's
``ExcNodeList`` takes.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from babysit.supervisor.config.address import format_address

PORT_BASE = 20000
PORT_SPAN = 10000
"""The leader's port under Slurm: ``PORT_BASE + job id % PORT_SPAN`` (20000-29999, below the
kernel's ephemeral range), so two jobs that share a node listen on different ports."""


def leader_port(job_id: str) -> int:
    """The port the leader listens on in job ``job_id`` (every node computes the same)."""
    digits = re.sub(r"\D", "", job_id) or "0"
    return PORT_BASE + int(digits) % PORT_SPAN


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list (``gpu[007-009,012],cpu3`` -> ``gpu007``;
    ``rack[1-2]-n[01-04]`` -> ``rack1-n01``), as ``scontrol show hostnames | head -n 1``."""
    depth, end = 0, len(nodelist)
    for i, ch in enumerate(nodelist):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            end = i
            break
    first = nodelist[:end].strip()
    # Each bracket's first range's first number, as written (zero padding kept).
    host = re.sub(r"\[([^\]\-,]+)[^\]]*\]", lambda m: m.group(1), first)
    if not host or "[" in host or "]" in host:
        raise ValueError(f"not a Slurm host list: {nodelist!r}")
    return host


def under_srun(env: Mapping[str, str] = os.environ) -> bool:
    """This process is a task of an ``srun`` step (a batch script's own shell is not)."""
    return bool(env.get("SLURM_STEP_ID") and env.get("SLURM_JOB_ID"))


def node_name(env: Mapping[str, str] = os.environ) -> str | None:
    """This node's Slurm name (``SLURMD_NODENAME``), or None outside a Slurm job."""
    return env.get("SLURMD_NODENAME") or None


@dataclass(frozen=True, slots=True)
class SlurmStep:
    """One ``srun`` task's view of its step."""

    job_id: str
    nodes: int
    """``SLURM_STEP_NUM_NODES``."""
    tasks: int
    """``SLURM_STEP_NUM_TASKS``: one babysitter per node when it equals ``nodes``."""
    node_id: int
    """``SLURM_NODEID``: this node's index in the step."""
    nodelist: str
    """``SLURM_STEP_NODELIST``."""
    node_name: str | None = None
    """``SLURMD_NODENAME``."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> SlurmStep | None:
        """The step this process runs in, or None outside ``srun`` (no ``SLURM_STEP_ID``: a
        batch script's own shell is no step of babysit's). Raises ``ValueError`` naming the
        variable that does not read."""
        if not under_srun(env):
            return None

        def number(name: str, default: str | None = None) -> int:
            text = env.get(name, default)
            if text is None or not text.strip().isdigit():
                raise ValueError(f"{name}={text!r} is not a number")
            return int(text)

        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
        first_host(nodelist)  # a list that does not read is said now, not at the leader
        nodes = number("SLURM_STEP_NUM_NODES", env.get("SLURM_NNODES"))
        return cls(job_id=env["SLURM_JOB_ID"], nodes=nodes,
                   tasks=number("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS", str(nodes))),
                   node_id=number("SLURM_NODEID"), nodelist=nodelist,
                   node_name=node_name(env))

    @property
    def leader(self) -> str:
        """Where the leader listens: the step's first node, on ``leader_port``."""
        return format_address(first_host(self.nodelist), leader_port(self.job_id))


@dataclass(frozen=True, slots=True)
class Taken:
    """A run under Slurm: its step, and what it took from it (for the ``launch`` entry and
    the console)."""

    step: SlurmStep
    keys: dict[str, str] = field(default_factory=dict)
    """Config key -> ``value (VARIABLE)``, for each key babysit filled in."""

    def to_json(self) -> dict[str, Any]:
        return {"job_id": self.step.job_id, "node": self.step.node_name,
                "took": dict(self.keys)}

    @staticmethod
    def fields(taken: Taken | None) -> dict[str, Any]:
        """The ``launch`` entry's ``slurm`` field: the job, this node, what was taken."""
        return {} if taken is None else {"slurm": taken.to_json()}

    def describe(self) -> str:
        took = "; ".join(f"{k} {v}" for k, v in self.keys.items()) or "nothing (all given)"
        return (f"babysit: Slurm job {self.step.job_id}, node "
                f"{self.step.node_name or self.step.node_id}: took {took}")


def _given(section: Any, key: str) -> bool:
    return isinstance(section, dict) and any(
        isinstance(k, str) and k.replace("-", "_") == key and v is not None
        for k, v in section.items())


def fill(data: dict[str, Any], step: SlurmStep, source: str) -> dict[str, str]:
    """Fill ``data`` (a raw config mapping, the command line's options already in it) with
    what ``step`` says and the user did not: ``launch.nnodes``, ``launch.node_rank``,
    ``nodes.leader``. Returns what was taken (key -> ``value (VARIABLE)``). Raises
    ``ValueError`` for a step babysit cannot run as (several tasks on a node, or a
    single-node run started on several nodes)."""
    launch = data.get("launch")
    if not isinstance(launch, dict):
        return {}
    taken: dict[str, str] = {}
    if not _given(launch, "nnodes"):
        launch["nnodes"] = str(step.nodes)
        taken["launch.nnodes"] = f"{step.nodes} (SLURM_STEP_NUM_NODES)"
    nnodes = str(next(v for k, v in launch.items()
                      if isinstance(k, str) and k == "nnodes"))
    most = int(nnodes.rpartition(":")[2]) if re.fullmatch(r"\d+(:\d+)?", nnodes) else 0
    if step.nodes > 1 and most == 1:
        raise ValueError(
            f"{source}: launch.nnodes: this srun step runs babysit on {step.nodes} nodes, but "
            f"launch.nnodes is 1: each node would run a one-node job of its own, into the same "
            f"run directory. Leave launch.nnodes unset (babysit takes the step's node count), "
            f"or run the step on one node (srun -N1).")
    if most > 1 and not _given(launch, "node_rank"):
        if step.tasks != step.nodes:
            raise ValueError(
                f"{source}: this srun step runs {step.tasks} tasks on {step.nodes} node(s): "
                f"babysit runs one babysitter per node, which starts the node's ranks itself. "
                f"Use srun --ntasks-per-node=1 (or #SBATCH --ntasks-per-node=1).")
        launch["node_rank"] = step.node_id
        taken["launch.node_rank"] = f"{step.node_id} (SLURM_NODEID)"
    nodes = data.get("nodes")
    if most > 1 and not _given(nodes, "leader") and not _given(launch, "rdzv_endpoint"):
        section = dict(nodes) if isinstance(nodes, dict) else {}
        section["leader"] = step.leader
        data["nodes"] = section
        taken["nodes.leader"] = f"{step.leader} (SLURM_STEP_NODELIST, SLURM_JOB_ID)"
    return taken


def run_dir(name: str, step: SlurmStep) -> str:
    """The run directory a run under Slurm defaults to: the same on every node, and again
    when the job is requeued (its id is kept)."""
    return os.path.join("runs", f"{name}-{step.job_id}")
