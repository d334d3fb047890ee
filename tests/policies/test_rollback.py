"""The one place a rollback is decided (policies/rollback.py): which checkpoint, which batches
are skipped, the LR cut and its re-warm; and the supervisor carrying that plan out unchanged."""

from __future__ import annotations

import json
from pathlib import Path

from babysit.checkpoints import Catalog
from babysit.policies import rollback
from babysit.policies.loader import load_policy
from babysit.policies.rerun import Seen
from babysit.policies.rollback import Known, Orders, Ramp, Region, Saved, Shelf, Span
from babysit.policies.rules import Rules
from babysit.policies.types import Action, Finding, Incident, Severity
from babysit.supervisor.contract.directive import LrRamp, Resume, SkipRange
from babysit.supervisor.run.recovery import Recovery
from babysit.supervisor.run.watch import Watch
from tests.checkpoints.test_catalog import make_ckpt

SECTION = load_policy("default").rollback  # skip 10 before, 50 after; LR x0.5, re-warm 50
DATA_FIRST = {"rollback": {"rerun_max_steps": 0}}
"""Reruns off: the rollback of a spike skips and cuts at once (tests/policies/test_rerun.py
holds the rerun that comes first by default)."""
CURSORS = {s: 2 * s for s in range(1, 400)}  # two batches per step, to tell them apart
SHELF = Shelf((Saved(40, 80, good=True), Saved(60, 120, good=True),
               Saved(90, 180, good=False)), probation_steps=20)


def spike(step: int = 120, onset: int = 100, cursor: int | None = None,
          incident: Incident = Incident.LOSS_SPIKE) -> Finding:
    return Finding(incident, incident.value, Severity.CRITICAL, step, onset, "spike",
                   onset_cursor=cursor)


def test_a_first_rollback_goes_back_skips_around_the_onset_and_cuts_the_lr_for_a_while(
) -> None:
    plan = rollback.plan(spike(), SECTION, [], Known(SHELF, CURSORS))
    # The newest good checkpoint the spike will not make suspect (100 - 20 probation = 80).
    assert plan.possible and plan.checkpoint == Saved(60, 120, good=True)
    assert (plan.skip_before, plan.skip_after, plan.lr_factor, plan.lr_rewarm) == (10, 50,
                                                                                   0.5, 50)
    # The batch behind step 100 is cursor 199; the detection at step 120 is cursor 240.
    assert plan.skip == Span(189, 290)
    assert plan.orders == Orders(0.5, Ramp(cut=189, start=290, end=340, to=1.0))
    assert plan.region == Region(100 - 10, 100 + 50, 0) and plan.note == ""


def test_a_region_near_the_start_begins_at_batch_0() -> None:
    """Skipping 10 batches before an onset at batch 4 cannot reach below batch 0: the region
    remembered (the rules' state, journaled in ``watch_state``) starts there, not at -6."""
    plan = rollback.plan(spike(step=3, onset=2, cursor=4), SECTION, [], Known(Shelf(), CURSORS))
    assert plan.region == Region(0, 4 + 50, 0)


def test_the_same_region_again_skips_wider_and_the_cut_stays() -> None:
    first = rollback.plan(spike(cursor=1000), SECTION, [], Known(SHELF, CURSORS))
    assert first.region == Region(990, 1050, 0)
    orders = first.orders
    again = rollback.plan(spike(step=125, cursor=1060), SECTION, [first.region],
                          Known(SHELF, CURSORS, orders))
    assert (again.skip_before, again.skip_after, again.lr_rewarm) == (20, 100, None)
    assert again.region == Region(1040, 1160, 1)
    # The lower scale becomes the new base, for the rest of the run.
    assert (again.orders, again.base) == (Orders(0.5), 0.5)
    assert "inside the region of 1 earlier rollback(s)" in again.note
    third = rollback.plan(spike(step=130, cursor=1100), SECTION, [first.region, again.region],
                          Known(SHELF, CURSORS, again.orders))
    assert (third.skip_before, third.skip_after, third.orders) == (40, 200, Orders(0.25))
    # Far away is a new region: the base sizes, and a cut that wears off back to the new base.
    far = rollback.plan(spike(step=300, onset=290, cursor=9000), SECTION,
                        [first.region, again.region], Known(SHELF, CURSORS, third.orders))
    assert (far.skip_before, far.skip_after, far.lr_rewarm) == (10, 50, 50)
    assert far.orders.scale == 0.125 and far.base == 0.25


def test_sdc_goes_back_before_the_corruption_and_changes_nothing_else() -> None:
    ramp = Ramp(250, 300, 350, 1.0)
    sdc = spike(step=100, onset=61, incident=Incident.SDC)
    plan = rollback.plan(sdc, SECTION, [Region(0, 10**6, 3)], Known(SHELF, CURSORS,
                                                                    Orders(0.5, ramp)))
    # No probation window before the onset: the last agreeing check vouches up to it.
    assert plan.checkpoint == Saved(60, 120, good=True)
    assert (plan.skip, plan.skip_before, plan.skip_after, plan.region) == (None, 0, 0, None)
    assert plan.orders == Orders(0.5, ramp) and plan.lr_factor == 1.0
    assert "no batches skipped" in plan.note and "LR kept" in plan.note


def test_no_good_checkpoint_before_the_onset() -> None:
    # Only a pending one, and one inside the spike's probation window: a spike alerts...
    shelf = Shelf((Saved(30, 60, good=False), Saved(90, 180, good=True)), probation_steps=20)
    plan = rollback.plan(spike(), SECTION, [], Known(shelf, CURSORS))
    assert not plan.possible and plan.checkpoint is None
    assert not rollback.can_roll_back(spike(), shelf)
    # ...a NaN still rolls back (from scratch): the run cannot train through it.
    nan = rollback.plan(spike(incident=Incident.NONFINITE), SECTION, [], Known(shelf, CURSORS))
    assert nan.possible and nan.checkpoint is None and nan.skip == Span(189, 290)
    # An unknown shelf (replay) assumes one exists.
    assert rollback.plan(spike(), SECTION, [], Known(None, CURSORS)).possible
    # The rules alert, and use up no rung and no escalation region.
    rules = Rules(load_policy("default", DATA_FIRST))
    alert, none = rules.judge(spike(), 0.0, Known(shelf, CURSORS))
    assert (alert.action, none) == (Action.ALERT, None)
    assert "no good checkpoint from before step 100" in alert.reason
    remedy, judged = rules.judge(spike(), 1.0, Known(SHELF, CURSORS))
    assert remedy.action is Action.ROLLBACK and judged is not None and judged.lr_rewarm == 50


def test_onsets_in_cursors_and_in_steps() -> None:
    # The cursor memory places the skip range; the finding's own cursor stands in for it
    # (after a takeover the memory is empty).
    remembered = rollback.plan(spike(cursor=500), SECTION, [], Known(SHELF, CURSORS))
    taken_over = rollback.plan(spike(cursor=500), SECTION, [], Known(SHELF, {}))
    assert (remembered.skip, taken_over.skip) == (Span(189, 290), Span(489, 550))
    # Escalation compares the finding's own onset cursor, or its onset step without one.
    assert remembered.region == Region(490, 550, 0)
    by_step = rollback.plan(spike(onset=1000), SECTION, [], Known(SHELF, CURSORS))
    assert by_step.region == Region(990, 1050, 0)
    # Neither known: no skip range, and the re-warm starts where the attempt resumes.
    blind = rollback.plan(spike(onset=1000), SECTION, [], Known(SHELF, {}))
    assert blind.skip is None and blind.orders.ramp == Ramp(120, 120, 170, 1.0)
    assert blind.resumed(80).orders.ramp == Ramp(80, 80, 130, 1.0)


def test_the_checkpoint_rule_of_a_relaunch_and_of_a_rollback() -> None:
    rules = Rules(load_policy("default", DATA_FIRST))
    remedy, _ = rules.judge(spike(), 0.0, Known(SHELF, CURSORS))
    assert rollback.resume_bound(remedy) == (100, False)  # good ones before the onset
    hang = Finding(Incident.HANG, "hang", Severity.CRITICAL, 120, 120, "stalled")
    relaunch, plan = rules.judge(hang, 1.0, Known(SHELF, CURSORS))
    assert plan is None and rollback.resume_bound(relaunch) == (121, True)  # pending too


# -- carried out by the supervisor ---------------------------------------------------------


def test_the_watch_launches_the_plan_the_rules_made(tmp_path: Path) -> None:
    catalog = Catalog(tmp_path)
    recovery = Recovery(catalog, probation_steps=20, keep=10)
    make_ckpt(tmp_path, 50, size=100)
    catalog.promote(100, 20)
    assert recovery.shelf() == Shelf((Saved(50, 100, good=True),), 20)
    watch = Watch(load_policy("default", DATA_FIRST))
    for s in range(1, 130):
        watch.trace.add(s, Seen(s, None, None))
    remedy = watch.judge(spike(), 0.0, recovery.shelf())
    assert remedy.action is Action.ROLLBACK
    resume, _ = recovery.resume_for(remedy)
    assert resume is not None and resume.step == 50
    directive, entries = watch.launch(1, remedy, resume)
    # From 89 by the policy's margin, but the checkpoint resumed at batch 100 (its cursor) has
    # batches 89-99 in its weights: the skip and the cut start where the resume does.
    assert directive.skip == (SkipRange(100, 170),)
    assert (directive.lr_scale, directive.lr_ramp) == (0.5, LrRamp(100, 170, 220, 1.0))
    assert entries == [("lr_scale", {"lr_scale": 0.5, "lr_ramp": {
        "cut": 100, "start": 170, "end": 220, "to": 1.0}, "base": 1.0, "was": 1.0,
        "summary": "LR x0.5 from batch 100, back to x1 over batches 170-219"})]
    # A relaunch changes neither the skips nor the LR orders, and journals nothing.
    hang = Finding(Incident.HANG, "hang", Severity.CRITICAL, 140, 140, "stalled")
    again, entries = watch.launch(2, watch.judge(hang, 60.0, recovery.shelf()), resume)
    assert (again.skip, again.lr_ramp, entries) == (directive.skip, directive.lr_ramp, [])
    # Without a checkpoint before it, the spike alerts: no launch follows.
    bare = Recovery(Catalog(tmp_path / "none"), probation_steps=20, keep=10)
    assert watch.judge(spike(step=400, onset=390), 7200.0, bare.shelf()).action is Action.ALERT


def test_a_rollback_inherited_from_the_journal_launches_the_same_plan() -> None:
    """A supervisor taking over reads the pending remedy back from the journal: it never made
    the plan, and must launch the same attempt as the one that did."""
    made, inherited = (Watch(load_policy("default", DATA_FIRST)) for _ in range(2))
    for w in (made, inherited):
        for s in range(1, 130):
            w.trace.add(s, Seen(3 * s, None, None))
    remedy = made.judge(spike(), 0.0, SHELF)
    resume = Resume(path="/ckpt/60", step=60, cursor=120)
    copy = type(remedy).from_json(json.loads(json.dumps(remedy.to_json())), remedy.finding)
    assert made.launch(1, remedy, resume) == inherited.launch(1, copy, resume)
