"""What a relaunch changes, in the directive's terms (supervisor/run/rollback.py, over the one
place that decides it, policies/rollback.py): skip range, LR cut and its re-warm for a remedy
the rules did not plan in this process; and how a rank applies the re-warm step by step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from babysit.checkpoints import Catalog
from babysit.policies import rollback
from babysit.policies.loader import load_policy
from babysit.policies.rerun import Seen
from babysit.policies.rules import Rules
from babysit.policies.types import (
    Action,
    Finding,
    Incident,
    RankStep,
    Remedy,
    Severity,
    StepRecord,
)
from babysit.supervisor.contract.directive import Directive, LrRamp, Resume, SkipRange
from babysit.supervisor.run.recovery import Recovery
from babysit.supervisor.run.rollback import plan_relaunch
from babysit.supervisor.run.watch import Watch

DATA_FIRST = {"rollback": {"rerun_max_steps": 0}}
"""Reruns off: a spike's rollback skips and cuts at once (the rerun that comes first by
default: tests/policies/test_rerun.py)."""


def remedy(action: Action = Action.ROLLBACK, incident: Incident = Incident.LOSS_SPIKE,
           rewarm: int | None = 50, lr: float = 0.5, step: int = 120, onset: int = 100,
           onset_cursor: int | None = None) -> Remedy:
    f = Finding(incident, "loss_spike", Severity.CRITICAL, step, onset, "spike",
                onset_cursor=onset_cursor)
    return Remedy(action, f, "test", skip_before=10, skip_after=50, lr_scale=lr,
                  lr_rewarm=rewarm)


from tests.checkpoints.test_catalog import make_ckpt  # noqa: E402

CURSORS = {s: 2 * s for s in range(1, 200)}  # two batches per step, to tell them apart
RESUME = Resume(path="/ckpt/50", step=50, cursor=100)


def test_a_rollback_skips_around_the_onset_and_cuts_the_lr_until_past_the_skip() -> None:
    plan = plan_relaunch(remedy(), RESUME, CURSORS)
    # The batch behind step 100 is cursor 199; detection at step 120 is cursor 240.
    assert plan.skip == SkipRange(199 - 10, 240 + 50)
    assert (plan.resume, plan.lr_scale, plan.base) == (RESUME, 0.5, 1.0)
    assert plan.lr_ramp == LrRamp(cut=189, start=290, end=340, to=1.0)
    assert plan.describe() == "LR x0.5 from batch 189, back to x1 over batches 290-339"


def test_the_same_region_again_keeps_the_lower_scale_for_good() -> None:
    first = plan_relaunch(remedy(), RESUME, CURSORS)
    again = plan_relaunch(remedy(rewarm=None), RESUME, CURSORS, first.lr_scale, first.lr_ramp)
    assert (again.lr_scale, again.lr_ramp, again.base) == (0.5, None, 0.5)
    # ...and a later, unrelated rollback cuts from there and returns there.
    later = plan_relaunch(remedy(step=180, onset=170), RESUME, CURSORS, again.lr_scale, None)
    assert (later.lr_scale, later.base, later.lr_ramp and later.lr_ramp.to) == (0.25, 0.5, 0.5)


@pytest.mark.parametrize("kind", ["relaunch", "sdc", "none"])
def test_relaunches_and_sdc_rollbacks_keep_the_orders_in_force(kind: str) -> None:
    ramp = LrRamp(250, 300, 350, 1.0)
    r = {"relaunch": remedy(Action.RELAUNCH), "none": None,
         "sdc": remedy(incident=Incident.SDC, lr=1.0)}[kind]
    plan = plan_relaunch(r, RESUME, CURSORS, 0.5, ramp)
    assert (plan.skip, plan.lr_scale, plan.lr_ramp, plan.base) == (None, 0.5, ramp, 1.0)


def test_after_a_takeover_the_findings_own_cursor_stands_in() -> None:
    plan = plan_relaunch(remedy(onset_cursor=500), None, {})
    assert plan.skip == SkipRange(489, 550)
    assert plan.lr_ramp == LrRamp(489, 550, 600, 1.0)


def test_the_rank_applies_the_ramp_per_step_and_it_survives_json() -> None:
    # Full LR up to the skipped batches (they trained well the first time), cut past them,
    # then back linearly.
    d = Directive(lr_scale=0.5, lr_ramp=LrRamp(cut=60, start=100, end=150, to=1.0))
    d = Directive.from_json(json.loads(json.dumps(d.to_json())))
    assert [d.scale_at(c) for c in (0, 60, 61, 100, 125, 150, 999)] == [
        1.0, 1.0, 0.5, 0.5, 0.75, 1.0, 1.0]
    assert Directive(lr_scale=0.5).scale_at(10**6) == 0.5


def test_the_watch_journals_each_change_and_carries_the_orders_through_a_takeover() -> None:
    watch = Watch(load_policy("default", DATA_FIRST))
    for s in range(1, 130):
        watch.trace.add(s, Seen(s, None, None))
    d, changes = watch.launch(1, remedy(), RESUME)
    assert (d.lr_scale, d.lr_ramp) == (0.5, LrRamp(89, 170, 220, 1.0))
    assert [(event, fields["summary"]) for event, fields in changes] == [
        ("lr_scale", "LR x0.5 from batch 89, back to x1 over batches 170-219")]
    # A crash relaunch keeps the ramp (it is in cursor space) and changes nothing.
    d2, changes = watch.launch(2, remedy(Action.RELAUNCH), RESUME)
    assert (d2.lr_scale, d2.lr_ramp, changes) == (0.5, d.lr_ramp, [])
    heir = Watch(load_policy("default", DATA_FIRST))
    heir.load_state_dict(json.loads(json.dumps(watch.state_dict())))
    assert (heir.lr_scale, heir.lr_ramp) == (0.5, d.lr_ramp)


# -- no checkpoint, no rollback to scratch -----------------------------------------------------


def test_a_spike_without_a_good_checkpoint_before_it_alerts_and_says_why(tmp_path: Path) -> None:
    catalog = Catalog(tmp_path / "ckpts")
    recovery = Recovery(catalog, probation_steps=20, keep=3)
    spike = remedy(step=120, onset=100).finding
    assert not rollback.can_roll_back(spike, recovery.shelf())
    rules = Rules(load_policy("default", DATA_FIRST))
    alert = rules.on_finding(spike, 0.0, checkpoint=False)
    assert alert.action is Action.ALERT
    assert "no good checkpoint from before step 100" in alert.reason
    assert "--checkpoint-every" in alert.reason
    # It used up nothing: the next spike with a checkpoint is the ladder's first rollback, not
    # an escalation of a region that was never rolled back.
    later = rules.on_finding(spike, 1.0, checkpoint=True)
    assert (later.action, later.lr_rewarm) == (Action.ROLLBACK, 50)
    assert "intervention 1 " in later.reason
    # A NaN still rolls back (from scratch if need be): the run cannot go on with it.
    assert rollback.can_roll_back(remedy(incident=Incident.NONFINITE).finding, recovery.shelf())
    # A good checkpoint, old enough not to turn suspect with the onset: roll back.
    make_ckpt(catalog.root, 50)
    catalog.promote(100, 20)
    assert rollback.can_roll_back(spike, recovery.shelf())
    # Too close before the onset (inside probation): it will be suspect; still alert only.
    assert not rollback.can_roll_back(remedy(step=75, onset=65).finding, recovery.shelf())


# -- fresh baselines after a relaunch ----------------------------------------------------------


def test_a_relaunched_model_is_not_judged_by_the_old_attempts_grad_norms() -> None:
    watch = Watch(load_policy("default", DATA_FIRST))

    def step(s: int, grad_norm: float) -> list[Finding]:
        rank = RankStep(rank=0, step=s, time=float(s), cursor=s, loss=2.0, grad_norm=grad_norm)
        return watch.observe_record(StepRecord(step=s, time=float(s), ranks=(rank,),
                                               world_size=1))

    for s in range(1, 200):  # a trained model: grad norms around 0.5
        assert step(s, 0.5 + 0.01 * (s % 7)) == []
    assert [f.incident for f in step(200, 5.0)] == [Incident.GRAD_SPIKE]  # same model: a spike
    # Restarted from scratch: a fresh model's grad norm at step 1 is ~10x a trained one's.
    watch.new_attempt(0.0, Directive(attempt=1))
    assert [f for s in range(1, 30) for f in step(s, 5.0 - 0.1 * s)] == []
