"""Storage faults for real: the checkpoint folder is a tmpfs too small for more than one
checkpoint. A save that fails must cost only that checkpoint: training goes on, the failure is
journaled and alerted, and a later relaunch resumes from the last checkpoint that committed."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import babysat, read_jsonl
from tests.journal_text import problems

pytestmark = pytest.mark.e2e


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "small"
    mount.mkdir()
    # 160 KiB: room for one tiny checkpoint (about 90 KB in 7 files), not two.
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=160k", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a size-limited tmpfs here (needs root): {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_disk_full_during_a_save_costs_that_checkpoint_not_the_run(tmp_path: Path,
                                                                    small_disk: Path) -> None:
    result, run_dir = babysat(
        tmp_path, "run", "--steps", "24", "--crash", "0:13", launch_extra="  max_restarts: 1\n",
        checkpoints=f"{{dir: {small_disk}, every_steps: 5, probation_steps: 2, keep: 3}}")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    journal = read_jsonl(run_dir / "events.jsonl")
    saved = [e["checkpoint_step"] for e in journal if e["event"] == "checkpoint_saved"]
    failed = [e for e in journal if e["event"] == "checkpoint_failed"]
    assert saved[0] == 5 and failed and failed[0]["checkpoint_step"] == 10
    assert "No space left on device" in failed[0]["error"] or "ENOSPC" in failed[0]["error"]
    titles = [e["title"] for e in journal
              if e["event"] == "alert" and "failed to save" in e["title"]]
    # One line each: DCP's gathered error said by its cause, not by every rank's traceback.
    assert titles and all("\n" not in t and "Traceback" not in t for t in titles), titles
    assert problems(journal) == []
    # The crash at step 13 resumes from step 5, the last checkpoint that committed, and the
    # half-written one is cleaned before the relaunch.
    (resume,) = [e for e in journal if e["event"] == "resume" and e.get("from")]
    assert resume["checkpoint_step"] == 5
    assert any(e["event"] == "checkpoint_cleaned" for e in journal)
    assert journal[-1]["state"] == "succeeded"
