"""Stdout mode's two words in the loop's decisions (``node.printed`` holds the rest).

A single-node run's members read printed progress for scripts that never attach; the loop asks
here, before it acts, whether a rollback is possible in that mode and which copy of the script's
own checkpoints the next attempt resumes from. Other members (a multi-node leader's) read no
output: the remedy passes unchanged and nothing is restored.
"""

from __future__ import annotations

from typing import Any

from babysit.policies.types import Finding, Remedy
from babysit.supervisor.run.members import LocalMembers, Members


def can_roll_back(members: Members, finding: Finding, babysits: bool) -> bool:
    """Whether a rollback for ``finding`` has a checkpoint to go back to: ``babysits`` (the
    catalog's answer), or in stdout mode a copy of the script's own from before the onset."""
    if isinstance(members, LocalMembers) and members.workers.printed.active:
        return members.workers.printed.can_roll_back(finding)
    return babysits


def remedy(members: Members, remedy: Remedy) -> Remedy:
    """``remedy``, or an alert saying what would enable it when stdout mode cannot roll back."""
    if isinstance(members, LocalMembers):
        return members.workers.printed.remedy(remedy)
    return remedy


def restore(members: Members, remedy: Remedy | None,
            attempt: int) -> list[tuple[str, dict[str, Any]]]:
    """Before launching ``attempt`` for ``remedy``: put back the script's checkpoint copy it
    needs (stdout mode with ``stdout.checkpoint_dir``); the journal entries saying so."""
    if isinstance(members, LocalMembers):
        return members.workers.restore_script_checkpoint(remedy, attempt)
    return []
