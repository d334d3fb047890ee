"""Checkpoint cadence: Young's interval from measured costs and interruptions
(``babysit.supervisor.run.cadence``), and the worker side that reports each save's blocking cost and
follows a cadence change from the control file (``babysit.supervisor.rank.saving.Checkpointer``).
A real run's journal rebuilding the advice: ``tests/e2e/test_cadence.py``.

The Checkpointer tests save for real (a tiny model, ``torch.distributed.checkpoint`` in one
process); two "ranks" are two Checkpointers with their own checkpoint folders reading one control
file at different steps, which is what real ranks do.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from babysit.supervisor.contract.directive import CONTROL_FILE, Directive
from babysit.supervisor.rank.saving import Checkpointer
from babysit.supervisor.run.cadence import (
    DEFAULT_MTBF_PRIOR_S,
    Advice,
    CadenceAdvisor,
    adopt,
    advisor_from_journal,
    duration,
    estimate_tau,
    optimal_interval,
    waste_fraction,
)

# Saving in one process without a process group is what these tests mean to do.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

DAY = 86_400.0

# -- the formula --------------------------------------------------------------------------------


def test_young_interval_and_waste_against_hand_computed_values() -> None:
    # C = 50 s, tau = 10,000 s: T* = sqrt(2 * 50 * 10,000) = 1,000 s exactly.
    assert optimal_interval(50.0, 10_000.0) == pytest.approx(1000.0)
    assert waste_fraction(1000.0, 50.0, 10_000.0) == pytest.approx(0.05 + 0.05)
    # Half or twice T* cost the same: 0.1 + 0.025 and 0.025 + 0.1.
    assert waste_fraction(500.0, 50.0, 10_000.0) == pytest.approx(0.125)
    assert waste_fraction(2000.0, 50.0, 10_000.0) == pytest.approx(0.125)
    # C = 2 s, a day: T* = sqrt(345,600) = 587.88 s; waste there is sqrt(2C/tau) = 0.68%.
    assert optimal_interval(2.0, DAY) == pytest.approx(587.8775, rel=1e-6)
    assert waste_fraction(optimal_interval(2.0, DAY), 2.0, DAY) == pytest.approx(
        math.sqrt(4.0 / DAY))
    assert waste_fraction(0.0, 2.0, DAY) == math.inf


def test_t_star_minimises_the_waste() -> None:
    best = optimal_interval(3.0, 40_000.0)
    for factor in (0.5, 0.9, 0.99, 1.01, 1.1, 2.0):
        assert waste_fraction(best * factor, 3.0, 40_000.0) > waste_fraction(best, 3.0, 40_000.0)


def test_tau_with_no_interruptions_is_the_prior() -> None:
    assert estimate_tau(0.0, 0) == (DEFAULT_MTBF_PRIOR_S, "prior")
    tau, source = estimate_tau(3600.0, 0, prior_s=DAY)
    assert (tau, source) == (DAY + 3600.0, "prior")


def test_tau_with_many_interruptions_is_the_runs_own() -> None:
    # 20 interruptions in 10 days, prior a day: (10 + 1) days / 21.
    tau, source = estimate_tau(10 * DAY, 20, prior_s=DAY)
    assert tau == pytest.approx(11 * DAY / 21)
    assert source == "observed"
    # It tends to the observed mean (12 h) as the record grows.
    assert estimate_tau(1000 * DAY, 2000)[0] == pytest.approx(DAY / 2, rel=0.01)


def test_tau_between_the_two_is_mixed() -> None:
    tau, source = estimate_tau(600.0, 1, prior_s=DAY)
    assert tau == pytest.approx((DAY + 600) / 2) and source == "mixed"
    # A long clean record: the run supplied the time, the prior the one interruption.
    assert estimate_tau(5 * DAY, 0, prior_s=DAY) == (6 * DAY, "mixed")


# -- the advisor --------------------------------------------------------------------------------


def advised(every: int = 100, blocking: tuple[float, ...] = (2.0,),
            step_s: float = 0.5) -> CadenceAdvisor:
    advisor = CadenceAdvisor(every, mtbf_prior_s=DAY)
    for b in blocking:
        advisor.on_checkpoint(b)
    advisor.on_step_time(step_s)
    return advisor


def test_no_advice_until_a_checkpoint_cost_and_a_step_time_are_known() -> None:
    advisor = CadenceAdvisor(100)
    assert advisor.advice() is None
    advisor.on_checkpoint(2.0)
    assert advisor.advice() is None
    advisor.on_step_time(0.5)
    assert advisor.advice() is not None
    assert CadenceAdvisor(0).advice() is None  # babysit saves nothing: nothing to advise


def test_advice_numbers() -> None:
    advice = advised(blocking=(2.0, 50.0, 2.0)).advice()  # the median ignores one slow save
    assert advice is not None
    assert advice.blocking_s == 2.0 and advice.tau_s == DAY and advice.tau_source == "prior"
    assert advice.optimal_interval_s == pytest.approx(587.8775, rel=1e-6)
    assert advice.optimal_steps == 1176  # 587.88 s / 0.5 s per step
    assert advice.configured_steps == 100
    assert advice.waste_configured == pytest.approx(2 / 50 + 50 / (2 * DAY))
    assert advice.waste_optimal == pytest.approx(2 / 588 + 588 / (2 * DAY))


def test_summary_line() -> None:
    advice = advised().advice()
    assert advice is not None
    assert advice.summary() == (
        "checkpoint every 1176 steps (configured 100): C=2.0 s, tau=24.0 h (prior; "
        "0 interruptions in 0 s) -> T*=9.8 min at 500 ms/step; waste 4.03% -> 0.68%")


def test_interruptions_and_running_time_shorten_the_interval() -> None:
    advisor = advised()
    before = advisor.advice()
    advisor.on_run_time(DAY)
    for i in range(5):
        advisor.on_interruption("crash", 1000.0 + i)
    after = advisor.advice()
    assert before is not None and after is not None
    assert after.tau_s == pytest.approx(2 * DAY / 6) and after.interruptions == 5
    assert after.optimal_steps < before.optimal_steps
    assert advisor.interruptions[-1] == ("crash", 1004.0)


def test_garbled_inputs_move_nothing() -> None:
    advisor = advised()
    before = advisor.advice()
    for bad in (math.nan, math.inf, -1.0):
        advisor.on_checkpoint(bad)
        advisor.on_step_time(bad)
        advisor.on_run_time(bad)
    advisor.on_step_time(0.0)
    assert advisor.advice() == before


def test_a_bad_prior_is_refused_with_the_key_to_fix() -> None:
    with pytest.raises(ValueError, match=r"checkpoints\.cadence\.mtbf_prior_s"):
        CadenceAdvisor(100, mtbf_prior_s=0.0)


def test_state_round_trip_mid_stream_changes_nothing() -> None:
    a = advised(blocking=(1.0, 3.0, 2.5))
    a.on_run_time(5000.0)
    a.on_interruption("hang", 123.0)
    b = CadenceAdvisor(100, mtbf_prior_s=DAY)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))  # through the journal's JSON
    assert b.advice() == a.advice() and b.interruptions == a.interruptions
    for advisor in (a, b):  # and both go on the same way
        advisor.on_checkpoint(9.0)
        advisor.on_step_time(0.7)
        advisor.on_interruption("crash", 456.0)
    assert b.advice() == a.advice()
    with pytest.raises(ValueError, match="rebuild it from the journal"):
        b.load_state_dict({"version": 99})


# -- adopting -----------------------------------------------------------------------------------


def advice_of(optimal_steps: int) -> Advice:
    return Advice(blocking_s=1.0, tau_s=DAY, tau_source="prior", interruptions=0,
                  observed_s=0.0, step_s=1.0, optimal_interval_s=float(optimal_steps),
                  optimal_steps=optimal_steps, configured_steps=100, waste_configured=0.0,
                  waste_optimal=0.0)


def test_adopt_clamps_to_the_bounds() -> None:
    assert adopt(advice_of(1176), 100, min_steps=50, max_steps=1000) == 1000
    assert adopt(advice_of(3), 100, min_steps=20, max_steps=1000) == 20
    assert adopt(advice_of(300), 100, min_steps=20, max_steps=1000) == 300
    # Already at the bound the advice pushes against: nothing to do.
    assert adopt(advice_of(5000), 1000, min_steps=20, max_steps=1000) is None
    # A cadence outside the bounds is brought inside them.
    assert adopt(advice_of(5000), 5000, min_steps=20, max_steps=1000) == 1000


def test_adopt_respects_the_tolerance_both_ways() -> None:
    assert adopt(advice_of(1100), 1000, 1, 10_000) is None  # 10% off
    assert adopt(advice_of(1190), 1000, 1, 10_000) is None  # 19%
    assert adopt(advice_of(1250), 1000, 1, 10_000) == 1250  # 25%
    assert adopt(advice_of(840), 1000, 1, 10_000) is None  # 1000/840 = 1.19
    assert adopt(advice_of(820), 1000, 1, 10_000) == 820  # 1000/820 = 1.22
    assert adopt(advice_of(1100), 1000, 1, 10_000, tolerance=0.05) == 1100


def test_adopt_does_not_flap_on_a_noisy_estimate() -> None:
    current, switches = 100, []
    # The optimum wanders +-15% around 400 (noisy checkpoint costs, a slowly growing tau).
    for optimal in (400, 460, 350, 420, 380, 455, 345, 400, 440, 360):
        new = adopt(advice_of(optimal), current, min_steps=10, max_steps=10_000)
        if new is not None:
            switches.append(new)
            current = new
    assert switches == [400]


def test_adopt_refuses_bad_bounds_and_leaves_disabled_saves_alone() -> None:
    with pytest.raises(ValueError, match="min_steps"):
        adopt(advice_of(100), 100, min_steps=0, max_steps=10)
    with pytest.raises(ValueError, match="max_steps"):
        adopt(advice_of(100), 100, min_steps=50, max_steps=10)
    assert adopt(advice_of(100), 0, min_steps=1, max_steps=1000) is None


def test_duration_formatting() -> None:
    assert [duration(s) for s in (0.0, 0.0123, 2.06, 636.0, 86_400.0, 3 * DAY)] == [
        "0 s", "12.3 ms", "2.1 s", "10.6 min", "24.0 h", "3.0 d"]


# -- rebuilding from a journal ------------------------------------------------------------------


def saved(t: float, attempt: int, step: int, blocking: float | None) -> dict[str, Any]:
    data: dict[str, Any] = {"step": step, "path": f"/ckpt/step_{step:08d}", "external": False,
                            "asynchronous": False}
    if blocking is not None:
        data["blocking_s"] = blocking
    return {"time": t, "event": "checkpoint_saved", "attempt": attempt, "checkpoint_step": step,
            "rank": 0,
            "data": data}


def state(t: float, attempt: int, old: str, new: str) -> dict[str, Any]:
    return {"time": t, "event": "state", "attempt": attempt, "old": old, "new": new}


def finding(t: float, incident: str, action: str) -> dict[str, Any]:
    return {"time": t, "event": "finding", "attempt": 0, "step": 243,
            "finding": {"incident": incident, "step": 243}, "remedy": {"action": action}}


JOURNAL: list[dict[str, Any]] = [
    # The first supervisor: a crash, a relaunch, then a SIGTERM whose final checkpoint saved.
    {"time": 1000.0, "event": "run_started", "attempt": 0},
    {"time": 1001.0, "event": "launch", "attempt": 0},
    state(1005.0, 0, "starting", "running"),
    saved(1105.0, 0, 100, 2.0),
    saved(1207.0, 0, 200, 2.0),  # 100 steps in 102 s, 2 of them saving: 1 s per step
    finding(1249.0, "grad_spike", "skip_step"),  # handled in-process: nothing lost
    finding(1250.0, "crash", "relaunch"),
    state(1260.0, 0, "running", "intervening"),  # 255 s of running
    state(1270.0, 0, "relaunching", "starting"),
    state(1275.0, 1, "starting", "running"),
    saved(1300.0, 1, 225, 4.0),  # another attempt: no step time across the relaunch
    saved(1310.0, 1, 230, None),  # a journal from before blocking_s: skipped
    {"time": 1400.0, "event": "final_checkpoint_requested", "attempt": 1, "target_step": 250},
    {"time": 1405.0, "event": "final_checkpoint", "attempt": 1, "saved": True},
    state(1406.0, 1, "running", "stopped"),  # 131 s
    {"time": 1406.0, "event": "run_finished", "attempt": 1, "state": "stopped"},
    # The second supervisor takes the stopped run over; the node is reclaimed in the grace period.
    {"time": 2000.0, "event": "run_started", "attempt": 2},
    {"time": 2001.0, "event": "supervisor_takeover", "attempt": 2, "inherited_remedy": None},
    state(2010.0, 2, "starting", "running"),
    {"time": 2100.0, "event": "final_checkpoint_requested", "attempt": 2},  # 90 s, then gone
    # The third supervisor: one preemption lost work, counted once.
    {"time": 3000.0, "event": "run_started", "attempt": 3},
    {"time": 3001.0, "event": "supervisor_takeover", "attempt": 3, "inherited_remedy": None},
    state(3010.0, 3, "starting", "running"),
    {"time": 3050.0, "event": "watch_state", "attempt": 3},  # still running: 40 s so far
]


def test_journal_rebuild_counts_what_lost_work() -> None:
    advisor = advisor_from_journal(JOURNAL, every_steps=100, mtbf_prior_s=DAY)
    assert advisor.interruptions == [("crash", 1250.0), ("preemption", 2100.0)]
    assert advisor.observed_s == pytest.approx(255 + 131 + 90 + 40)
    advice = advisor.advice()
    assert advice is not None
    assert advice.blocking_s == 2.0  # median of 2, 2, 4
    assert advice.step_s == pytest.approx(1.0)
    assert advice.tau_s == pytest.approx((516 + DAY) / 3)


def test_journal_rebuild_counts_a_vanished_supervisor_once() -> None:
    base = [{"time": 0.0, "event": "run_started", "attempt": 0}, state(1.0, 0, "starting",
                                                                       "running")]
    died = [*base, {"time": 50.0, "event": "watch_state", "attempt": 0},
            {"time": 900.0, "event": "run_started", "attempt": 1},
            {"time": 901.0, "event": "supervisor_takeover", "attempt": 1,
             "inherited_remedy": None}]
    advisor = advisor_from_journal(died, every_steps=10)
    assert advisor.interruptions == [("supervisor_lost", 50.0)]
    assert advisor.observed_s == pytest.approx(49.0)  # charged up to its last entry
    # It died after journaling a rollback it never launched: that finding already counted.
    pending = [*base, finding(50.0, "loss_spike", "rollback"),
               {"time": 900.0, "event": "run_started", "attempt": 1},
               {"time": 901.0, "event": "supervisor_takeover", "attempt": 1,
                "inherited_remedy": {"action": "rollback"}}]
    assert advisor_from_journal(pending, every_steps=10).interruptions == [
        ("loss_spike", 50.0)]


def test_an_interruption_just_in_time_state_covered_is_not_in_tau() -> None:
    """A crash's just-in-time save is journaled before its finding, a hang's after: either
    way the attempt's interruption lost one step and is counted apart, not in tau; one whose
    save failed (a shard lost) counts as ever."""
    def keep(t: float, attempt: int, outcome: str) -> dict[str, Any]:
        return {"time": t, "event": "just_in_time", "attempt": attempt, "outcome": outcome}

    def fault(t: float, attempt: int, incident: str) -> dict[str, Any]:
        return {**finding(t, incident, "relaunch"), "attempt": attempt}

    journal = [{"time": 0.0, "event": "run_started", "attempt": 0},
               state(1.0, 0, "starting", "running"),
               saved(10.0, 0, 10, 1.0), saved(20.0, 0, 20, 1.0),
               keep(100.0, 0, "saved"), fault(100.5, 0, "crash"),     # covered: save first
               fault(200.0, 1, "hang"), keep(200.5, 1, "saved"),      # covered: save after
               fault(300.0, 2, "hang"), keep(300.5, 2, "none"),       # a shard lost: counted
               fault(400.0, 3, "loss_spike")]                         # a rollback: counted
    advisor = advisor_from_journal(journal, every_steps=10, mtbf_prior_s=DAY)
    assert advisor.interruptions == [("hang", 300.0), ("loss_spike", 400.0)]
    assert advisor.covered_count == 2
    advice = advisor.advice()
    assert advice is not None and advice.interruptions == 2 and advice.covered == 2
    assert "2 more covered by just-in-time state or a memory copy" in advice.summary()
    assert advice.tau_s == pytest.approx((advisor.observed_s + DAY) / 3)


def test_journal_rebuild_of_nothing_advises_nothing() -> None:
    advisor = advisor_from_journal([], every_steps=100)
    assert advisor.advice() is None and advisor.observed_s == 0.0


# -- the worker side: blocking seconds and the control file -------------------------------------


@contextlib.contextmanager
def no_phase(name: str) -> Iterator[None]:
    yield


class Rank:
    """One rank's Checkpointer over a tiny real model, saving into its own folder."""

    def __init__(self, root: Path, every: int, control: Path | None, rank: int = 0,
                 async_save: bool = False, save_at: int | None = None) -> None:
        import torch

        model = torch.nn.Linear(2, 2)
        self.root = root
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.ckpt = Checkpointer(
            Directive(checkpoint_dir=str(root), checkpoint_every=every,
                      checkpoint_async=async_save, save_at=save_at),
            rank, model, torch.optim.SGD(model.parameters(), lr=0.1), None,
            lambda type_, **data: self.events.append((type_, data)))
        self.ckpt.control = control
        self.step = 0

    def run_to(self, step: int, phase: Any = no_phase) -> None:
        while self.step < step:
            self.step += 1
            self.ckpt.maybe_save(self.step, self.step, 1.0, phase)
            self.ckpt.poll()

    def saved_steps(self) -> list[int]:
        return sorted(int(p.name.split("_")[1]) for p in self.root.glob("step_*"))

    def announced(self, type_: str = "checkpoint") -> list[dict[str, Any]]:
        return [data for t, data in self.events if t == type_]


def write_control(path: Path, request: dict[str, Any]) -> None:
    """As the supervisor does: a temp file and an atomic rename."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(request))
    os.replace(tmp, path)


@pytest.fixture
def control(tmp_path: Path) -> Path:
    return tmp_path / CONTROL_FILE


def test_saves_on_the_directive_cadence_without_a_control_file(tmp_path: Path,
                                                               control: Path) -> None:
    rank = Rank(tmp_path / "r0", every=5, control=control)
    rank.run_to(16)
    assert rank.saved_steps() == [5, 10, 15]


def test_a_rerun_saves_where_its_data_remedy_would_resume_and_waits_for_it(
        tmp_path: Path, control: Path) -> None:
    """``save_at`` (a rerun's: the cursor the data's rollback would skip from): saved there
    beside the cadence, committed before the next step even when saves are asynchronous, and
    announced as an ordinary checkpoint (not the final one a preemption asks for)."""
    rank = Rank(tmp_path / "r0", every=10, control=control, async_save=True, save_at=7)
    rank.run_to(8)
    assert rank.saved_steps() == [7]
    [saved] = rank.announced()
    assert saved["step"] == 7 and "final" not in saved


def test_a_cadence_change_applies_from_its_step(tmp_path: Path, control: Path) -> None:
    write_control(control, {"checkpoint_every": 3, "from_step": 8})
    rank = Rank(tmp_path / "r0", every=5, control=control)
    rank.run_to(18)
    assert rank.saved_steps() == [5, 9, 12, 15, 18]
    assert rank.announced("cadence") == [{"every_steps": 3, "from_step": 8}]


def test_ranks_that_read_the_change_at_different_steps_save_at_the_same_steps(
        tmp_path: Path, control: Path) -> None:
    late = Rank(tmp_path / "r1", every=5, control=control, rank=1)
    late.run_to(5)  # this rank read the folder before the supervisor wrote anything
    write_control(control, {"checkpoint_every": 3, "from_step": 8, "checkpoint_at_step": 10})
    early = Rank(tmp_path / "r0", every=5, control=control, rank=0)
    early.run_to(18)
    late.run_to(18)
    assert early.saved_steps() == late.saved_steps() == [5, 9, 10, 12, 15, 18]
    assert late.announced("cadence") == []  # only rank 0 reports


def test_a_later_request_without_a_cadence_keeps_it(tmp_path: Path, control: Path) -> None:
    write_control(control, {"checkpoint_every": 3, "from_step": 1})
    rank = Rank(tmp_path / "r0", every=5, control=control)
    rank.run_to(6)
    write_control(control, {"checkpoint_at_step": 13})  # what the loop writes on SIGTERM
    rank.run_to(15)
    assert rank.saved_steps() == [3, 6, 9, 12, 13, 15]


def test_a_second_change_keeps_the_first_until_its_step(tmp_path: Path, control: Path) -> None:
    write_control(control, {"checkpoint_every": 3, "from_step": 8})
    rank = Rank(tmp_path / "r0", every=5, control=control)
    rank.run_to(10)
    write_control(control, {"checkpoint_every": 4, "from_step": 14})
    rank.run_to(21)
    assert rank.saved_steps() == [5, 9, 12, 16, 20]
    assert rank.announced("cadence") == [{"every_steps": 3, "from_step": 8},
                                         {"every_steps": 4, "from_step": 14}]


def test_a_rewrite_within_one_mtime_tick_is_still_seen(tmp_path: Path, control: Path) -> None:
    write_control(control, {"checkpoint_every": 3, "from_step": 8})
    rank = Rank(tmp_path / "r0", every=5, control=control)
    rank.run_to(2)
    stamp = os.stat(control).st_mtime_ns
    write_control(control, {"checkpoint_every": 4, "from_step": 8})  # same size
    os.utime(control, ns=(stamp, stamp))  # a coarse clock: the same mtime
    rank.run_to(12)
    assert rank.saved_steps() == [5, 8, 12]


@pytest.mark.parametrize("request_", [
    {"checkpoint_every": 0, "from_step": 3},
    {"checkpoint_every": -2, "from_step": 3},
    {"checkpoint_every": True, "from_step": 3},
    {"checkpoint_every": "3", "from_step": 3},
    {"checkpoint_every": 2.5, "from_step": 3},
    ["checkpoint_every", 3],
    "not json",
])
def test_a_malformed_request_changes_nothing(tmp_path: Path, control: Path,
                                             request_: Any) -> None:
    if request_ == "not json":
        control.write_text("{checkpoint_every: 3")
    else:
        write_control(control, request_)
    rank = Rank(tmp_path / "r0", every=5, control=control)
    rank.run_to(11)
    assert rank.saved_steps() == [5, 10]


def test_a_change_without_from_step_applies_from_the_next_step(tmp_path: Path,
                                                               control: Path) -> None:
    rank = Rank(tmp_path / "r0", every=5, control=control)
    rank.run_to(3)
    write_control(control, {"checkpoint_every": 2})
    rank.run_to(9)  # read at step 4 (not a save: from step 5 on), then 6 and 8
    assert rank.saved_steps() == [6, 8]


def test_a_sync_save_reports_the_time_training_stalled(tmp_path: Path) -> None:
    spent: list[float] = []

    @contextlib.contextmanager
    def timed_phase(name: str) -> Iterator[None]:
        assert name == "checkpoint"
        t0 = time.perf_counter()
        yield
        time.sleep(0.05)  # a slow save: the stall is more than the DCP write
        spent.append(time.perf_counter() - t0)

    rank = Rank(tmp_path / "r0", every=2, control=None)
    rank.run_to(4, phase=timed_phase)
    announced = rank.announced()
    assert [a["step"] for a in announced] == [2, 4]
    for a, inside in zip(announced, spent, strict=True):
        assert a["asynchronous"] is False
        assert inside <= a["blocking_s"] < inside + 0.05


def test_async_saves_report_the_staging_stall_and_none_is_lost(tmp_path: Path) -> None:
    rank = Rank(tmp_path / "r0", every=1, control=None, async_save=True)
    for step in range(1, 6):  # no poll between saves: each waits for the one before
        rank.step = step
        rank.ckpt.maybe_save(step, step, 1.0, no_phase)
    rank.ckpt.close()
    announced = rank.announced()
    assert [a["step"] for a in announced] == [1, 2, 3, 4, 5]
    assert all(a["asynchronous"] is True and a["blocking_s"] > 0 for a in announced)
    assert rank.saved_steps() == [1, 2, 3, 4, 5]


def test_async_saves_fall_back_to_synchronous_where_the_state_would_not_fit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import psutil

    class Scarce:  # less free memory than twice the Linear(2, 2)'s 24 bytes and SGD's none
        available = 40

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Scarce())
    rank = Rank(tmp_path / "r0", every=1, control=None, async_save=True)
    rank.run_to(2)
    rank.ckpt.close()
    assert [a["asynchronous"] for a in rank.announced()] == [False, False]
    (why,) = rank.announced("checkpoint_sync")  # said once, by rank 0
    assert "do not fit" in why["reason"] and "synchronously" in why["reason"]


def test_an_external_checkpoint_carries_no_blocking_cost(tmp_path: Path) -> None:
    # The script's own save: babysit cannot know what it cost, so the journal rebuild skips it.
    entry = saved(10.0, 0, 5, None)
    entry["data"]["external"] = True
    entry["data"]["blocking_s"] = 1.0
    assert advisor_from_journal([entry], every_steps=5).advice() is None


# -- the loop's side: when to journal, when to adopt ------------------------------------------


def _keeper(auto: bool, every: int = 100, blocking: float = 2.0, step_s: float = 0.1):
    from babysit.supervisor.run.cadence import CadenceAdvisor, CadenceKeeper

    advisor = CadenceAdvisor(every, mtbf_prior_s=3600.0)
    advisor.on_checkpoint(blocking)
    advisor.on_step_time(step_s)
    return advisor, CadenceKeeper(advisor, auto=auto, min_steps=10, max_steps=5000)


def test_keeper_journals_the_first_advice_and_then_only_real_changes() -> None:
    advisor, keeper = _keeper(auto=False)
    first, adoption = keeper.after_checkpoint(100)
    assert first is not None and adoption is None
    assert first.optimal_steps == round(math.sqrt(2 * 2.0 * 3600.0) / 0.1)  # 1200 steps
    assert keeper.after_checkpoint(200) == (None, None)  # nothing moved
    advisor.on_interruption("crash", 0.0)  # tau halves: T* shrinks by sqrt(2)
    again, _ = keeper.after_checkpoint(300)
    assert again is not None and again.optimal_steps < first.optimal_steps
    assert advisor.every_steps == 100  # advice only: the cadence in force is unchanged


def test_keeper_adopts_within_bounds_ahead_of_the_newest_step_and_waits_for_it() -> None:
    advisor, keeper = _keeper(auto=True, blocking=8.0, step_s=1.0)  # T* = 240 steps
    _, adoption = keeper.after_checkpoint(100)
    assert adoption is not None and adoption.every_steps == 240
    assert adoption.from_step == 100 + 10 and advisor.every_steps == 240
    advisor.on_interruption("hang", 0.0)
    advisor.on_interruption("hang", 0.0)  # T* moves well past the 20% band ...
    assert keeper.after_checkpoint(105)[1] is None  # ... but the last switch is not in force yet
    _, later = keeper.after_checkpoint(110)
    assert later is not None and later.every_steps < 240


def test_keeper_clamps_to_the_configured_bounds() -> None:
    _, keeper = _keeper(auto=True, blocking=50.0, step_s=0.01)  # T* = 60,000 steps
    _, adoption = keeper.after_checkpoint(100)
    assert adoption is not None and adoption.every_steps == 5000
