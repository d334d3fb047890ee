"""Incident folders: everything a person needs to understand one incident, in one place.

    run_dir/incidents/0003-hang-step5/
        summary.txt            what happened, which rank, the evidence, what babysit did
        summary.json           the same and more, for tools
        stacks/rank<r>.txt     py-spy's own output (or why there is none)
        logs/rank<r>.tail.txt  the end of the rank's output
        flight_recorder/rank_<r>  torch's NCCL flight recorder (NCCL only)

Folders are numbered in order across the whole run (and across supervisor restarts: the number
continues from what is on disk). The formatting helpers are pure; ``write_incident`` is the
only function that writes a folder, for the single-node loop and a follower alike.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from babysit.policies.types import Finding, Incident, Remedy
from babysit.supervisor.node import flight_recorder
from babysit.supervisor.node.stacks import Diagnosis, StackDump, StackVerdict

__all__ = ["account", "incident_name", "next_number", "render_summary", "summary_record",
           "write_incident"]

_NUMBERED = re.compile(r"^(\d+)-")


def incident_name(number: int, kind: str, step: int) -> str:
    """``0003-hang-step5``. ``kind`` is reduced to lowercase letters, digits, ``_`` and ``-``
    so it is always a safe folder name."""
    safe = re.sub(r"[^a-z0-9_-]+", "_", kind.lower()).strip("_") or "incident"
    return f"{number:04d}-{safe}-step{step}"


def next_number(existing: Iterable[str]) -> int:
    """One more than the highest number among existing folder names (1 for none)."""
    numbers = [int(m[1]) for name in existing if (m := _NUMBERED.match(name))]
    return max(numbers, default=0) + 1


def account(finding: Finding, attempt: int, remedy: Remedy | str) -> dict[str, Any]:
    """The supervisor's own account of an incident (``summary.json``'s ``summary``): what was
    seen and what was done. ``remedy`` is the policy's answer, or in words what was done
    instead (a follower node reports its finding to the leader, which decides)."""
    summary: dict[str, Any] = {"what": finding.message, "attempt": attempt,
                               "finding": finding.to_json()}
    if isinstance(remedy, str):
        summary["action"] = remedy
    else:
        summary.update(action=f"{remedy.action.value}: {remedy.reason}",
                       remedy=remedy.to_json())
    return summary


def summary_record(name: str, kind: str, step: int, summary: Mapping[str, Any],
                   stacks: Mapping[int, StackDump] | None, log_tails: Mapping[int, str],
                   verdict: StackVerdict | None, now: datetime) -> dict[str, Any]:
    """The content of ``summary.json``. ``summary`` is the caller's own account, kept as is."""
    return {
        "incident": name,
        "kind": kind,
        "step": step,
        "time": now.isoformat(timespec="seconds"),
        "summary": dict(summary),
        "verdict": verdict.to_dict() if verdict else None,
        "stacks": {str(r): d.to_dict() for r, d in sorted((stacks or {}).items())},
        "log_tails": sorted(log_tails),
    }


def render_summary(name: str, kind: str, step: int, summary: Mapping[str, Any],
                   stacks: Mapping[int, StackDump] | None, log_tails: Mapping[int, str],
                   verdict: StackVerdict | None, flight_dumps: bool = False) -> str:
    """The short human ``summary.txt``. Uses ``summary["what"]`` (what happened) and
    ``summary["action"]`` (what babysit did) when present; other keys are listed as they are.
    ``flight_dumps``: the folder holds the ranks' flight recorder dumps."""
    lines = [f"incident {name}: {kind} at step {step}", ""]
    lines.append(f"what happened: {summary.get('what', kind)}")
    if verdict is not None:
        named = ", ".join(f"rank {r}" for r in verdict.suspects) or "none stands out"
        lines += [f"which rank:    {named}", f"why:           {verdict.reason}"]
    other = {k: v for k, v in summary.items() if k not in ("what", "action")}
    lines += [f"{k}: {v}" for k, v in other.items()]
    if verdict is not None and verdict.evidence:
        lines += ["", "evidence (innermost frames first):"]
        for rank, frames in sorted(verdict.evidence.items()):
            role = "suspect" if rank in verdict.suspects else \
                "waiting in a collective" if rank in verdict.waiting else ""
            lines.append(f"  rank {rank}" + (f"  [{role}]" if role else ""))
            lines += [f"    {frame}" for frame in frames]
    for rank, dump in sorted((stacks or {}).items()):
        if dump.error is not None:
            lines.append(f"  rank {rank}: no stack: {dump.error}; {dump.hint}")
    lines += ["", f"what babysit did: {summary.get('action', 'nothing yet')}", ""]
    files = (["stacks/rank<r>.txt: py-spy's full dump per rank"] if stacks else []) + \
            (["logs/rank<r>.tail.txt: the end of each rank's output"] if log_tails else []) + \
            (["flight_recorder/rank_<r>: torch's NCCL flight recorder per rank (read it with "
              "torchfrtrace)"] if flight_dumps else [])
    if files:
        lines += ["files here:", *[f"  {f}" for f in files]]
    return "\n".join(lines).rstrip() + "\n"


def write_incident(run_dir: Path, attempt: int, finding: Finding, remedy: Remedy | str,
                   diagnosis: Diagnosis | None, tails: Mapping[int, str]) -> Path:
    """Write one incident folder under ``run_dir/incidents`` and return its path: what was seen
    and done (``account``), the ranks' log ``tails`` (by global rank), the stacks of
    ``diagnosis`` (None when none were read), and (NCCL only) the ranks' flight recorder dumps,
    asked for on a hang while the ranks are still alive: call this before stopping them.

    The number is the next free one; two writers at once get different folders. Raises OSError
    when the run directory cannot be written."""
    kind, step, summary = finding.incident.value, finding.step, account(finding, attempt, remedy)
    dumps, verdict = diagnosis if diagnosis is not None else (None, None)
    folder = _new_folder(run_dir / "incidents", kind, step)
    record = summary_record(folder.name, kind, step, summary, dumps, tails, verdict,
                            datetime.now(timezone.utc))
    (folder / "summary.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    (folder / "summary.txt").write_text(
        render_summary(folder.name, kind, step, summary, dumps, tails, verdict))
    if dumps:
        (folder / "stacks").mkdir()
        for rank, dump in sorted(dumps.items()):
            text = dump.raw if dump.error is None else (
                f"no stack for rank {rank} (pid {dump.pid}): {dump.error}\n{dump.hint}\n\n"
                f"{dump.raw}")
            (folder / "stacks" / f"rank{rank}.txt").write_text(text)
    if tails:
        (folder / "logs").mkdir()
        for rank, tail in sorted(tails.items()):
            (folder / "logs" / f"rank{rank}.tail.txt").write_text(tail)
    # Last, as it may wait seconds for the ranks' dumps: what is known is on disk by then.
    if flight_recorder.collect(run_dir / "attempts" / str(attempt), folder,
                               ask=finding.incident is Incident.HANG):
        (folder / "summary.txt").write_text(render_summary(
            folder.name, kind, step, summary, dumps, tails, verdict, flight_dumps=True))
    return folder


def _new_folder(root: Path, kind: str, step: int) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    number = next_number(p.name for p in root.iterdir())
    while True:
        folder = root / incident_name(number, kind, step)
        try:
            folder.mkdir()
            return folder
        except FileExistsError:
            number += 1
