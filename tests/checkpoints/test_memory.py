"""Memory copies, the supervisor's side and the pure parts of the ranks' (``checkpoints.memory``,
``checkpoints.memory_copy``): peers, holders, the commit, the catalog's choice and retention,
and the transfers a load plans. The copies themselves, replicated over gloo and fetched back by
real ranks, are ``tests/e2e/test_memory.py``'s."""

from __future__ import annotations

from pathlib import Path

from babysit.checkpoints import Catalog, Verdict, memory
from babysit.checkpoints.manifest import FileEntry, Manifest, hash_file, write_manifest
from babysit.checkpoints.memory import Part, Place, copy_dir, peers
from babysit.checkpoints.memory_copy import _prune, _transfers


def test_a_ranks_copy_goes_to_the_same_local_rank_of_the_next_node() -> None:
    # 3 nodes of 2 ranks: rank 1 (node 0) sends to rank 3 (node 1) and keeps rank 5's (node 2).
    assert peers(1, 6, 2) == memory.Peers(3, 5)
    assert peers(5, 6, 2) == memory.Peers(1, 3)
    assert peers(0, 2, 1) == memory.Peers(1, 1)
    assert peers(1, 2, 2) == memory.Peers(None, None)  # one node: no peer


def _part(rank: int, node: int, names: list[str], kept_for: int | None = None,
          kept: list[str] = ()) -> Part:  # type: ignore[assignment]
    return Part(rank, node, tuple(FileEntry(n, 4, 1) for n in names), kept_for,
                tuple(FileEntry(n, 4, 1) for n in kept), cursor=235, stall_s=0.01)


def _two_nodes() -> dict[int, Part]:
    """FSDP2 on two nodes, a rank each: each writes its shard and keeps the other's."""
    zero = ["__0.metadata", "__0_0.distcp", "rank_00000.pt"]
    one = ["__1.metadata", "__1_0.distcp", "rank_00001.pt"]
    return {0: _part(0, 0, zero, 1, one), 1: _part(1, 1, one, 0, zero)}


def test_a_committed_copy_names_every_file_and_the_nodes_that_hold_it(tmp_path: Path) -> None:
    manifest = memory.commit(tmp_path / "ckpt", 235, _two_nodes(), 2, tmp_path / "shm")
    assert manifest.is_memory and manifest.step == 235 and manifest.cursor == 235
    assert {e.name for e in manifest.files} == {"__0.metadata", "__0_0.distcp", "rank_00000.pt",
                                                "__1.metadata", "__1_0.distcp", "rank_00001.pt"}
    assert set(manifest.memory["holders"]["__1_0.distcp"]) == {0, 1}  # type: ignore[index]
    # Node 1 lost: node 0 keeps its replica; both lost: nothing holds it.
    assert memory.missing(manifest, [0]) == []
    assert memory.missing(manifest, []) != []
    # A copy without replicas (one node): losing node 1 loses its shard.
    alone = {0: _part(0, 0, ["__0_0.distcp"]), 1: _part(1, 1, ["__1_0.distcp"])}
    lonely = memory.commit(tmp_path / "ckpt", 240, alone, 2, tmp_path / "shm")
    assert memory.missing(lonely, [0]) == ["__1_0.distcp"]


def _written(folder: Path, step: int, parts: dict[int, Part]) -> dict[int, Part]:
    """The parts' files really written into ``folder`` (one node's), hashed as written."""
    data = copy_dir(folder, step)
    data.mkdir(parents=True)
    out = {}
    for rank, part in parts.items():
        for entry in (*part.files, *part.kept):
            (data / entry.name).write_bytes(f"{entry.name} of step {step}".encode())
        out[rank] = Part(rank, part.node, tuple(hash_file(data, e.name) for e in part.files),
                         part.kept_for, tuple(hash_file(data, e.name) for e in part.kept),
                         cursor=step)
    return out


def test_the_catalog_takes_the_newest_copy_a_live_node_holds_and_refuses_a_corrupt_one(
        tmp_path: Path) -> None:
    root, shm = tmp_path / "ckpt", tmp_path / "shm"
    live = [0, 1]
    catalog = Catalog(root, memory=Place(0, shm, lambda: live))
    for step in (230, 235):
        memory.commit(root, step, _written(shm, step, _two_nodes()), 2, shm)
    # A checkpoint on disk of step 200, older: the newest copy in memory wins.
    disk = root / "step_00000200"
    disk.mkdir()
    (disk / "x").write_bytes(b"x")
    write_manifest(disk, Manifest(200, 200, 1.0, 2, (hash_file(disk, "x"),)))
    assert catalog.choose_for_rollback(241, allow_pending=True).checkpoint.step == 235  # type: ignore[union-attr]
    # A flipped byte in this node's file of 235: refused, marked corrupt, 230 taken.
    victim = copy_dir(shm, 235) / "__0_0.distcp"
    victim.write_bytes(bytes([victim.read_bytes()[0] ^ 1]) + victim.read_bytes()[1:])
    choice = catalog.choose_for_rollback(241, allow_pending=True)
    assert choice.checkpoint is not None and choice.checkpoint.step == 230
    assert "CRC-32" in choice.refused[0].problems[0]
    assert catalog.get(235).verdict is Verdict.CORRUPT  # type: ignore[union-attr]
    # Both nodes gone: no copy is in reach (none is marked: it is out of reach, not damaged).
    live.clear()
    choice = catalog.choose_for_rollback(241, allow_pending=True)
    assert choice.checkpoint is not None and choice.checkpoint.step == 200
    assert "no live node holds" in choice.refused[0].problems[0]
    assert catalog.get(230).verdict is Verdict.PENDING  # type: ignore[union-attr]


def test_retention_keeps_the_newest_copies_apart_from_the_checkpoints_on_disk(
        tmp_path: Path) -> None:
    root, shm = tmp_path / "ckpt", tmp_path / "shm"
    catalog = Catalog(root, memory=Place(0, shm, lambda: [0, 1]))
    for step in (100, 200):
        disk = root / f"step_{step:08d}"
        disk.mkdir(parents=True)
        (disk / "x").write_bytes(b"x")
        write_manifest(disk, Manifest(step, step, 1.0, 2, (hash_file(disk, "x"),)))
    for step in range(205, 240, 5):
        memory.commit(root, step, _two_nodes(), 2, shm)
    catalog.retain(keep_last=2)
    assert [c.step for c in catalog.checkpoints()] == [100, 200, 230, 235]


def test_a_load_fetches_once_per_node_from_the_lowest_rank_that_holds_a_file() -> None:
    # Nodes 0 and 2 of three, two ranks each (node 1 lost; node 2 is the spare in its place).
    everyone = [(0, {"a", "b", "m"}, {"a", "m"}), (0, {"a", "b", "m"}, {"b", "m"}),
                (2, set(), {"a", "m"}), (2, set(), {"b", "m", "lost"})]
    transfers, lost = _transfers(everyone)  # type: ignore[arg-type]
    assert transfers == [(0, 2, "a"), (0, 2, "b"), (0, 2, "m")]
    assert lost == ["lost"]


def test_a_node_never_holds_more_copies_than_the_fit_check_counted(tmp_path: Path) -> None:
    """Before a copy is written the older ones are pruned so that it makes ``KEEP`` with them
    (the newest two committed and the one being written), not ``KEEP`` + 1 at the peak; a copy
    another rank of the node already started is kept."""
    for step in (5, 10, 15):
        copy_dir(tmp_path, step).mkdir(parents=True)
    _prune(tmp_path / memory.MEMORY_DIR, memory.KEEP, writing=20)
    assert sorted(p.name for p in (tmp_path / memory.MEMORY_DIR).iterdir()) == [
        copy_dir(tmp_path, s).name for s in (10, 15)]
    copy_dir(tmp_path, 20).mkdir()  # another rank of the node is writing it already
    _prune(tmp_path / memory.MEMORY_DIR, memory.KEEP, writing=20)
    assert sorted(p.name for p in (tmp_path / memory.MEMORY_DIR).iterdir()) == [
        copy_dir(tmp_path, s).name for s in (10, 15, 20)]


def test_the_copies_of_a_timeline_a_rollback_left_never_push_out_the_runs_own(
        tmp_path: Path) -> None:
    """Copies at steps 10, 20 and 30, then a rollback to the checkpoint of step 5 on disk, and
    the relaunch's copies every 7 steps: the first, of step 7, finds the abandoned 10, 20, 30
    and drops them (kept as "the newest", they would push out 7 and 14 as soon as written)."""
    for step in (10, 20, 30):
        copy_dir(tmp_path, step).mkdir(parents=True)
    for step in (7, 14):
        _prune(tmp_path / memory.MEMORY_DIR, memory.KEEP, writing=step)
        copy_dir(tmp_path, step).mkdir()
        _prune(tmp_path / memory.MEMORY_DIR, memory.KEEP)
    assert sorted(p.name for p in (tmp_path / memory.MEMORY_DIR).iterdir()) == [
        copy_dir(tmp_path, s).name for s in (7, 14)]
