"""What the supervisor examines when something went wrong: rank logs, stacks, incident folders.

The control loop decides *when* (a crash, a hang finding, a disruptive remedy); these functions
read the attempt's files and processes and say *what happened*. They journal nothing and send
no alert: the loop does that with what they return.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import psutil

from babysit.policies.detectors import CrashClass, classify
from babysit.policies.types import Finding, Incident, Remedy
from babysit.supervisor.node import flight_recorder, incident, launcher, stacks

Diagnosis = tuple[Any, Any]
"""``(dumps, verdict)`` from ``stacks.diagnose``."""


def teardown_only(code: int, rank_pids: Mapping[int, int], closed_ranks: set[int],
                  attempt_dir: Path) -> bool:
    """Every rank closed its run cleanly and the ranks that failed left no error of their own
    (killed by a signal, no traceback): the training finished and only the process teardown
    crashed (gloo in torch 2.13 sometimes aborts at exit with "terminate called without an
    active exception"). An exception raised after ``run.close()`` leaves a traceback and stays
    a crash."""
    if not rank_pids or set(rank_pids) - closed_ranks:
        return False
    logs = launcher.rank_logs(attempt_dir)
    classes = {classify(code, None, launcher.tail(path), None).crash_class
               for path in logs.values()}
    return classes <= {CrashClass.KILLED, CrashClass.UNKNOWN}


def ranks_all_alive(pids: Iterable[int]) -> bool:
    """No rank process has died (a zombie is dead: torchrun has not reaped it yet)."""
    for pid in pids:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return False
        except psutil.Error:
            return False
    return True


def diagnose_hang(finding: Finding, rank_pids: Mapping[int, int]
                  ) -> tuple[Finding, Diagnosis, dict[str, Any]]:
    """Dump every rank's stack and name the rank that differs (the one stuck outside the
    collective the others wait in). Returns the finding (naming that rank when one is found),
    the diagnosis for the incident folder, and the fields of the ``hang_diagnosis`` entry."""
    started = time.monotonic()
    dumps, verdict = stacks.diagnose(dict(rank_pids))
    fields = {"suspects": list(verdict.suspects), "reason": verdict.reason,
              "evidence": verdict.to_dict().get("evidence"),
              "seconds": round(time.monotonic() - started, 3)}
    if verdict.suspects:
        named = ", ".join(map(str, verdict.suspects))
        finding = dataclasses.replace(
            finding, ranks=tuple(verdict.suspects),
            message=f"hang at step {finding.step}: rank {named} is stuck ({verdict.reason})",
            evidence={**finding.evidence, "stacks": verdict.to_dict()})
    return finding, (dumps, verdict), fields


def write_incident(run_dir: Path, attempt: int, finding: Finding, remedy: Remedy | str,
                   diagnosis: Diagnosis | None, tails: Mapping[int, str]) -> Path:
    """The incident folder: what was seen and done, the ranks' log tails (by global rank),
    the stacks, and (NCCL only) the ranks' flight recorder dumps, asked for while the ranks are
    still alive: call this before stopping them. ``remedy`` is the policy's answer, or in words
    what was done instead (a follower node reports its finding to the leader, which decides)."""
    dumps, verdict = diagnosis if diagnosis else (None, None)
    summary: dict[str, Any] = {"what": finding.message, "attempt": attempt,
                               "finding": finding.to_json()}
    if isinstance(remedy, str):
        summary["action"] = remedy
    else:
        summary.update(action=f"{remedy.action.value}: {remedy.reason}",
                       remedy=remedy.to_json())
    folder = incident.write_incident(run_dir, finding.incident.value, finding.step, summary,
                                     dumps, tails, verdict)
    if flight_recorder.collect(run_dir / "attempts" / str(attempt), folder,
                               ask=finding.incident is Incident.HANG):
        summary_txt = folder / "summary.txt"
        text = summary_txt.read_text()
        summary_txt.write_text(text + ("" if "files here:" in text else "files here:\n")
                               + "  flight_recorder/rank_<r>: torch's NCCL flight recorder per "
                                 "rank (read it with torchfrtrace)\n")
    return folder
