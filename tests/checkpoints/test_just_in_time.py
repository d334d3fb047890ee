"""Just-in-time state's pure parts (``checkpoints.just_in_time``, ``checkpoints.mark``): who
writes which shard, what a mark keeps of a rank's random streams, and the commit that makes a
staged folder a checkpoint. The writes themselves, from ranks blocked in a collective, are the
end-to-end tests' (``tests/e2e/test_just_in_time.py``)."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from babysit.checkpoints import Catalog, just_in_time, mark, read_manifest, verify_manifest
from babysit.checkpoints.just_in_time import NoPlan, Plan, RankView
from babysit.checkpoints.manifest import hash_file
from babysit.checkpoints.rng import restore_rng


def view(rank: int, step: int = 239, *, shard: int = 0, shards: int = 1,
         why: str | None = None) -> RankView:
    return RankView(rank, why is None, step, step, None, 1.0, shard, shards, why)


def test_replicated_state_is_written_by_the_lowest_live_rank_and_the_rest_keep_their_marks(
) -> None:
    views = {r: view(r) for r in (1, 2, 3)}
    got = just_in_time.plan(4, views, marks={0: 239, 1: 239, 2: 239, 3: 239},
                            absent={0: "dead"})
    assert got == Plan(239, 239, None, 1.0, writers=(1,), marks=(0, 2, 3), streams_lost=())


def test_a_dead_rank_whose_mark_is_of_another_step_resumes_with_fresh_streams() -> None:
    got = just_in_time.plan(2, {0: view(0)}, marks={0: 239, 1: 238}, absent={1: "dead"})
    assert isinstance(got, Plan) and got.writers == (0,) and got.streams_lost == (1,)


def test_every_shard_of_sharded_state_needs_a_consistent_live_holder() -> None:
    views = {0: view(0, shard=0, shards=2), 1: view(1, shard=1, shards=2)}
    assert just_in_time.plan(2, views, {}, {}).writers == (0, 1)  # type: ignore[union-attr]

    stopped = just_in_time.plan(2, {0: view(0, shard=0, shards=2)}, {0: 239, 1: 239},
                                {1: "stopped (SIGSTOP): it cannot answer until continued"})
    assert isinstance(stopped, NoPlan) and stopped.step == 239
    assert "shard 1 of the sharded state has no live holder" in stopped.why
    assert "rank 1 is stopped (SIGSTOP)" in stopped.why

    half = just_in_time.plan(2, {0: view(0, shard=0, shards=2),
                                 1: view(1, shard=1, shards=2, why="inside optimizer.step()")},
                             {}, {})
    assert isinstance(half, NoPlan) and "inside optimizer.step()" in half.why


def test_hybrid_sharding_takes_one_replica_of_each_shard() -> None:
    # 2 replicas x 2 shards: ranks 0 and 2 hold shard 0, 1 and 3 shard 1; rank 1 is gone.
    views = {r: view(r, shard=r % 2, shards=2) for r in (0, 2, 3)}
    got = just_in_time.plan(4, views, {r: 239 for r in range(4)}, {1: "dead"})
    assert isinstance(got, Plan) and got.writers == (0, 3) and got.marks == (1, 2)


def test_no_plan_when_no_rank_can_write_or_the_ranks_disagree_on_the_step() -> None:
    assert "no rank is alive" in just_in_time.plan(2, {}, {}, {0: "dead", 1: "dead"}).why  # type: ignore[union-attr]
    split = just_in_time.plan(2, {0: view(0, 239), 1: view(1, 240)}, {}, {})
    assert isinstance(split, NoPlan) and "different steps ([239, 240])" in split.why


def test_a_plan_crosses_json_unchanged() -> None:
    got = Plan(239, 250, 2000, 0.5, (0, 4), (1, 2, 3), (5,))
    assert Plan.from_json(got.to_json()) == got
    assert RankView.from_json(
        {"rank": 3, "consistent": False, "step": 7, "cursor": 9, "why": "x"}).why == "x"


def test_a_mark_brings_back_every_stream_as_the_step_started(tmp_path: Path) -> None:
    writer = mark.MarkWriter(tmp_path / "marks" / "3")
    torch.manual_seed(1)
    random.seed(2)
    np.random.seed(3)
    np.random.randn()  # a cached Gaussian in numpy's legacy generator
    writer.write(41, 52, 8192, 0.5)
    drawn = (torch.rand(4), random.random(), np.random.randn(3), random.gauss(0.0, 1.0))
    torch.rand(100)
    random.random()
    np.random.rand(9)

    kept = mark.read(tmp_path / "marks" / "3")
    assert (kept.step, kept.cursor, kept.samples, kept.lr_scale) == (41, 52, 8192, 0.5)
    restore_rng(kept.rng())
    again = (torch.rand(4), random.random(), np.random.randn(3), random.gauss(0.0, 1.0))
    assert torch.equal(drawn[0], again[0]) and drawn[1] == again[1]
    assert np.array_equal(drawn[2], again[2]) and drawn[3] == again[3]
    writer.close()


def test_a_mark_that_moved_is_rewritten_and_one_that_did_not_is_kept(tmp_path: Path) -> None:
    writer = mark.MarkWriter(tmp_path / "m")
    writer.write(1, 1, None, 1.0)
    random.random()
    writer.write(2, 2, None, 1.0)
    state = random.getstate()
    writer.write(3, 3, None, 1.0)  # nothing drawn since: the same words are kept
    random.random()
    restore_rng(mark.read(tmp_path / "m").rng())
    assert random.getstate() == state and mark.read(tmp_path / "m").samples is None


def test_a_mark_says_whether_any_stream_moved_since_its_write(tmp_path: Path) -> None:
    """A step's end is marked where its optimizer update is done; the top of ``run.batches()``
    marks again only when something drew in between."""
    writer = mark.MarkWriter(tmp_path / "m")
    assert writer.moved()  # nothing written yet
    for draw in (lambda: torch.rand(1), random.random, np.random.rand,
                 lambda: random.gauss(0.0, 1.0)):
        writer.write(1, 1, None, 1.0)
        assert not writer.moved()
        draw()
        assert writer.moved()
    writer.close()


def test_a_torn_or_foreign_mark_is_refused(tmp_path: Path) -> None:
    writer = mark.MarkWriter(tmp_path / "m")
    writer.write(5, 5, None, 1.0)
    data = bytearray((tmp_path / "m").read_bytes())
    data[16] += 1  # seq odd: the rank died while writing it
    (tmp_path / "torn").write_bytes(bytes(data))
    with pytest.raises(mark.MarkError, match="torn"):
        mark.read(tmp_path / "torn")
    (tmp_path / "other").write_bytes(b"x" * 100)
    with pytest.raises(mark.MarkError, match="not a version-2 \\(or 1\\) babysit mark"):
        mark.read(tmp_path / "other")
    with pytest.raises(mark.MarkError, match="no mark"):
        mark.read(tmp_path / "absent")


def test_the_commit_makes_the_staged_folder_a_checkpoint_of_its_step(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    plan = Plan(239, 239, None, 1.0, writers=(0,), marks=(1,), streams_lost=())
    staged = just_in_time.staging_dir(root, 239)
    staged.mkdir(parents=True)
    (staged / "__0_0.distcp").write_bytes(b"weights")
    (staged / "__0.metadata").write_bytes(b"meta")
    (staged / "rank_00000.pt").write_bytes(b"rank 0")
    (staged / just_in_time.mark_name(1)).write_bytes(b"rank 1's mark")
    (staged / "__3_0.distcp").write_bytes(b"a writer that timed out")
    files = [hash_file(staged, n) for n in ("__0_0.distcp", "__0.metadata", "rank_00000.pt",
                                            just_in_time.mark_name(1))]
    # An asynchronous save of the same step, interrupted: replaced.
    (root / "step_00000239").mkdir()
    (root / "step_00000239" / "__0_0.distcp").write_bytes(b"half")

    path = just_in_time.commit(root, plan, files, world_size=2, fault="hang")

    assert path == root / "step_00000239" and not staged.exists()
    manifest = read_manifest(path)
    assert manifest.is_just_in_time and manifest.format_version == 2
    assert manifest.just_in_time == {"fault": "hang", **plan.to_json()}
    assert sorted(f.name for f in manifest.files) == [
        "__0.metadata", "__0_0.distcp", "mark_00001.bin", "rank_00000.pt"]
    assert not (path / "__3_0.distcp").exists() and verify_manifest(manifest, path, full=True) == []
    # Resumable by a relaunch, never by a spike's rollback.
    catalog = Catalog(root)
    assert catalog.choose_for_rollback(240, allow_pending=True).checkpoint is not None
    assert catalog.choose_for_rollback(240, allow_pending=False,
                                       just_in_time=False).checkpoint is None


def test_a_mark_no_node_copied_is_a_rank_whose_streams_are_lost() -> None:
    """The plan named rank 1's and rank 2's marks, but only rank 1's node copied its own (rank
    2's node was lost between the views and the writes): rank 2 resumes with fresh streams, and
    the commit never looks for a file that is not there."""
    plan = Plan(239, 239, None, 1.0, writers=(0,), marks=(1, 2), streams_lost=(3,))
    done = just_in_time.with_marks(plan, {"__0_0.distcp", "rank_00000.pt",
                                          just_in_time.mark_name(1)})
    assert done.marks == (1,) and done.streams_lost == (2, 3)
    assert just_in_time.with_marks(plan, {just_in_time.mark_name(1), just_in_time.mark_name(2)}
                                   ) == plan


def test_a_framework_format_is_committed_as_an_external_checkpoint_its_framework_resumes(
        tmp_path: Path) -> None:
    """A writer that wrote a framework's own checkpoint (Lightning's ``.ckpt`` here) says so:
    the commit makes it external, its path the one the framework resumes from, so a relaunch
    hands it to the framework (``Resume.external``) instead of loading it itself."""
    root = tmp_path / "ckpt"
    plan = Plan(239, 239, None, 1.0, writers=(0,), marks=(1,), streams_lost=())
    staged = just_in_time.staging_dir(root, 239)
    staged.mkdir(parents=True)
    (staged / "step-239.ckpt").write_bytes(b"lightning's checkpoint")
    (staged / just_in_time.mark_name(1)).write_bytes(b"rank 1's mark")
    files = [hash_file(staged, n) for n in ("step-239.ckpt", just_in_time.mark_name(1))]
    form = just_in_time.Format.from_json({"name": "lightning", "resume": "step-239.ckpt"})

    path = just_in_time.commit(root, plan, files, world_size=2, fault="crash", form=form)

    manifest = read_manifest(path)
    assert manifest.kind == "external" and manifest.is_just_in_time
    assert manifest.external_path == str((root / "step_00000239" / "step-239.ckpt").absolute())
    assert manifest.external_is_file and manifest.data_dir(path) == path.absolute()
    assert manifest.just_in_time == {"fault": "crash", "format": "lightning", **plan.to_json()}
    assert verify_manifest(manifest, path, full=True) == []
    assert Catalog(root).choose_for_rollback(240, allow_pending=True).checkpoint is not None
    for outside in ("../x.ckpt", "sub/x.ckpt", "/x.ckpt", ".."):
        with pytest.raises(ValueError, match="its folder or a file in it"):
            just_in_time.Format.from_json({"name": "lightning", "resume": outside})
