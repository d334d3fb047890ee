"""Checks of the script, the folders, the disk and the metrics port: fast, no torch, at every
``babysit run``."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from pathlib import Path

from babysit.checkpoints import Catalog
from babysit.supervisor.commands.doctor.core import CheckResult, Context, ProbeError, Status, probe
from babysit.supervisor.config.plan import RunPlan
from babysit.supervisor.services.exporter import DEFAULT_PORT

GIB = 1024**3


def nearest_existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists: where a folder-to-be would be created."""
    probe_at = Path(os.path.abspath(path))
    while not probe_at.exists() and probe_at.parent != probe_at:
        probe_at = probe_at.parent
    return probe_at


def script(plan: RunPlan, ctx: Context) -> CheckResult:
    """The script exists, parses, and its top-level imports resolve in the run's interpreter."""
    launch = plan.config.launch
    if plan.script is not None and not plan.script.is_file():
        return CheckResult(
            "script", Status.FAIL, f"launch.script '{launch.script}' not found (looked at "
            f"{plan.script})", f"Fix the path in {plan.source}; relative paths start at the "
            f"config file's folder ({plan.base}).")
    if launch.no_python:
        if plan.script is not None and not os.access(plan.script, os.X_OK):
            return CheckResult("script", Status.FAIL, f"{plan.script} is not executable, and "
                               "launch.no_python runs it directly", f"chmod +x {plan.script}")
        return CheckResult("script", Status.PASS, f"{plan.script} is executable (no_python: "
                           "imports not checked)")
    args = {"script": str(plan.script)} if plan.script else {"module": launch.module}
    try:
        found = probe(plan, ctx, "imports", args, timeout_s=30)
    except ProbeError as exc:
        return CheckResult("script", Status.FAIL, str(exc),
                           "Set launch.python to a working interpreter (default: babysit's own).")
    if "error" in found:
        fix = (f"Fix the syntax error in {found['error'].split(',')[0]}." if found.get("syntax")
               else f"Install the package that provides {launch.module} into {plan.python}, or "
               f"start babysit from the folder that contains it ({ctx.cwd} now).")
        return CheckResult("script", Status.FAIL, found["error"], fix)
    missing: list[str] = found["missing"]
    if missing:
        names = ", ".join(missing)
        return CheckResult(
            "script", Status.FAIL,
            f"{found['path']} imports {names}, which {plan.python} cannot find",
            f"Install what provides them into the run's interpreter (`{plan.python} -m pip "
            f"install {' '.join(missing)}`; a package's name may differ from its module's), or, "
            f"for your own modules, put them beside the script or on PYTHONPATH in launch.env "
            f"(workers start in {ctx.cwd}).")
    checked: list[str] = found["checked"]
    uncertain: list[str] = found["uncertain"]
    if uncertain:
        return CheckResult(
            "script", Status.WARN, f"{found['path']} imports {', '.join(uncertain)} after "
            f"changing sys.path, and {plan.python} cannot find them without that change",
            "If the script's own sys.path change makes them importable, ignore this; to let "
            "doctor see them, set PYTHONPATH in launch.env instead of editing sys.path.")
    return CheckResult("script", Status.PASS,
                       f"{len(checked)} top-level import(s) resolve with {plan.python}")


def run_dir(plan: RunPlan, ctx: Context) -> CheckResult:
    return _writable("run_dir", plan.run_dir)


def checkpoint_dir(plan: RunPlan, ctx: Context) -> CheckResult:
    return _writable("checkpoints.dir", plan.checkpoint_dir)


def _writable(key: str, folder: Path) -> CheckResult:
    """Create and delete a file where ``folder`` is (or will be created), to prove it can be."""
    where = nearest_existing(folder)
    if not where.is_dir():
        return CheckResult(key, Status.FAIL, f"cannot create {folder}: {where} is a file, not "
                           "a folder", f"Set {key} to a path that is not inside a file.")
    try:
        fd, name = tempfile.mkstemp(prefix=".babysit-doctor-", dir=where)
    except OSError as exc:
        return CheckResult(key, Status.FAIL, f"cannot write in {where} ({exc.strerror})",
                           f"Set {key} to a folder you can write to, or fix the permissions "
                           f"of {where}.")
    os.close(fd)
    os.unlink(name)
    if where == folder:
        return CheckResult(key, Status.PASS, f"{folder} is writable")
    return CheckResult(key, Status.PASS, f"{folder} will be created in {where} (writable)")


def disk_space(plan: RunPlan, ctx: Context) -> CheckResult:
    """Free space for ``checkpoints.keep`` checkpoints plus the one being written.

    One checkpoint's size is the newest committed one's in the catalog, else the configured
    ``health.expected_checkpoint_gib``; with neither it cannot be estimated (a warning).
    """
    name = "disk space"
    keep = plan.config.checkpoints.keep
    where = nearest_existing(plan.checkpoint_dir)
    if not where.is_dir():
        return CheckResult(name, Status.SKIP, "not measured: checkpoints.dir is unusable (above)")
    try:
        free = shutil.disk_usage(where).free
    except OSError as exc:
        return CheckResult(name, Status.FAIL, f"cannot measure free space on {where} "
                           f"({exc.strerror})", "Check that the file system is mounted.")
    existing = Catalog(plan.checkpoint_dir).checkpoints() if where == plan.checkpoint_dir else []
    held = sum(c.manifest.total_bytes for c in existing[-keep:])
    if existing:
        size, source = existing[-1].manifest.total_bytes, f"step {existing[-1].step}'s size"
    elif plan.config.health.expected_checkpoint_gib is not None:
        size = int(plan.config.health.expected_checkpoint_gib * GIB)
        source = "health.expected_checkpoint_gib"
    else:
        # Unknown size: only a nearly full disk is worth a warning before the first save (every
        # fresh run would warn otherwise, and warnings nobody acts on teach people to skip them).
        status = Status.PASS if free >= plan.config.health.min_free_disk_gib * GIB else Status.WARN
        return CheckResult(
            name, status, f"{_gib(free)} free on {where}; checkpoint size unknown (no "
            "checkpoint saved there yet)", f"Set health.expected_checkpoint_gib to one "
            f"checkpoint's size, so doctor can check room for checkpoints.keep={keep}.")
    # Retention deletes the oldest only after the next save committed: keep + 1 at the peak.
    need = max(size, (keep + 1) * size - held)
    summary = (f"{_gib(free)} free on {where}; need {_gib(need)} for keep={keep} + 1 in flight "
               f"at {_gib(size)} each ({source})")
    if free < need:
        return CheckResult(name, Status.FAIL, summary, "Free space there, lower "
                           "checkpoints.keep, or point checkpoints.dir at a larger disk.")
    minimum = plan.config.health.min_free_disk_gib * GIB
    if free - need < minimum:
        return CheckResult(name, Status.WARN, summary + f", leaving less than "
                           f"health.min_free_disk_gib ({_gib(minimum)})",
                           "Free space there, or the health job will warn during the run.")
    return CheckResult(name, Status.PASS, summary)


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def metrics_port(plan: RunPlan, ctx: Context) -> CheckResult:
    """The Prometheus endpoint's port is free (another run on this machine may hold it)."""
    name = "metrics port"
    config = plan.config.prometheus
    if not config.enabled:
        return CheckResult(name, Status.SKIP, "prometheus.enabled is false")
    if config.port == 0:
        return CheckResult(name, Status.PASS, "prometheus.port is 0: a free port is picked")
    try:
        family = socket.getaddrinfo(config.host, config.port, type=socket.SOCK_STREAM,
                                    flags=socket.AI_PASSIVE)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            # As the endpoint itself binds: a port in TIME_WAIT from an earlier run is free.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((config.host, config.port))
    except OSError as exc:
        taken = " (another babysit run on this machine?)" if config.port == DEFAULT_PORT else ""
        return CheckResult(name, Status.FAIL, f"cannot listen on {config.host}:{config.port}"
                           f"{taken}: {exc.strerror or exc}", "Set prometheus.port in the run "
                           "config to a free port (and point your scrape config at it), or "
                           "turn the endpoint off with prometheus.enabled: false.")
    return CheckResult(name, Status.PASS, f"http://{config.host}:{config.port}/metrics is free")
