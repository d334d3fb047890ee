"""``babysit doctor CONFIG.yaml``: pre-flight checks before a long run, each with its fix.

Every check is a small function ``(plan, ctx) -> CheckResult`` registered in ``CHECKS``, in the
order they print. ``fast`` ones (no torch import, at most one TCP connect) also run at the start
of every ``babysit run`` through ``fast_checks``; the rest only under ``babysit doctor``::

    config           the file validates (schema, policy)                         fast
    script           the script exists and its top-level imports resolve in the  fast
                     run's interpreter, environment and working directory
    torch            torch imports there, with the backend the config implies    (imports torch)
                     (NCCL for GPU configs, gloo for CPU)
    gpu health       NVML: temperature, ECC errors, pages pending retirement;    (NVML)
                     skipped cleanly without GPUs
    run_dir          writable (a file is created and deleted where it will be)   fast
    checkpoints.dir  writable                                                    fast
    disk space       room for checkpoints.keep checkpoints plus one in flight    fast
    checkpoint io    a real save and load of a tiny model, where checkpoints go  (imports torch)
    rendezvous       multi-node: the endpoint resolves; node 0's port is free,   fast
                     node 0's host answers the others (nothing listening yet
                     is fine: the store opens with node 0's torchrun)
    node address     multi-node: the address the others reach this node at, and  fast
                     a host name that resolves elsewhere (127.0.0.1)
    alert config     every sink's URL variable is set                            fast
    metrics port     prometheus.port is free to listen on (when enabled)         fast
    alert sinks      every sink answers, without sending an alert (or sends a    (network)
                     real test alert with --send-alert)

What the workers will see is what is checked: the interpreter is ``launch.python``, the
environment babysit's plus ``launch.env``, the working directory babysit's. Checks never raise:
an unexpected exception becomes a failure naming it. Exit code 0 only when nothing failed.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TextIO

from babysit.supervisor.commands.doctor import alerting, checks, network, runtime
from babysit.supervisor.commands.doctor.core import (
    Check,
    CheckResult,
    Context,
    Status,
    exit_code,
    render,
    run_one,
    verdict,
)
from babysit.supervisor.config import plan as plan_mod
from babysit.supervisor.config import schema as cfg
from babysit.supervisor.config.plan import RunPlan

__all__ = [
    "CHECKS",
    "Check",
    "CheckResult",
    "Context",
    "Status",
    "doctor_main",
    "fast_checks",
    "load",
    "render",
    "run_checks",
    "verdict",
]

CHECKS: tuple[Check, ...] = (
    Check("script", checks.script, fast=True),
    Check("torch", runtime.torch_backend, fast=False),
    Check("gpu health", runtime.gpu_health, fast=False),
    Check("run_dir", checks.run_dir, fast=True),
    Check("checkpoints.dir", checks.checkpoint_dir, fast=True),
    Check("disk space", checks.disk_space, fast=True),
    Check("checkpoint io", runtime.checkpoint_io, fast=False),
    Check("rendezvous", network.rendezvous, fast=True),
    Check("node address", network.node_address, fast=True),
    Check("alert config", alerting.alert_config, fast=True),
    Check("metrics port", checks.metrics_port, fast=True),
    Check("alert sinks", alerting.alert_sinks, fast=False),
)
"""Every check but ``config`` (which is loading the plan itself), in the order they print."""


def run_checks(plan: RunPlan, ctx: Context | None = None,
               fast_only: bool = False) -> list[CheckResult]:
    """Run the registered checks (only the fast ones if ``fast_only``), at the same time; the
    results come back in ``CHECKS`` order. Never raises."""
    ctx = ctx or Context()
    chosen = [c for c in CHECKS if c.fast or not fast_only]
    # Concurrently: the slow ones wait on subprocesses (two torch imports) and the network.
    with ThreadPoolExecutor(max_workers=len(chosen)) as pool:
        return list(pool.map(lambda c: run_one(c, plan, ctx), chosen))


def fast_checks(plan: RunPlan) -> list[CheckResult]:
    """The checks cheap enough for every ``babysit run`` start (well under a second or two: no
    torch import, no HTTP; at most a 3 s TCP connect for multi-node). ``plan`` is already loaded,
    so the config check passes; print the warnings and failures, and stop on a failure."""
    return [_config_ok(plan, 0.0), *run_checks(plan, Context(), fast_only=True)]


def load(config_path: str) -> tuple[CheckResult, RunPlan | None]:
    """The ``config`` check, and the plan the other checks examine (None if the file is unusable).

    ``plan.from_file`` also refuses a missing script, an unwritable folder and an unset alert
    variable; each of those has its own check here with its own fix, so for doctor the plan is
    resolved without them and only the schema and the policy decide this check.
    """
    start = time.monotonic()
    try:
        strict = plan_mod.from_file(config_path)
    except cfg.ConfigError:
        pass  # schema, policy, or one of the problems the other checks report: see below
    else:
        return _config_ok(strict, time.monotonic() - start), strict
    try:
        config = cfg.parse(cfg.read_yaml(config_path), config_path)
    except cfg.ConfigError as exc:
        return CheckResult("config", Status.FAIL, str(exc).replace("\n", "; "),
                           "Fix the keys named; `babysit schema` documents every key.",
                           time.monotonic() - start), None
    source = Path(config_path)
    plan = plan_mod.resolve(config, source.resolve().parent, config_path, source.stem,
                            check=False)
    from babysit.policies.loader import PolicyError, load_policy

    try:
        load_policy(config.policy.name, config.policy.overrides)
    except PolicyError as exc:
        return CheckResult("config", Status.FAIL, f"{config_path}: policy: {exc}",
                           "Fix the policy name or its overrides.",
                           time.monotonic() - start), plan
    return _config_ok(plan, time.monotonic() - start), plan


def _config_ok(plan: RunPlan, seconds: float) -> CheckResult:
    launch = plan.config.launch
    what = f"script {launch.script}" if launch.script else f"module {launch.module}"
    return CheckResult("config", Status.PASS, f"{plan.source} validates: run '{plan.name}', "
                       f"{launch.nproc_per_node} worker(s)/node x {launch.nnodes} node(s), "
                       f"{what}, policy '{plan.config.policy.name}'", None, seconds)


def doctor_main(config_path: str, send_alert: bool, as_json: bool, out: TextIO) -> int:
    """``babysit doctor``: run every check, print the table (or ``--json``: a list of result
    objects with name, status, summary, fix, seconds) to ``out``; 0 when nothing failed, else 1.
    ``send_alert`` sends a real test alert to every sink instead of a silent probe."""
    first, plan = load(config_path)
    results = [first]
    if plan is not None:
        results += run_checks(plan, Context(send_alert=send_alert))
    if as_json:
        out.write(json.dumps([r.to_json() for r in results], indent=2) + "\n")
    else:
        out.write(render(results))
    return exit_code(results)
