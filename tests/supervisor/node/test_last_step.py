"""A node's part of a just-in-time save (``node/last_step.py``) that is pure: what its
writers' answers come to. The save itself, against real faults in real torchrun jobs, is the
end-to-end tests' (``tests/e2e/test_just_in_time.py``, ``tests/e2e/test_integrations.py``)."""

from __future__ import annotations

import pytest

from babysit.checkpoints.just_in_time import Format
from babysit.supervisor.node.last_step import Written

FILE = {"name": "model.safetensors", "size": 4, "crc32": 7}


def test_a_writers_answer_says_its_files_and_the_format_it_wrote() -> None:
    written = Written()
    written.answered(0, {"ok": True, "files": [FILE],
                         "format": {"name": "transformers", "resume": "."}})
    written.answered(1, "not answering (timed out)")
    written.answered(2, {"ok": False, "why": "its state is of step 38, not 39"})
    written.answered(3, {"ok": True, "files": [FILE], "format": {"name": "x", "resume": "../y"}})

    assert [f.name for f in written.files] == ["model.safetensors"]
    assert written.formats == {0: Format("transformers", ".")}
    assert written.failed[1] == "not answering (timed out)"
    assert written.failed[2] == "its state is of step 38, not 39"
    assert written.failed[3].startswith("its answer is malformed (ValueError")
    assert written.form() == Format("transformers", ".")


def test_writers_of_two_formats_make_no_checkpoint() -> None:
    """One writer in babysit's format (no ``format`` in its answer), another in a framework's:
    no framework reads both, so the save says so instead of committing a mixture."""
    written = Written()
    written.answered(0, {"ok": True, "files": [FILE]})
    other = Written()
    other.answered(1, {"ok": True, "files": [], "format": {"name": "lightning",
                                                           "resume": "step-9.ckpt"}})
    written.add(other)

    assert Written().form() is None
    with pytest.raises(ValueError, match="rank 0: babysit, rank 1: lightning"):
        written.form()
