"""Turning a config file, or torchrun-style arguments, into a fully resolved ``RunPlan``.

Everything a run needs to start is decided here, before any process exists, so ``babysit
validate`` and ``babysit run`` report the same problems in the same words.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from babysit.supervisor.config import schema as cfg
from babysit.supervisor.config import slurm as slurm_env
from babysit.supervisor.config.address import format_address, parse_address


@dataclass(frozen=True)
class RunPlan:
    config: cfg.RunConfig
    source: str
    """Where the config came from, for messages: a file path or ``command line``."""
    base: Path
    """Folder that relative paths in the config start from."""
    name: str
    run_dir: Path
    script: Path | None
    python: str
    checkpoint_dir: Path
    shared_dir: Path
    """The run directory every node shares (a multi-node run's record and its ``leader/`` and
    ``nodes/`` folders); ``run_dir`` is this node's own folder in it when it follows."""
    slurm: slurm_env.Taken | None = None
    """The Slurm step this babysitter runs in (under ``srun``), and what it took from it."""

    @property
    def node_rank(self) -> int:
        return self.config.launch.node_rank

    @property
    def leader_address(self) -> str:
        """Where node 0's babysitter listens (multi-node runs): ``nodes.leader``, else the
        rendezvous host on the port after the rendezvous port."""
        if self.config.nodes.leader is not None:
            return self.config.nodes.leader
        endpoint = self.config.launch.rdzv_endpoint
        if endpoint is None:
            raise cfg.ConfigError("a multi-node run needs nodes.leader or launch.rdzv_endpoint")
        host, port = parse_address(endpoint)
        return format_address(host, port + 1)

    def following(self) -> RunPlan:
        """This plan for a node that follows: its own folder, ``nodes/<node rank>/``."""
        own = self.shared_dir / "nodes" / str(self.node_rank)
        return self if self.run_dir == own else dataclasses.replace(self, run_dir=own)

    def secret(self) -> bytes:
        """The run's shared secret: ``BABYSIT_SECRET``, else ``nodes.secret``."""
        text = os.environ.get(SECRET_ENV) or self.config.nodes.secret
        if not text:
            raise cfg.ConfigError(_NO_SECRET)
        return text.encode()


    @property
    def world_size(self) -> int | None:
        """Ranks expected per attempt when the config fixes it; None when torchrun decides."""
        nproc = self.config.launch.nproc_per_node
        nnodes = self.config.launch.nnodes
        if isinstance(nproc, int) and ":" not in nnodes:
            return nproc * int(nnodes)
        return None


SECRET_ENV = "BABYSIT_SECRET"
MIN_SECRET = 16
"""Shortest secret accepted: a handshake overheard on the network lets anyone test guesses of
the secret offline, so it must be too long to guess."""
_NO_SECRET = (
    f"a multi-node run needs a secret shared by every node's babysitter: export {SECRET_ENV} "
    f"(the same value on every node, e.g. {SECRET_ENV}=$(openssl rand -hex 32) in the job "
    f"script before srun), or set nodes.secret in the config.")


def from_file(path: str | Path, run_dir: str | None = None,
              launch_overrides: dict[str, Any] | None = None,
              overrides: dict[str, Any] | None = None,
              slurm: slurm_env.SlurmStep | None = None) -> RunPlan:
    """Load, validate and resolve a config file. Raises ``ConfigError`` listing every problem.

    ``launch_overrides`` (torchrun options from the command line) replace keys of the file's
    ``launch`` section, ``overrides`` top-level keys, before validation (a mapping merges into
    the file's section of that name). ``slurm``: the step babysit runs in (``srun``), which
    fills in what neither gave (``config.slurm.fill``).
    """
    data = cfg.read_yaml(path)
    if launch_overrides:
        launch = data.get("launch")
        data["launch"] = {**(launch if isinstance(launch, dict) else {}), **launch_overrides}
    for key, value in (overrides or {}).items():
        section = data.get(key)
        if isinstance(section, dict) and isinstance(value, dict):
            value = {**section, **value}
        data[key] = value
    base = Path(path).resolve().parent
    return from_mapping(data, str(path), base, Path(path).stem, run_dir, slurm)


def from_mapping(data: dict[str, Any], source: str, base: Path, stem: str,
                 run_dir: str | None = None,
                 slurm: slurm_env.SlurmStep | None = None) -> RunPlan:
    """Same as ``from_file`` for a config built in memory (the torchrun-style command line)."""
    taken = None
    if slurm is not None:
        try:
            taken = slurm_env.Taken(slurm, slurm_env.fill(data, slurm, source))
        except ValueError as exc:
            raise cfg.ConfigError(str(exc)) from None
    return resolve(cfg.parse(data, source), base, source, stem, run_dir, slurm=taken)


def resolve(config: cfg.RunConfig, base: Path, source: str, stem: str,
            run_dir_override: str | None = None, check: bool = True,
            slurm: slurm_env.Taken | None = None) -> RunPlan:
    """Fill in every default (name, run directory, script path, interpreter, checkpoint folder).

    With ``check`` the file-system, policy and alert checks run too and every problem found is
    raised as one ``ConfigError``; ``babysit doctor`` resolves without them so that it can report
    each problem as a check of its own, with its own fix. ``slurm``: the step babysit runs in;
    its job id names the default run directory.
    """
    script = cfg.resolve_script(config, base)
    if config.name:
        name = config.name
    elif stem == "command line":
        name = script.stem if script else str(config.launch.module).rsplit(".", 1)[-1]
    else:
        name = stem
    if run_dir_override is not None:
        run_dir = Path(run_dir_override).resolve()
    elif config.run_dir is not None:
        run_dir = Path(config.run_dir).resolve()
    elif slurm is not None:
        run_dir = Path(slurm_env.run_dir(name, slurm.step)).resolve()
        slurm.keys["run_dir"] = f"{run_dir} (SLURM_JOB_ID)"
        run_dir_override = str(run_dir)  # the same on every node: a multi-node run may use it
    else:
        run_dir = cfg.default_run_dir(name).resolve()
    checkpoint_dir = cfg.checkpoint_dir(config, base, run_dir)
    problems = []
    shared_dir = run_dir
    if config.launch.multinode:
        problems = _check_multinode(config, source, run_dir_override)
        if config.launch.node_rank > 0:  # the leader's journal is the run's record
            run_dir = run_dir / "nodes" / str(config.launch.node_rank)
    if check:
        problems += cfg.check_environment(config, base, run_dir, source)
        problems += _check_policy(config, source)
        problems += _check_alerts(config, source)
        if problems:
            raise cfg.ConfigError("\n".join(problems))
    return RunPlan(
        config=config, source=source, base=base, name=name, run_dir=run_dir, script=script,
        python=config.launch.python or sys.executable, checkpoint_dir=checkpoint_dir,
        shared_dir=shared_dir, slurm=slurm,
    )


def _check_multinode(config: cfg.RunConfig, source: str,
                     run_dir_override: str | None) -> list[str]:
    problems = []
    if run_dir_override is None and config.run_dir is None:
        problems.append(
            f"{source}: run_dir: a multi-node run needs one run directory named the same on "
            f"every node (--run-dir or run_dir, e.g. /shared/runs/$SLURM_JOB_ID): the default "
            f"has the start time in it, which differs between nodes.")
    secret = os.environ.get(SECRET_ENV) or config.nodes.secret
    if not secret:
        problems.append(f"{source}: nodes.secret: {_NO_SECRET}")
    elif len(secret) < MIN_SECRET:
        where = SECRET_ENV if os.environ.get(SECRET_ENV) else "nodes.secret"
        problems.append(f"{source}: {where}: the secret is {len(secret)} characters; use at "
                        f"least {MIN_SECRET} (e.g. $(openssl rand -hex 32)): an overheard "
                        f"handshake lets anyone test guesses offline.")
    return problems


def _check_policy(config: cfg.RunConfig, source: str) -> list[str]:
    from babysit.policies.loader import PolicyError, load_policy

    try:
        load_policy(config.policy.name, config.policy.overrides)
    except PolicyError as exc:
        return [f"{source}: policy: {exc}"]
    return []


def _check_alerts(config: cfg.RunConfig, source: str) -> list[str]:
    from babysit.supervisor.services.alerts import AlertConfigError, resolve_sinks

    try:
        resolve_sinks(config.alerts)
    except AlertConfigError as exc:
        return [f"{source}: alerts: {exc}"]
    return []
