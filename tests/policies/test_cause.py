"""Whose fault a repeated hang or crash is (``policies/cause.py``) and what the rules make of it:
the data's is rolled back past its batches, the code's stops the run, the rest climbs the
ladders."""

from __future__ import annotations

import json
import signal
from dataclasses import replace

from babysit.policies import cause, rollback
from babysit.policies.cause import Fault, Follows
from babysit.policies.detectors import classify
from babysit.policies.loader import load_policy
from babysit.policies.rollback import Known, Orders, Ramp, Saved, Shelf, Span
from babysit.policies.rules import Rules
from babysit.policies.types import Action, Finding, Incident, Remedy, Severity

CURSORS = {s: s for s in range(1, 40)}
"""One global batch per step: step s leaves the cursor at s."""


def hang(step: int = 12, ranks: tuple[int, ...] = (1,)) -> Finding:
    return Finding(incident=Incident.HANG, detector="hang", severity=Severity.CRITICAL,
                   step=step, onset_step=step, ranks=ranks, message="hang")


def crash(step: int = 12, rank: int = 1, again: bool = False) -> Finding:
    """A native decoder's segfault on a corrupt sample (a Python exception from the loader is a
    ``data`` crash, below). ``again``: the watch has seen the same crash at this step before
    (``deterministic``)."""
    previous = [classify(None, signal.SIGSEGV, "", step=step).key()] if again else []
    return classify(None, signal.SIGSEGV, "", step=step, previous=previous).to_finding(
        ranks=(rank,))


def test_a_fault_is_placed_at_the_batches_of_the_step_it_struck_in() -> None:
    assert cause.place(hang(12), CURSORS) == Fault("hang", (1,), 12, 12, 13)
    # Gradient accumulation: four batches a step, the fault is somewhere in the next four.
    assert cause.place(hang(3), {2: 8, 3: 12}) == Fault("hang", (1,), 3, 12, 16)
    # After a skip of batch 12 the next step draws batch 13: that is where a fault then strikes.
    assert cause.place(hang(12), CURSORS, [Span(12, 13)]) == Fault("hang", (1,), 12, 13, 14)
    # No cursor (the script does not read through run.batches()), or before any batch: unplaced.
    assert cause.place(hang(12), {}) is None
    assert cause.place(hang(12), {12: 0}) is None
    spike = Finding(incident=Incident.LOSS_SPIKE, detector="loss_spike",
                    severity=Severity.CRITICAL, step=12, onset_step=10, message="spike")
    assert cause.place(spike, CURSORS) is None
    placed = cause.place(crash(), CURSORS)
    assert placed is not None and placed.signature == "signal SIGSEGV"


def test_what_a_fault_follows() -> None:
    first = Fault("hang", (1,), 12, 12, 13)
    assert cause.follows(first, []) == (Follows.NOTHING_YET, None)
    # The same batches on the same rank (the stacks may name its waiting peer along): data.
    assert cause.follows(Fault("hang", (0, 1), 12, 12, 13), [first]) == (Follows.DATA, first)
    # The same step over other batches: the step count, the code's.
    assert cause.follows(Fault("hang", (1,), 12, 13, 14), [first]) == (Follows.CODE, first)
    # Elsewhere, on another rank, or another incident or error: nothing shown yet.
    for other in (Fault("hang", (1,), 20, 20, 21), Fault("hang", (0,), 12, 12, 13),
                  Fault("crash", (1,), 12, 12, 13, "ValueError: x")):
        assert cause.follows(other, [first]) == (Follows.NOTHING_YET, None)
    assert Fault.from_json(json.loads(json.dumps(first.to_json()))) == first
    assert first.where() == "global batch 12 on rank 1"


def test_a_hang_at_the_same_batch_twice_is_rolled_back_past_it_and_nothing_else() -> None:
    rules = Rules(load_policy("default"))
    ramp = Orders(0.5, Ramp(cut=5, start=10, end=60, to=1.0))  # an earlier rollback's re-warm
    known = Known(Shelf(), CURSORS, ramp)

    first, plan = rules.judge(hang(12), 0.0, known)
    assert first.action is Action.RELAUNCH and plan is None  # nothing shown yet: the ladder

    second, plan = rules.judge(hang(12, ranks=(0, 1)), 10.0, known)
    assert second.action is Action.ROLLBACK
    assert second.reason == ("same hang at global batch 12 on ranks 0 and 1 twice -> the data's: "
                             "rolled back and batch 12 skipped, the LR unchanged")
    assert plan is not None and plan.skip == Span(12, 13) and plan.orders == ramp
    assert plan.region is None  # nothing for a later spike to escalate from
    # Back to the newest checkpoint before it, pending ones too: a hang says nothing of weights.
    assert rollback.resume_bound(second) == (13, True)
    # A supervisor that inherits the remedy from the journal places the same skip.
    inherited = Remedy.from_json(json.loads(json.dumps(second.to_json())),
                                 Finding.from_json(second.finding.to_json()))
    again = rollback.for_remedy(inherited, Known(orders=ramp))
    assert (again.skip, again.orders) == (Span(12, 13), ramp)


def test_a_crash_that_follows_the_data_is_skipped_and_one_that_follows_the_step_stops() -> None:
    rules = Rules(load_policy("default"))
    known = Known(Shelf(), CURSORS)
    assert rules.judge(crash(), 0.0, known)[0].action is Action.RELAUNCH
    data, plan = rules.judge(crash(again=True), 1.0, known)  # not stopped: skipped
    assert data.action is Action.ROLLBACK and "the data's" in data.reason
    assert plan is not None and plan.skip == Span(12, 13)
    # After the skip, step 13 reads batch 13 and the same error strikes at the same step.
    code, _ = rules.judge(crash(), 2.0, Known(Shelf(), CURSORS, skips=[Span(12, 13)]))
    assert code.action is Action.STOP
    assert "follows the step count, not the data -> the code's" in code.reason


LOADER_ERROR = ('Traceback (most recent call last):\n  File "train.py", line 40, in <module>\n'
                '  File "/x/babysit/supervisor/rank/api.py", line 153, in batches\n'
                '  File "/x/babysit/supervisor/rank/api.py", line 581, in _draw_batch\n'
                '  File "/data/shards.py", line 9, in __iter__\n'
                "ValueError: corrupt sample in shard-00042.tar\n")


def test_a_loader_exception_is_relaunched_once_and_skipped_when_it_comes_back() -> None:
    # A user-code exception is never relaunched; one the data loader raised is, once, so that
    # it can show what it follows.
    def loader_crash(again: bool = False) -> Finding:
        previous = [classify(1, None, LOADER_ERROR, step=12).key()] if again else []
        return classify(1, None, LOADER_ERROR, step=12, previous=previous).to_finding(
            ranks=(1,))

    rules = Rules(load_policy("default"))
    known = Known(Shelf(), CURSORS)
    first = rules.judge(loader_crash(), 0.0, known)[0]
    assert first.action is Action.RELAUNCH and first.finding.evidence["class"] == "data"
    again, plan = rules.judge(loader_crash(again=True), 1.0, known)
    assert again.action is Action.ROLLBACK and "the data's" in again.reason
    assert plan is not None and plan.skip == Span(12, 13)
    # A bug in the loop itself stays user code: stopped at once, as before.
    bug = classify(1, None, LOADER_ERROR.replace("_draw_batch", "step"), step=12)
    assert rules.judge(bug.to_finding(ranks=(1,)), 2.0, Known(Shelf(), {}))[0].action \
        is Action.STOP


def test_a_hang_back_at_the_same_step_without_a_cursor_stops_rather_than_loops() -> None:
    # stdout mode (no run.batches()): no batches to place it on or skip; the hang ladder would
    # relaunch into it again.
    def stuck(step: int, waiting_in: str = "step") -> Finding:
        return replace(hang(step), evidence={
            "stalled": {"1": {"last_step": step, "waiting_in": waiting_in}}})

    rules = Rules(load_policy("default"))
    blind = Known(Shelf())
    assert rules.judge(stuck(12), 0.0, blind)[0].action is Action.RELAUNCH
    assert rules.judge(stuck(15), 1.0, blind)[0].action is Action.RELAUNCH  # it moved
    again, _ = rules.judge(stuck(15), 2.0, blind)
    assert again.action is Action.STOP and again.finding.evidence["follows"] == "step"
    assert "same hang at step 15 on rank 1 twice" in again.reason
    assert "run.batches()" in again.reason
    # Waiting for the first step after a resume is the start-up's business: never placed.
    fresh = Rules(load_policy("default"))
    fresh.judge(stuck(20, "first step"), 0.0, blind)
    assert fresh.judge(stuck(20, "first step"), 1.0, blind)[0].action is Action.RELAUNCH


def test_off_repeats_follow_the_ladders_and_the_memory_survives_a_takeover() -> None:
    off = Rules(load_policy("default", {"rollback.skip_repeated_faults": False}))
    known = Known(Shelf(), CURSORS)
    off.judge(crash(), 0.0, known)
    deterministic = off.judge(crash(again=True), 1.0, known)[0]
    assert deterministic.action is Action.STOP and "deterministic" in deterministic.reason

    rules = Rules(load_policy("default"))
    rules.judge(hang(12), 0.0, known)
    heir = Rules(load_policy("default"))
    heir.load_state_dict(json.loads(json.dumps(rules.state_dict())))
    assert heir.judge(hang(12), 5.0, known)[0].action is Action.ROLLBACK


def resume_failed(step: int) -> Finding:
    return Finding(incident=Incident.RESUME, detector="resume", severity=Severity.CRITICAL,
                   step=step, onset_step=step, ranks=(0,), message="the restore did not take")


def test_a_resume_that_did_not_take_tries_the_next_older_good_checkpoint_once() -> None:
    rules = Rules(load_policy("default"))
    ramp = Orders(0.5, Ramp(cut=5, start=10, end=60, to=1.0))
    shelf = Shelf((Saved(10, 10, True), Saved(15, 15, True), Saved(20, 20, False)), 5)
    first, plan = rules.judge(resume_failed(20), 0.0, Known(shelf, CURSORS, ramp))
    assert first.action is Action.ROLLBACK
    # The next older good checkpoint, and nothing else changes: the data and the LR are fine.
    assert plan is not None and plan.checkpoint == Saved(15, 15, True)
    assert plan.skip is None and plan.orders == ramp and plan.region is None
    assert rollback.resume_bound(first) == (20, False)
    second, _ = rules.judge(resume_failed(15), 5.0, Known(shelf, CURSORS, ramp))
    assert second.action is Action.STOP  # never loop rollbacks over a broken restore
    # No older good checkpoint at all: stop at once rather than train on what the resume left.
    alone = Rules(load_policy("default")).judge(resume_failed(10), 0.0, Known(shelf))[0]
    assert alone.action is Action.STOP and "no good checkpoint older than step 10" in alone.reason


def _stuck(step: int) -> Finding:
    """A hang named on no rank (every rank waited alike), its stall at a step boundary."""
    return replace(hang(step, ranks=()), evidence={
        "stalled": {"1": {"last_step": step, "waiting_in": "step"}}})


def test_a_fault_without_batches_is_kept_with_null_ones() -> None:
    """A hang back at the same step without a cursor has no batches: kept in the rules' state
    (the journal's ``watch_state``) with null ``start`` and ``end``, not -1, and read back."""
    rules = Rules(load_policy("default"))
    rules.judge(_stuck(15), 0.0, Known(Shelf()))
    [fault] = rules.state_dict()["faults"]
    assert (fault["start"], fault["end"]) == (None, None)
    assert Fault.from_json(json.loads(json.dumps(fault))) == cause.at_step(_stuck(15))


def test_a_fault_named_on_no_rank_reads_every_rank() -> None:
    rules = Rules(load_policy("default"))
    blind = Known(Shelf())
    rules.judge(_stuck(15), 0.0, blind)
    again, _ = rules.judge(_stuck(15), 1.0, blind)
    assert again.action is Action.STOP
    assert again.reason.startswith("same hang at step 15 on every rank twice: a relaunch")
    assert Fault("hang", (0, 1), 12, 12, 13).where() == "global batch 12 on ranks 0 and 1"


def test_the_death_of_a_rank_that_trained_no_batch_is_held_against_none() -> None:
    """A warm standby's rank killed while it waited, then promoted: the attempt fails at once,
    on the same rank, at the step it resumed from. It trained no batch (it never said hello:
    the watch marks it ``attached`` False), so it cannot show that a batch is at fault: the
    crash ladder answers it, and no batch is skipped. The same for a hang while a rank still
    starts up."""
    rules = Rules(load_policy("default"))
    known = Known(Shelf(), CURSORS)
    assert rules.judge(crash(), 0.0, known)[0].action is Action.RELAUNCH
    standby = replace(crash(), evidence={**crash().evidence, cause.ATTACHED: False})
    assert not cause.trained(standby) and cause.place(standby, CURSORS) is None
    again, plan = rules.judge(standby, 1.0, known)
    assert again.action is Action.RELAUNCH and plan is None, again.reason
    assert "the data's" not in again.reason
    # One that said hello and died at the same batch is the data's, as before.
    data, plan = rules.judge(crash(), 2.0, known)
    assert data.action is Action.ROLLBACK and plan is not None and plan.skip == Span(12, 13)

    starting = replace(hang(12, ranks=(0, 1)), evidence={"stalled": {
        "0": {"last_step": None, "waiting_in": "first step"},
        "1": {"last_step": None, "waiting_in": "startup"}}})
    assert not cause.trained(starting) and cause.place(starting, CURSORS) is None
    assert cause.trained(hang(12)) and cause.trained(crash())
