"""A rank's mark (``checkpoints/mark.py``) written from streams taken earlier than its write, the
digest of the streams as the next step's first forward began, and marks of the version before."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch

from babysit.checkpoints import mark
from babysit.checkpoints.rng import expected_at_forward, restore_rng


def test_a_mark_written_from_a_snapshot_keeps_the_streams_as_they_were_taken(
        tmp_path: Path) -> None:
    """nanoGPT's step: its last forward ends (the snapshot), the next batch is drawn, then the
    update; the step's end is marked with the streams from before that draw."""
    torch.manual_seed(1)
    random.seed(2)
    np.random.seed(3)
    held = mark.Streams()
    held.take()
    drawn = (torch.rand(4), random.random(), np.random.rand(2))  # the prefetch
    writer = mark.MarkWriter(tmp_path / "m")
    writer.write(7, 7, None, 1.0, held)
    assert writer.moved()  # the streams now are past the snapshot's
    restore_rng(mark.read(tmp_path / "m").rng())
    assert not writer.moved()
    again = (torch.rand(4), random.random(), np.random.rand(2))
    assert torch.equal(drawn[0], again[0]) and drawn[1] == again[1]
    assert np.array_equal(drawn[2], again[2])
    writer.write(8, 8, None, 1.0)  # of now, as ever
    assert not writer.moved()
    writer.close()


def test_a_snapshot_gives_a_checkpoints_streams() -> None:
    torch.manual_seed(4)
    held = mark.Streams()
    held.take()
    drawn = torch.rand(3)
    torch.rand(10)
    restore_rng(held.rng())
    assert torch.equal(torch.rand(3), drawn)


def test_the_streams_digest_at_the_next_forward_travels_with_the_mark_to_the_restore(
        tmp_path: Path) -> None:
    torch.manual_seed(5)
    writer = mark.MarkWriter(tmp_path / "m")
    writer.write(3, 3, None, 1.0)
    assert mark.read(tmp_path / "m").forward == 0 and "forward" not in \
        mark.read(tmp_path / "m").rng()
    torch.rand(2)  # the next step's batch
    probe = mark.Streams()
    at_forward = probe.digest()
    assert at_forward and probe.digest() == at_forward  # nothing drew: the same digest
    writer.note(at_forward)
    kept = mark.read(tmp_path / "m")
    assert (kept.step, kept.forward) == (3, at_forward)
    torch.rand(5)
    assert probe.digest() != at_forward

    restore_rng(kept.rng())
    assert expected_at_forward() == at_forward
    assert expected_at_forward() is None  # taken once
    torch.rand(2)
    assert probe.digest() == at_forward
    restore_rng(kept.rng())
    torch.rand(1)  # a restore whose loop never asked (no hooks), long ago: nothing expected
    assert expected_at_forward() is None
    writer.write(4, 4, None, 1.0)  # a new mark: no digest until its own next forward
    assert mark.read(tmp_path / "m").forward == 0
    restore_rng(mark.read(tmp_path / "m").rng())
    assert expected_at_forward() is None
    writer.close()


def test_a_version_1_mark_is_still_read(tmp_path: Path) -> None:
    """A just-in-time checkpoint written before the digest was added keeps its marks."""
    torch.manual_seed(6)
    writer = mark.MarkWriter(tmp_path / "m")
    writer.write(9, 10, 11, 0.5)
    data = bytearray((tmp_path / "m").read_bytes())
    fields = list(mark.HEADER.unpack_from(data))
    mark.HEADER_V1.pack_into(data, 0, fields[0], 1, *fields[2:-1])
    (tmp_path / "v1").write_bytes(bytes(data))
    old = mark.read(tmp_path / "v1")
    assert (old.step, old.cursor, old.samples, old.lr_scale, old.forward) == (9, 10, 11, 0.5, 0)
    drawn = torch.rand(3)
    restore_rng(old.rng())
    assert torch.equal(torch.rand(3), drawn)
    writer.close()
