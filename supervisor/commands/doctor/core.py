"""The pieces every check shares: results, the context checks read, running one safely, output."""

from __future__ import annotations

import enum
import functools
import json
import os
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import babysit
from babysit.supervisor.commands.doctor import _probe
from babysit.supervisor.config.plan import RunPlan

# The folder that holds this babysit's ``babysit`` package: a probe running in the run's own
# interpreter (which may not have babysit installed) imports it from there.
BABYSIT_ROOT = Path(babysit.__file__).resolve().parent.parent


class Status(str, enum.Enum):
    """How a check ended. Only ``FAIL`` makes ``babysit doctor`` exit non-zero.

    - ``PASS``: checked, and fine.
    - ``WARN``: the run can start, but something may bite later (the fix says what).
    - ``FAIL``: the run would fail, or fail to protect itself (e.g. cannot save checkpoints).
    - ``SKIP``: does not apply to this config or machine (no GPUs, single node, no sinks).
    """

    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"


_SYMBOL = {Status.PASS: "ok  ", Status.WARN: "WARN", Status.FAIL: "FAIL", Status.SKIP: "skip"}


@dataclass(frozen=True, slots=True)
class CheckResult:
    """One check's outcome. ``summary`` says what was found (one line); ``fix`` says what to do
    (None when there is nothing to do); ``seconds`` is how long the check took."""

    name: str
    status: Status
    summary: str
    fix: str | None = None
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status.value, "summary": self.summary,
                "fix": self.fix, "seconds": round(self.seconds, 3)}


@dataclass(frozen=True)
class Context:
    """What checks read besides the plan; the defaults are the real world.

    ``environ``: babysit's environment (the workers get it plus ``launch.env``). ``nvml``: the
    NVML module to use instead of ``pynvml`` (the seam tests use). ``send_alert``: send a real
    test alert instead of probing the sinks silently. ``cwd``: where the workers will start.
    """

    environ: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    nvml: ModuleType | None = None
    send_alert: bool = False
    cwd: Path = field(default_factory=Path.cwd)


Probe = Callable[[RunPlan, Context], CheckResult]


@dataclass(frozen=True, slots=True)
class Check:
    """A registered check: ``fast`` ones run at every ``babysit run`` start (no torch import, no
    network beyond one TCP connect), the rest only under ``babysit doctor``."""

    name: str
    fn: Probe
    fast: bool


def run_one(check: Check, plan: RunPlan, ctx: Context) -> CheckResult:
    """Run ``check``; never raises: an unexpected exception becomes a failure naming it."""
    start = time.monotonic()
    try:
        result = check.fn(plan, ctx)
    except Exception as exc:
        result = CheckResult(
            check.name, Status.FAIL, f"the check itself crashed: {type(exc).__name__}: {exc}",
            "This is a bug in babysit doctor; please report it with the config.")
    return CheckResult(result.name, result.status, result.summary, result.fix,
                       time.monotonic() - start)


def worker_env(plan: RunPlan, ctx: Context) -> dict[str, str]:
    """The environment the workers start with (babysit's plus ``launch.env``), as the launcher
    builds it, minus the per-attempt variables."""
    return {**ctx.environ, **plan.config.launch.env}


@functools.cache
def _probe_source() -> str:
    return Path(_probe.__file__).read_text()


def probe(plan: RunPlan, ctx: Context, name: str, args: dict[str, Any] | None = None,
          timeout_s: float = 60.0) -> dict[str, Any]:
    """Run probe ``name`` of ``_probe.py`` in the run's interpreter, environment and working
    directory; its JSON result.

    Raises ``ProbeError`` with a sentence for a person when the interpreter cannot start, the
    probe times out, or it prints no result (its stderr's tail is included).
    """
    env = worker_env(plan, ctx)
    cmd = [plan.python, "-c", _probe_source(), name, json.dumps(args or {})]
    try:
        proc = subprocess.run(cmd, env=env, cwd=ctx.cwd, capture_output=True, text=True,
                              timeout=timeout_s, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise ProbeError(f"the run's Python '{plan.python}' does not exist") from None
    except PermissionError:
        raise ProbeError(f"the run's Python '{plan.python}' is not executable") from None
    except subprocess.TimeoutExpired:
        raise ProbeError(f"'{plan.python}' did not finish the {name} probe within "
                         f"{timeout_s:g} s") from None
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(_probe.MARKER):
            result: dict[str, Any] = json.loads(line[len(_probe.MARKER):])
            return result
    tail = " | ".join(proc.stderr.strip().splitlines()[-3:]) or "no output"
    raise ProbeError(f"'{plan.python}' exited {proc.returncode} in the {name} probe: {tail}")


class ProbeError(Exception):
    """A probe subprocess could not give an answer; the message is one sentence."""


def render(results: Sequence[CheckResult], problems_only: bool = False) -> str:
    """The table people read: status, name, summary; the fix indented below when there is one;
    then a one-line verdict. ``problems_only`` leaves out passed and skipped checks (for the
    fast checks at ``babysit run``, which should be quiet when all is well)."""
    width = max((len(r.name) for r in results), default=0)
    lines = []
    for r in results:
        if problems_only and r.status in (Status.PASS, Status.SKIP):
            continue
        lines.append(f"{_SYMBOL[r.status]}  {r.name:<{width}}  {r.summary}")
        if r.fix and r.status is not Status.PASS:
            lines.append(f"      {'':<{width}}  fix: {r.fix}")
    lines.append(verdict(results))
    return "\n".join(lines) + "\n"


def verdict(results: Sequence[CheckResult]) -> str:
    counts = {s: sum(r.status is s for r in results) for s in Status}
    tally = (f"{counts[Status.PASS]} passed, {counts[Status.WARN]} warned, "
             f"{counts[Status.FAIL]} failed, {counts[Status.SKIP]} skipped")
    if counts[Status.FAIL]:
        return f"NOT READY: {tally}. Fix the failures above before a long run."
    if counts[Status.WARN]:
        return f"READY, with warnings: {tally}."
    return f"READY: {tally}."


def exit_code(results: Sequence[CheckResult]) -> int:
    """0 when nothing failed (warnings are fine), else 1."""
    return 1 if any(r.status is Status.FAIL for r in results) else 0
