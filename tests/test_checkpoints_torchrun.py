"""Save and load for real: 2-rank gloo jobs under torchrun, and user mistakes in one process.

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
from typing import Any

import pytest

from babysit.checkpoints import Catalog, CheckpointError, read_manifest, step_dir, verify_manifest
from babysit.checkpoints.layout import MANIFEST_NAME, PART_MARKER_PREFIX

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "workers" / "ckpt_roundtrip.py"
TORCHRUN = Path(sys.executable).parent / "torchrun"
STEPS = 8
SYNC_AT, ASYNC_AT = 3, 5

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
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
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
                       "--save-at", str(SYNC_AT), "--async-save-at", str(ASYNC_AT)),
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


# ---- one process, no torchrun: the mistakes a user can make ---------------------------------


def tiny(extra_layer: bool = False) -> tuple[Any, Any, Any]:
    import torch

    layers = [torch.nn.Linear(4, 4)] + ([torch.nn.Linear(4, 2)] if extra_layer else [])
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    return model, opt, sched


@pytest.mark.e2e
def test_load_refuses_another_world_size(runs: Runs) -> None:
    from babysit.checkpoints import load

    model, opt, sched = tiny()
    with pytest.raises(CheckpointError, match=r"saved by 2 ranks, but this job has 1.*relaunch"):
        load(step_dir(runs.root, SYNC_AT), model, opt, sched)


def test_load_names_a_missing_key(tmp_path: Path) -> None:
    from babysit.checkpoints import load, save

    model, opt, sched = tiny()
    save(tmp_path, 1, cursor=1, lr_scale=1.0, model=model, optimizer=opt, scheduler=sched)
    bigger, bigger_opt, _ = tiny(extra_layer=True)
    with pytest.raises(CheckpointError, match=r"Missing key.*1\.weight.*Build them as the saving"):
        load(step_dir(tmp_path, 1), bigger, bigger_opt)
    with pytest.raises(CheckpointError, match="saved without a scheduler"):
        save(tmp_path, 2, cursor=2, lr_scale=1.0, model=model, optimizer=opt)
        load(step_dir(tmp_path, 2), model, opt, sched)


def test_save_to_an_unwritable_root_says_where(tmp_path: Path) -> None:
    from babysit.checkpoints import save

    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")
    model, _, _ = tiny()
    with pytest.raises(CheckpointError, match=r"cannot create the checkpoint directory .*writable"):
        save(blocker / "ckpts", 3, cursor=3, lr_scale=1.0, model=model)


def test_single_process_async_save_commits_on_poll_and_round_trips(tmp_path: Path) -> None:
    import torch

    from babysit.checkpoints import load, save, wait_pending

    model, opt, sched = tiny()
    handle = save(tmp_path, 7, cursor=70, lr_scale=0.5, model=model, optimizer=opt,
                  scheduler=sched, extra={"k": 1}, async_save=True)  # fmt: skip
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    deadline = time.monotonic() + 30
    while not handle.poll():  # what the worker API does once per step
        assert time.monotonic() < deadline
        time.sleep(0.01)
    wait_pending()
    assert handle.committed and read_manifest(handle.path).lr_scale == 0.5
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    restored = load(handle.path, model, opt, sched)
    assert (restored.step, restored.cursor, restored.lr_scale, restored.extra) == (
        7,
        70,
        0.5,
        {"k": 1},
    )
    assert all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())
