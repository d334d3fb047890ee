"""The report's shared marks and its journal lines, pure: markers that would overlap are
stacked, and journal entries read as words."""

from __future__ import annotations

from babysit.supervisor.commands.report.html import describe
from babysit.supervisor.commands.report.marks import spread


def test_markers_close_in_time_stack_and_lone_ones_stay_on_the_row() -> None:
    offsets = spread([10.0, 10.1, 10.2, 50.0], span=100.0)
    assert offsets[3] == 0.0
    assert sorted(offsets[:3]) == [-0.2, 0.0, 0.2]  # three apart, centred on the row
    many = spread([5.0] * 20, span=100.0)
    assert len(set(many)) == 20 and max(many) - min(many) <= 0.7 + 1e-9  # inside the row


def test_journal_entries_are_described_in_words() -> None:
    scalars = {"event": "worker_scalars", "rank": 0, "data": {"step": 40,
                                                              "values": {"eval_loss": 2.25}}}
    assert describe(scalars) == "rank 0, step 40: eval_loss 2.25"
    state = {"event": "watch_state", "state": {"detectors": {"a": [1, 2, 3]}}}
    assert "{" not in describe(state)
    nested = {"event": "x", "step": 3, "data": {"a": 1, "b": {"c": [1, 2]}, "d": 2, "e": 3}}
    assert describe(nested) == "step 3, data: 4 fields"
