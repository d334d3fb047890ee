"""The room a node leaves its memory copies (``checkpoints/capacity.py``): the least of
``/dev/shm``'s free space, the cgroup's memory limit and the host's memory, read from fake
cgroup trees here and from this machine once; and the copier's first copy turning copies off,
with what to change, where they do not fit."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from babysit.checkpoints import capacity
from babysit.checkpoints.capacity import Room, cgroup_free, shortfall

GiB, MiB = 2**30, 2**20


def _files(folder: Path, **files: str | int) -> None:
    """Cgroup files in ``folder`` (``memory_max`` names ``memory.max``)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name.replace("_", ".", 1)).write_text(f"{text}\n")


def _proc(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "proc-self-cgroup"
    path.write_text(text)
    return path


def test_cgroup_v2_limit_minus_use_without_the_inactive_file_cache(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    _files(root / "job" / "step", memory_max=8 * GiB, memory_current=3 * GiB,
           memory_stat=f"anon {2 * GiB}\ninactive_file {GiB}\nshmem 0")
    proc = _proc(tmp_path, "0::/job/step\n")
    assert cgroup_free(proc, root) == 8 * GiB - (3 * GiB - GiB)


def test_cgroup_v2_max_is_no_limit_and_a_parents_limit_binds(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    _files(root / "job", memory_max=4 * GiB, memory_current=GiB)
    _files(root / "job" / "step", memory_max="max", memory_current=GiB)
    proc = _proc(tmp_path, "0::/job/step\n")
    assert cgroup_free(proc, root) == 3 * GiB  # the job's, though the step has none
    (root / "job" / "memory.max").write_text("max\n")
    assert cgroup_free(proc, root) is None


def test_cgroup_path_of_the_host_inside_a_container_reads_the_containers_own(
        tmp_path: Path) -> None:
    # /proc/self/cgroup names the host's path, the mount is the container's own cgroup.
    root = tmp_path / "cg"
    _files(root, memory_max=2 * GiB, memory_current=GiB // 2)
    assert cgroup_free(_proc(tmp_path, "0::/docker/3f2a9c\n"), root) == GiB + GiB // 2
    assert cgroup_free(_proc(tmp_path, "0::/../../user.slice\n"), root) == GiB + GiB // 2


def test_cgroup_v1_memory_controller_and_its_no_limit(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    leaf = root / "memory" / "slurm" / "job_7"
    _files(leaf, memory_limit_in_bytes=16 * GiB, memory_usage_in_bytes=10 * GiB,
           memory_stat=f"cache {4 * GiB}\ninactive_file {GiB}\ntotal_inactive_file {2 * GiB}")
    _files(root / "memory", memory_limit_in_bytes=9223372036854771712,
           memory_usage_in_bytes=20 * GiB)
    proc = _proc(tmp_path, "12:pids:/slurm/job_7\n4:memory:/slurm/job_7\n1:name=systemd:/\n")
    assert cgroup_free(proc, root) == 16 * GiB - (10 * GiB - 2 * GiB)


def test_no_cgroup_file_or_no_memory_controller_is_no_limit(tmp_path: Path) -> None:
    assert cgroup_free(tmp_path / "absent", tmp_path) is None
    assert cgroup_free(_proc(tmp_path, "3:cpu:/x\n"), tmp_path) is None


def test_shortfall_says_which_limit_and_what_to_change() -> None:
    shm = Room("/dev/shm/babysit-x-n0", shm=60 * MiB, cgroup=None, host=100 * GiB)
    why = shortfall(300 * MiB, shm, 0, 3)
    assert why is not None and "/dev/shm" in why and "--shm-size=384m" in why
    assert "checkpoints.memory_every_steps: 0" in why and "300.0 MiB on node 0" in why
    # The copies already there are pruned before the next: room for them too.
    assert shortfall(300 * MiB, Room(shm.folder, 60 * MiB, None, 100 * GiB, held=250 * MiB),
                     0, 3) is None

    limited = Room("/dev/shm/babysit-x-n1", shm=50 * GiB, cgroup=4 * GiB, host=100 * GiB)
    why = shortfall(3 * GiB, limited, 1, 3)
    assert why is not None and "memory limit" in why and "raise the memory limit" in why
    assert shortfall(GiB, limited, 1, 3) is None  # within half of what the limit leaves

    host = Room("/dev/shm/babysit-x-n0", shm=50 * GiB, cgroup=None, host=4 * GiB)
    why = shortfall(3 * GiB, host, 0, 3)
    assert why is not None and "host memory" in why and "free host memory" in why

    disk = Room("/tmp/babysit-x-n0", shm=GiB, cgroup=None, host=100 * GiB)
    why = shortfall(2 * GiB, disk, 0, 3)
    assert why is not None and "no writable /dev/shm" in why


def test_the_room_on_this_machine() -> None:
    here = capacity.room(Path("/dev/shm") / "babysit-not-made" / "memory")
    stat = os.statvfs("/dev/shm")
    assert here.shm is not None and abs(here.shm - stat.f_bavail * stat.f_frsize) < 64 * MiB
    assert here.host > 0
    assert here.cgroup is None or here.cgroup >= 0


def test_a_copier_whose_shared_memory_is_too_small_turns_copies_off_and_says_what_to_change(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first copy's check on one process (no process group): a /dev/shm of 1 KiB for a
    state of a few hundred bytes, three copies of it."""
    import torch

    from babysit.checkpoints.memory_copy import Copier

    monkeypatch.setattr(capacity, "free_space", lambda folder: 1024)
    model = torch.nn.Linear(16, 8)
    said: list[tuple[str, dict[str, object]]] = []
    copier = Copier(Path("/dev/shm") / "babysit-test-n0", rank=0, world_size=1,
                    local_world_size=1, node=0, every=1, model=model,
                    optimizer=torch.optim.SGD(model.parameters(), lr=0.1), scheduler=None,
                    emit=lambda kind, **data: said.append((kind, data)))
    copier.copy(1, 1, 1.0, None)
    assert copier.every == 0 and not copier.due(2)
    [(kind, data)] = said
    assert kind == "memory_copy_off" and "/dev/shm" in str(data["why"])
    assert "--shm-size=64m" in str(data["why"]) and "memory_every_steps: 0" in str(data["why"])
    assert not (Path("/dev/shm") / "babysit-test-n0").exists()
