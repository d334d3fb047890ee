"""Manifests, the catalog, verdicts, rollback choice and retention, on real directories.

Torch-free and fast: each fake checkpoint is a directory of random bytes committed by the real
commit path (``checkpoints.save.commit``: per-rank parts, rank 0 hashing the leftovers, atomic
manifest), so the catalog sees exactly what a real save leaves.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from babysit.checkpoints import (
    Catalog,
    CheckpointError,
    ManifestError,
    Verdict,
    read_manifest,
    register_external,
    step_dir,
    verify_manifest,
)
from babysit.checkpoints.layout import (
    MANIFEST_NAME,
    VERDICTS_NAME,
    part_marker_name,
    rank_state_name,
)
from babysit.checkpoints.save import commit, hash_part
from tests.conftest import ROOT


def make_ckpt(root: Path, step: int, world: int = 2, size: int = 50_000) -> Path:
    """A committed checkpoint shaped like a DCP save: shards, .metadata, per-rank state files."""
    path = step_dir(root, step)
    path.mkdir(parents=True)
    for r in range(world):
        (path / f"__{r}_0.distcp").write_bytes(os.urandom(size))
        (path / rank_state_name(r)).write_bytes(os.urandom(500))
    (path / ".metadata").write_bytes(os.urandom(300))  # claimed by no rank: rank 0 hashes it
    parts = [hash_part(path, r) for r in range(world)]
    commit(path, parts, {"step": step, "cursor": 2 * step, "lr_scale": 1.0, "world_size": world})
    return path


def flip_byte(path: Path, offset: int = 1000) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def test_importing_checkpoints_does_not_import_torch() -> None:
    code = "import sys, checkpoints; sys.exit('torch' in sys.modules)"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_commit_lists_every_file_with_size_and_crc(tmp_path: Path) -> None:
    path = make_ckpt(tmp_path, 100)
    manifest = read_manifest(path)
    names = [f.name for f in manifest.files]
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp", "rank_00000.pt", "rank_00001.pt"]
    assert manifest.step == 100 and manifest.cursor == 200 and manifest.world_size == 2
    assert manifest.total_bytes == sum((path / n).stat().st_size for n in names)
    assert verify_manifest(manifest, path, full=True) == []
    assert oct((path / MANIFEST_NAME).stat().st_mode & 0o777) == "0o644"
    assert not [p for p in path.iterdir() if p.name.endswith(".tmp")]


def test_commit_refuses_when_a_rank_failed(tmp_path: Path) -> None:
    path = step_dir(tmp_path, 5)
    path.mkdir()
    (path / rank_state_name(0)).write_bytes(b"x")
    (path / part_marker_name(1)).write_text("{}")
    parts = [hash_part(path, 0), {"rank": 1, "ok": False, "error": "OSError: disk full"}]
    with pytest.raises(CheckpointError, match=r"rank 1: OSError: disk full.*not committed"):
        commit(path, parts, {"step": 5, "cursor": 5, "lr_scale": 1.0, "world_size": 2})
    assert not (path / MANIFEST_NAME).exists()
    assert Catalog(tmp_path).checkpoints() == []


def test_torn_checkpoint_is_ignored_and_cleaned_but_young_or_excluded_ones_are_kept(
    tmp_path: Path,
) -> None:
    good = make_ckpt(tmp_path, 100)
    torn = make_ckpt(tmp_path, 200)
    (torn / MANIFEST_NAME).unlink()  # a rank died before rank 0 committed
    (torn / "__1_0.distcp").unlink()
    in_progress = step_dir(tmp_path, 300)
    in_progress.mkdir()
    (in_progress / "__0_0.distcp").write_bytes(b"being written")
    (good / part_marker_name(1)).write_text("{}")  # a crash between commit and marker removal

    cat = Catalog(tmp_path)
    assert [c.step for c in cat.checkpoints()] == [100]
    assert cat.choose_for_rollback(10_000, allow_pending=True).checkpoint.step == 100  # type: ignore[union-attr]

    # While a job runs: the excluded directory and any one written recently survive.
    assert cat.clean_incomplete(min_age_s=60, exclude=[in_progress]) == []
    assert cat.clean_incomplete(exclude=[in_progress]) == [torn]
    assert in_progress.exists() and not torn.exists()
    # Between attempts nothing is being written: everything incomplete goes.
    assert cat.clean_incomplete() == [in_progress]
    assert (good / MANIFEST_NAME).exists() and not (good / part_marker_name(1)).exists()


def test_verdicts_promote_after_probation_and_persist(tmp_path: Path) -> None:
    for s in (100, 200, 300):
        make_ckpt(tmp_path, s)
    cat = Catalog(tmp_path)
    assert {c.verdict for c in cat.checkpoints()} == {Verdict.PENDING}
    assert cat.newest_good_before(1000) is None

    assert [c.step for c in cat.promote(healthy_step=250, probation_steps=50)] == [100, 200]
    again = Catalog(tmp_path)  # a restarted supervisor reads the same verdicts
    assert [c.verdict for c in again.checkpoints()] == [Verdict.GOOD, Verdict.GOOD, Verdict.PENDING]
    assert again.newest_good_before(300).step == 200  # type: ignore[union-attr]
    assert again.newest_good_before(200).step == 100  # type: ignore[union-attr]  # strictly before
    assert again.newest_good_before(100) is None
    by_id = json.loads((tmp_path / VERDICTS_NAME).read_text())["states"]  # keyed by identity
    assert by_id[again.get(100).id] == {  # type: ignore[union-attr]
        **by_id[again.get(100).id], "step": 100, "verdict": "good"}  # type: ignore[union-attr]


def test_anomaly_marks_checkpoints_in_window_and_after_as_suspect_for_good(tmp_path: Path) -> None:
    for s in (100, 200, 300, 400):
        make_ckpt(tmp_path, s)
    cat = Catalog(tmp_path)
    cat.promote(healthy_step=200, probation_steps=0)
    marked = cat.mark_anomaly(onset_step=320, window_steps=50, reason="grad norm climbing")
    assert [c.step for c in marked] == [300, 400]
    cat.promote(healthy_step=10_000, probation_steps=0)  # suspect is sticky
    verdicts = {c.step: c.verdict for c in cat.checkpoints()}
    assert verdicts == {
        100: Verdict.GOOD,
        200: Verdict.GOOD,
        300: Verdict.SUSPECT,
        400: Verdict.SUSPECT,
    }
    assert cat.get(300).reason == "grad norm climbing"  # type: ignore[union-attr]
    assert cat.choose_for_rollback(320).checkpoint.step == 200  # type: ignore[union-attr]


def test_a_step_saved_again_after_rollback_starts_pending(tmp_path: Path) -> None:
    path = make_ckpt(tmp_path, 300)
    cat = Catalog(tmp_path)
    cat.mark_suspect(300, "spike at 310")
    import shutil

    shutil.rmtree(path)
    make_ckpt(tmp_path, 300)  # the relaunched attempt saves step 300 again
    assert cat.get(300).verdict is Verdict.PENDING  # type: ignore[union-attr]


def test_rollback_refuses_corrupted_and_truncated_and_falls_back(tmp_path: Path) -> None:
    for s in (100, 200, 300):
        make_ckpt(tmp_path, s)
    cat = Catalog(tmp_path)
    cat.promote(healthy_step=300, probation_steps=0)
    flip_byte(step_dir(tmp_path, 300) / "__1_0.distcp")
    with open(step_dir(tmp_path, 200) / "__0_0.distcp", "r+b") as f:
        f.truncate(1234)

    # A flipped byte keeps the size: only the full verify sees it.
    m300 = read_manifest(step_dir(tmp_path, 300))
    assert verify_manifest(m300, step_dir(tmp_path, 300), full=False) == []

    choice = cat.choose_for_rollback(onset_step=350)
    assert choice.checkpoint is not None and choice.checkpoint.step == 100
    assert [r.step for r in choice.refused] == [300, 200]
    assert (
        "CRC-32" in choice.refused[0].problems[0] and "corrupted" in choice.refused[0].problems[0]
    )
    assert "1234 bytes on disk" in choice.refused[1].problems[0]
    verdicts = {c.step: c.verdict for c in cat.checkpoints()}
    assert verdicts == {100: Verdict.GOOD, 200: Verdict.CORRUPT, 300: Verdict.CORRUPT}
    assert cat.pinned_step == 100
    # Corrupt is never chosen again, even without verification.
    assert cat.choose_for_rollback(350, verify=False).checkpoint.step == 100  # type: ignore[union-attr]


def test_rollback_when_nothing_good_precedes_the_onset(tmp_path: Path) -> None:
    make_ckpt(tmp_path, 100)
    cat = Catalog(tmp_path)
    assert cat.choose_for_rollback(150) == type(cat.choose_for_rollback(150))(None, ())
    assert cat.choose_for_rollback(150, allow_pending=True).checkpoint.step == 100  # type: ignore[union-attr]
    (step_dir(tmp_path, 100) / "rank_00001.pt").unlink()
    choice = cat.choose_for_rollback(150, allow_pending=True)
    assert choice.checkpoint is None and "missing" in choice.refused[0].problems[0]


def test_retention_keeps_last_k_the_newest_good_and_the_pinned(tmp_path: Path) -> None:
    for s in range(100, 800, 100):
        make_ckpt(tmp_path, s, size=100)
    cat = Catalog(tmp_path)
    cat.promote(healthy_step=200, probation_steps=0)  # 100, 200 good
    cat.mark_anomaly(onset_step=310, window_steps=10, reason="spike")  # 300.. suspect
    cat.choose_for_rollback(150)  # pins 100
    cat.choose_for_rollback(650)  # the newest good before 650 is 200: pinned instead of 100
    cat.mark_corrupt(600, "flipped byte")

    deleted = cat.retain(keep_last=2)
    # Kept: 500 and 700 (last two usable; 600 is corrupt), 200 (newest good, and pinned).
    assert [p.name for p in deleted] == [
        "step_00000100",
        "step_00000300",
        "step_00000400",
        "step_00000600",
    ]
    assert [c.step for c in cat.checkpoints()] == [200, 500, 700]
    assert {s["step"] for s in json.loads((tmp_path / VERDICTS_NAME).read_text())["states"]
            .values()} == {200, 500, 700}
    # The newest state is never deleted (a relaunch resumes from it), whatever keep_last says.
    assert cat.retain(keep_last=0) == [step_dir(tmp_path, 500)]
    assert [c.step for c in cat.checkpoints()] == [200, 700]
    with pytest.raises(ValueError):
        cat.retain(-1)


def test_retention_of_an_owned_external_file_deletes_that_file_only(tmp_path: Path) -> None:
    saves = tmp_path / "my_saves"
    saves.mkdir()
    for step in (10, 20):
        (saves / f"step{step}.pt").write_bytes(os.urandom(1000))
        register_external(tmp_path / "ckpts", saves / f"step{step}.pt", step=step, cursor=step,
                          owned=True)
    (saves / "notes.txt").write_text("the user's, not babysit's")
    assert Catalog(tmp_path / "ckpts").retain(keep_last=1) == [step_dir(tmp_path / "ckpts", 10)]
    assert sorted(p.name for p in saves.iterdir()) == ["notes.txt", "step20.pt"]


def test_retention_with_fewer_checkpoints_than_keep_deletes_nothing(tmp_path: Path) -> None:
    for s in (5, 10):
        make_ckpt(tmp_path, s, size=100)
    cat = Catalog(tmp_path)
    assert cat.retain(keep_last=3) == []
    assert [c.step for c in cat.checkpoints()] == [5, 10]


def test_external_checkpoints_are_verified_and_their_data_is_the_users(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    mine = tmp_path / "my_saves" / "model_step_40.pt"
    mine.parent.mkdir()
    mine.write_bytes(os.urandom(10_000))
    inside = step_dir(root, 80)
    (inside / "shards").mkdir(parents=True)
    (inside / "shards" / "a.bin").write_bytes(os.urandom(1000))

    assert (
        register_external(root, mine, step=40, cursor=400, world_size=4)
        == step_dir(root, 40).absolute()
    )
    register_external(root, inside, step=80, cursor=800, world_size=4)
    m40 = read_manifest(step_dir(root, 40))
    assert m40.kind == "external" and m40.external_path == str(mine) and m40.world_size == 4
    assert m40.external_is_file and m40.data_dir(step_dir(root, 40)) == mine.parent
    assert [f.name for f in m40.files] == ["model_step_40.pt"]
    assert [f.name for f in read_manifest(inside).files] == ["shards/a.bin"]

    cat = Catalog(root)
    cat.promote(healthy_step=1000, probation_steps=0)
    flip_byte(mine, 5)
    choice = cat.choose_for_rollback(90)
    assert choice.checkpoint.step == 80 and choice.refused == ()  # type: ignore[union-attr]
    assert cat.choose_for_rollback(79).refused[0].step == 40
    cat.unpin()
    # 40 is corrupt now: its manifest directory goes, the user's file stays (owned=False).
    assert cat.retain(keep_last=0) == [step_dir(root, 40)]  # 80 is the newest good: kept
    assert mine.exists()
    make_ckpt(root, 90)
    cat.promote(healthy_step=1000, probation_steps=0)
    cat.retain(keep_last=0)
    assert not inside.exists()  # saved inside its step directory, so it was ours to delete

    with pytest.raises(CheckpointError, match="does not exist"):
        register_external(root, tmp_path / "nope", step=1, cursor=1)


def test_manifest_errors_say_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match=r"no manifest\.json.*never finished.*clean_incomplete"):
        read_manifest(tmp_path)
    path = make_ckpt(tmp_path, 7)
    d = json.loads((path / MANIFEST_NAME).read_text())
    d["format_version"] = 99
    (path / MANIFEST_NAME).write_text(json.dumps(d))
    with pytest.raises(ManifestError, match="format version 99"):
        read_manifest(path)
    assert Catalog(tmp_path).checkpoints() == []
