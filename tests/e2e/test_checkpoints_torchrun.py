"""Save and load for real: 2-rank gloo jobs under torchrun (the mistakes a user can make in one
process: ``tests/checkpoints/test_save.py``).

The resume tests are the promise users notice: a run stopped after step k and resumed from its
checkpoint produces bit-identical per-step losses on every rank to a run that never stopped
(model, Adam state, LR scheduler, dropout masks, data drawn from torch/numpy/Python RNGs), for a
sync and an async save.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from babysit.checkpoints import Catalog, CheckpointError, step_dir, verify_manifest
from babysit.checkpoints.layout import MANIFEST_NAME, PART_MARKER_PREFIX
from tests.checkpoints.test_save import tiny
from tests.conftest import ROOT, WORKERS

WORKER = WORKERS / "ckpt_roundtrip.py"
TORCHRUN = Path(sys.executable).parent / "torchrun"
STEPS = 8
SYNC_AT, ASYNC_AT = 3, 5
BAD_ROOT_AT = 2

# DCP warns when it runs without a process group; the one-process tests do that on purpose.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_torchrun(out: Path, *args: str) -> subprocess.Popen[str]:
    """Start the worker on 2 ranks, writing its losses under ``out``."""
    out.mkdir(parents=True)
    cmd = [
        str(TORCHRUN),
        "--nproc-per-node", "2",
        "--max-restarts", "0",
        "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
        str(WORKER), "--out", str(out), "--steps", str(STEPS), *args,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        cmd, env=env, cwd=out, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def finish(proc: subprocess.Popen[str], out: Path) -> dict[int, dict[int, float]]:
    """Wait for a job; return {rank: {step: loss}}."""
    try:
        log, _ = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        proc.kill()
        log, _ = proc.communicate()
    assert proc.returncode == 0, log[-6000:]
    return {
        r: {int(k): v for k, v in json.loads((out / f"losses_rank{r}.json").read_text()).items()}
        for r in range(2)
    }


@dataclass
class Runs:
    root: Path
    full: dict[int, dict[int, float]]
    from_sync: dict[int, dict[int, float]]
    from_async: dict[int, dict[int, float]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    base = tmp_path_factory.mktemp("ckpt_e2e")
    root = base / "ckpts"
    t0 = time.monotonic()
    # One uninterrupted run that saves sync after step 3 and async after step 5, then a resume
    # from each checkpoint. The two resumes run side by side: much of a launch is waiting
    # (rendezvous, the agent's monitor interval), so overlapping them saves wall time.
    full = finish(
        start_torchrun(base / "full", "--ckpt-root", str(root),
                       "--save-at", str(SYNC_AT), "--async-save-at", str(ASYNC_AT),
                       "--bad-root-at", str(BAD_ROOT_AT)),
        base / "full",
    )  # fmt: skip
    unused = str(base / "unused")
    a = start_torchrun(base / "from_sync", "--ckpt-root", unused,
                       "--resume", str(step_dir(root, SYNC_AT)))  # fmt: skip
    b = start_torchrun(base / "from_async", "--ckpt-root", unused,
                       "--resume", str(step_dir(root, ASYNC_AT)))  # fmt: skip
    from_sync, from_async = finish(a, base / "from_sync"), finish(b, base / "from_async")
    print(f"3 torchrun jobs in {time.monotonic() - t0:.1f} s")
    return Runs(root, full, from_sync, from_async)


@pytest.mark.e2e
def test_ranks_draw_different_data(runs: Runs) -> None:
    # Each rank seeds its own streams: restoring rank 1's RNG into rank 0 would be caught.
    assert runs.full[0] != runs.full[1]


@pytest.mark.e2e
@pytest.mark.parametrize("which", ["sync", "async"])
def test_resume_reproduces_every_rank_bit_for_bit(runs: Runs, which: str) -> None:
    at, resumed = (SYNC_AT, runs.from_sync) if which == "sync" else (ASYNC_AT, runs.from_async)
    for rank in (0, 1):
        expected = {s: v for s, v in runs.full[rank].items() if s > at}
        assert resumed[rank] == expected, f"rank {rank} diverged after resuming at step {at}"


@pytest.mark.e2e
def test_a_directory_rank_0_cannot_make_fails_that_save_on_every_rank_alike(runs: Runs) -> None:
    # Rank 0 makes the step's directory; the others learn its outcome, so every rank raises the
    # same error together (none waits in the write's collectives for a rank that gave up), and
    # the job trains and saves on (the losses and resumes above are this run's).
    said = [json.loads((runs.root.parent / "full" / f"bad_root_rank{r}.json").read_text())
            for r in (0, 1)]
    for mode in ("sync", "async"):
        assert said[0][mode] == said[1][mode], mode
        assert "cannot create the checkpoint directory" in said[0][mode]
        assert "(rank 0)" in said[0][mode] and "not_a_directory" in said[0][mode]


@pytest.mark.e2e
def test_both_saves_are_committed_complete_and_verified(runs: Runs) -> None:
    cat = Catalog(runs.root)
    ckpts = cat.checkpoints()
    assert [(c.step, c.manifest.world_size) for c in ckpts] == [(SYNC_AT, 2), (ASYNC_AT, 2)]
    for c in ckpts:
        names = {f.name for f in c.manifest.files}
        assert {".metadata", "rank_00000.pt", "rank_00001.pt"} <= names
        assert any(n.endswith(".distcp") for n in names)
        on_disk = {p.name for p in c.path.iterdir()} - {MANIFEST_NAME}
        assert on_disk == names  # every file is covered, no part markers or temp files left
        assert not any(n.startswith(PART_MARKER_PREFIX) for n in on_disk)
        assert verify_manifest(c.manifest, c.path, full=True) == []


@pytest.mark.e2e
def test_torn_real_checkpoint_is_ignored_and_cleaned(runs: Runs, tmp_path: Path) -> None:
    # A rank killed mid-save: one rank's shard and the manifest never made it to disk.
    root = tmp_path / "ckpts"
    shutil.copytree(step_dir(runs.root, SYNC_AT), step_dir(root, SYNC_AT))
    torn = step_dir(root, ASYNC_AT)
    shutil.copytree(step_dir(runs.root, ASYNC_AT), torn)
    (torn / MANIFEST_NAME).unlink()
    next(torn.glob("__1_*.distcp")).unlink()
    cat = Catalog(root)
    assert [c.step for c in cat.checkpoints()] == [SYNC_AT]
    assert cat.choose_for_rollback(100, allow_pending=True).checkpoint.step == SYNC_AT  # type: ignore[union-attr]
    assert cat.clean_incomplete() == [torn] and not torn.exists()


@pytest.mark.e2e
def test_load_refuses_another_world_size(runs: Runs) -> None:
    from babysit.checkpoints import load

    model, opt, sched = tiny()
    with pytest.raises(CheckpointError, match=r"saved by 2 ranks, but this job has 1.*relaunch"):
        load(step_dir(runs.root, SYNC_AT), model, opt, sched)
