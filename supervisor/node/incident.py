"""Incident folders: everything a person needs to understand one incident, in one place.

    run_dir/incidents/0003-hang-step5/
        summary.txt            what happened, which rank, the evidence, what babysit did
        summary.json           the same and more, for tools
        stacks/rank<r>.txt     py-spy's own output (or why there is none)
        logs/rank<r>.tail.txt  the end of the rank's output

Folders are numbered in order across the whole run (and across supervisor restarts: the number
continues from what is on disk). The formatting helpers are pure; ``write_incident`` is the
only function that touches the disk.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from babysit.supervisor.node.stacks import StackDump, StackVerdict

__all__ = ["incident_name", "next_number", "render_summary", "summary_record", "write_incident"]

_NUMBERED = re.compile(r"^(\d+)-")


def incident_name(number: int, kind: str, step: int | None) -> str:
    """``0003-hang-step5``; ``0003-crash`` when the step is unknown. ``kind`` is reduced to
    lowercase letters, digits, ``_`` and ``-`` so it is always a safe folder name."""
    safe = re.sub(r"[^a-z0-9_-]+", "_", kind.lower()).strip("_") or "incident"
    return f"{number:04d}-{safe}" + ("" if step is None else f"-step{step}")


def next_number(existing: Iterable[str]) -> int:
    """One more than the highest number among existing folder names (1 for none)."""
    numbers = [int(m[1]) for name in existing if (m := _NUMBERED.match(name))]
    return max(numbers, default=0) + 1


def summary_record(name: str, kind: str, step: int | None, summary: Mapping[str, Any],
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


def render_summary(name: str, kind: str, step: int | None, summary: Mapping[str, Any],
                   stacks: Mapping[int, StackDump] | None, log_tails: Mapping[int, str],
                   verdict: StackVerdict | None) -> str:
    """The short human ``summary.txt``. Uses ``summary["what"]`` (what happened) and
    ``summary["action"]`` (what babysit did) when present; other keys are listed as they are."""
    at = "" if step is None else f" at step {step}"
    lines = [f"incident {name}: {kind}{at}", ""]
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
            (["logs/rank<r>.tail.txt: the end of each rank's output"] if log_tails else [])
    if files:
        lines += ["files here:", *[f"  {f}" for f in files]]
    return "\n".join(lines).rstrip() + "\n"


def write_incident(run_dir: Path, kind: str, step: int | None, summary: Mapping[str, Any],
                   stacks: Mapping[int, StackDump] | None, log_tails: Mapping[int, str],
                   verdict: StackVerdict | None) -> Path:
    """Write one incident folder under ``run_dir/incidents`` and return its path.

    ``kind``: the incident kind ("hang", "crash", ...); ``step``: the last step reached, or None;
    ``summary``: JSON-serializable facts from the caller (``what`` and ``action`` read best);
    ``stacks``: rank -> dump (None when none was taken); ``log_tails``: rank -> text.
    The number is the next free one; two writers at once get different folders. Raises OSError
    when the run directory cannot be written."""
    root = run_dir / "incidents"
    root.mkdir(parents=True, exist_ok=True)
    number = next_number(p.name for p in root.iterdir())
    while True:
        folder = root / incident_name(number, kind, step)
        try:
            folder.mkdir()
            break
        except FileExistsError:
            number += 1
    now = datetime.now(timezone.utc)
    record = summary_record(folder.name, kind, step, summary, stacks, log_tails, verdict, now)
    (folder / "summary.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    (folder / "summary.txt").write_text(
        render_summary(folder.name, kind, step, summary, stacks, log_tails, verdict))
    if stacks:
        (folder / "stacks").mkdir()
        for rank, dump in sorted(stacks.items()):
            text = dump.raw if dump.error is None else (
                f"no stack for rank {rank} (pid {dump.pid}): {dump.error}\n{dump.hint}\n\n"
                f"{dump.raw}")
            (folder / "stacks" / f"rank{rank}.txt").write_text(text)
    if log_tails:
        (folder / "logs").mkdir()
        for rank, tail in sorted(log_tails.items()):
            (folder / "logs" / f"rank{rank}.tail.txt").write_text(tail)
    return folder
