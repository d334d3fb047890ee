"""Checkpoint cadence on a real run: every save journals its blocking cost, and the advice is
rebuilt from the journal (the logic alone: ``tests/supervisor/run/test_cadence.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from babysit.supervisor.run.cadence import advisor_from_journal
from tests.conftest import babysat, read_jsonl

pytestmark = pytest.mark.e2e


def test_a_real_run_journals_blocking_costs_and_rebuilds_advice(tmp_path: Path) -> None:
    result, run_dir = babysat(tmp_path, "run", "--steps", "24", "--crash", "0:13",
                              launch_extra="  max_restarts: 1\n")
    assert result.returncode == 0, result.stdout + result.stderr
    entries = read_jsonl(run_dir / "events.jsonl")
    saves = [e for e in entries if e["event"] == "checkpoint_saved"]
    assert saves and all(e["data"]["blocking_s"] > 0 for e in saves)
    advisor = advisor_from_journal(entries, every_steps=5)
    # The crash lost one step: the live ranks kept the last one (just-in-time state), so it is
    # counted apart from the interruptions that set the advised interval.
    assert [e["outcome"] for e in entries if e["event"] == "just_in_time"] == ["saved"]
    assert advisor.interruptions == [] and advisor.covered_count == 1
    advice = advisor.advice()
    assert advice is not None and advice.optimal_steps >= 1 and advice.observed_s > 0
    assert advice.covered == 1 and advice.tau_source == "prior"
