"""A run directory as a supervisor finds and prepares it before its first entry.

``<run_dir>/`` holds ``events.jsonl`` (the journal), ``metrics.jsonl`` (the steps),
``config.yaml`` (the config in force, secrets left out), ``attempts/<n>/`` (each attempt's rank
logs and control file) and ``incidents/``. It is mode 0700: the telemetry socket inside it is
reachable by its owner only.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from babysit.supervisor.config.plan import RunPlan
from babysit.supervisor.run import journal


def prepare(plan: RunPlan) -> list[dict[str, Any]]:
    """Create or reopen ``plan.run_dir`` and write the config in force; the journal entries
    earlier supervisors of this run directory left (empty for a new run)."""
    run_dir = plan.run_dir
    previous = list(journal.read(run_dir / "events.jsonl"))
    run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(run_dir, 0o700)  # the telemetry socket's first line of defence
    (run_dir / "attempts").mkdir(exist_ok=True)
    (run_dir / "config.yaml").write_text(
        yaml.safe_dump(plan.config.model_dump(mode="json", exclude={"nodes": {"secret"}}),
                       sort_keys=False))
    return previous


def next_attempt(previous: list[dict[str, Any]]) -> int:
    """The number of this supervisor's first attempt: one past every attempt journaled."""
    return 1 + max((e.get("attempt", -1) for e in previous), default=-1)


EXCLUDE_HOSTS = "exclude_hosts"


def exclude_hosts(folder: Path, hosts: Iterable[str]) -> Path:
    """Add ``hosts`` to ``folder/exclude_hosts`` (one per line, each once): the hosts a requeue
    should run without, for a job script to hand on (``sbatch --exclude``)."""
    path = folder / EXCLUDE_HOSTS
    known = path.read_text().split() if path.exists() else []
    merged = [*known, *(h for h in hosts if h not in known)]
    path.write_text("".join(f"{h}\n" for h in merged))
    return path
