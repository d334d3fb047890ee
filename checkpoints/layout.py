"""Where things live inside a checkpoint root. Pure names, no I/O.

::

    <root>/
      verdicts.json                   supervisor's verdicts (pending/good/suspect/corrupt), pins
      lineage.json                    the run's timelines, the current one (lineage.py)
      step_00000100/                  one checkpoint; it exists once manifest.json is there
        manifest.json                 committed last, atomically (see manifest.py)
        .metadata  __0_0.distcp  ...  written by torch.distributed.checkpoint
        rank_00000.pt  rank_00001.pt  per-rank state: RNG streams, scheduler, extra
        .part_rank00001.json          async saves only: rank 1 finished writing (removed on commit)
"""

from __future__ import annotations

import re
from pathlib import Path

MANIFEST_NAME = "manifest.json"
VERDICTS_NAME = "verdicts.json"
LINEAGE_NAME = "lineage.json"
"""The run's timelines and which is current (``checkpoints/lineage.py``)."""
STEP_DIR_PREFIX = "step_"
_STEP_DIR_RE = re.compile(r"^step_(\d{8,})$")
# Files that belong to the commit protocol rather than to the checkpoint's content: never hashed.
PART_MARKER_PREFIX = ".part_rank"
TMP_SUFFIX = ".tmp"


def step_dir(root: str | Path, step: int) -> Path:
    """The directory of the checkpoint taken after optimizer step ``step`` (8 digits, sortable)."""
    if step < 0:
        raise ValueError(f"a checkpoint step must be >= 0, got {step}")
    return Path(root) / f"{STEP_DIR_PREFIX}{step:08d}"


def parse_step_dir(name: str) -> int | None:
    """The step encoded in a directory name such as ``step_00000100``, or None if it is not one."""
    match = _STEP_DIR_RE.match(name)
    return int(match.group(1)) if match else None


def rank_state_name(rank: int) -> str:
    """The per-rank state file (RNG, scheduler, extra) written by ``rank``."""
    return f"rank_{rank:05d}.pt"


def part_marker_name(rank: int) -> str:
    """The marker an async save leaves when ``rank`` finished writing (holds its file hashes)."""
    return f"{PART_MARKER_PREFIX}{rank:05d}.json"


def is_protocol_file(name: str) -> bool:
    """True for the manifest, part markers and temp files: they are not checkpoint content."""
    return name == MANIFEST_NAME or name.startswith(PART_MARKER_PREFIX) or name.endswith(TMP_SUFFIX)
