"""A spike's or a NaN's steps rerun before remedying it (policies/rerun.py): the verdict, the
rules around it, and the watch that carries it out."""

from __future__ import annotations

import json
import math

from babysit.policies import rerun
from babysit.policies.loader import load_policy
from babysit.policies.rerun import Rerun, Seen, Trace
from babysit.policies.rollback import Known, Saved, Shelf
from babysit.policies.rules import Rules
from babysit.policies.types import Action, Finding, Incident, RankStep, Severity, StepRecord
from babysit.supervisor.contract.directive import Resume
from babysit.supervisor.run.watch import Watch

SHELF = Shelf((Saved(40, 80, good=True), Saved(90, 180, good=True)), probation_steps=20)


def spike(step: int = 110, onset: int = 100, incident: Incident = Incident.LOSS_SPIKE) -> Finding:
    return Finding(incident, incident.value, Severity.CRITICAL, step, onset, "loss spike",
                   evidence={"baseline": 2.0}, onset_cursor=2 * onset)


def first_pass(spiked: range = range(100, 111), ranks: int = 2) -> Trace:
    """Steps 1-110 at 2 batches a step: loss 2.0, and 8.0 over ``spiked`` on rank 1 only."""
    trace = Trace()
    for s in range(1, 111):
        per_rank = {r: (14.0 if r == 1 and s in spiked else 2.0) for r in range(ranks)}
        trace.add(s, Seen(2 * s, sum(per_rank.values()) / ranks, 1.0, per_rank))
    return trace


def test_the_same_spike_on_the_rerun_is_the_datas() -> None:
    run = Rerun.start(spike(), first_pass())
    assert run is not None and run.baseline == 2.0
    for s in range(41, 110):  # the rerun from the checkpoint at step 40, bit-exact
        assert run.observe(s, Seen(2 * s, 8.0 if s >= 100 else 2.0, 1.0)) is None
    verdict = run.observe(110, Seen(220, 8.0, 1.0))
    assert verdict is not None and verdict.reproduced
    assert verdict.steps == (100, 110) and verdict.batches == (198, 220)
    assert verdict.summary() == "loss spike reproduced on the rerun at batches 198-219 -> " \
                                "the data's: skipped"
    again = verdict.as_finding()
    assert rerun.reproduced(again) and again.onset_step == 100 and again.step == 110
    assert again.evidence["rerun_verdict"]["verdict"] == "reproduced"
    # A little off (a GPU's nondeterministic kernels) is still the same spike.
    wobbly = Rerun.start(spike(), first_pass())
    assert wobbly is not None
    for s in range(100, 111):
        last = wobbly.observe(s, Seen(2 * s, 6.5, 1.0))
    assert last is not None and last.reproduced


def test_a_spike_the_rerun_does_not_meet_is_transient_and_names_the_rank_that_moved() -> None:
    run = Rerun.start(spike(), first_pass())
    assert run is not None
    for s in range(41, 111):
        verdict = run.observe(s, Seen(2 * s, 2.02, 1.0))
    assert verdict is not None and not verdict.reproduced and verdict.moved_first == (1,)
    assert verdict.summary() == ("loss spike of step 110 not reproduced on the rerun of batches "
                                 "198-219 -> a transient fault of the machine: nothing skipped, "
                                 "LR unchanged; rank 1 moved first")
    assert verdict.to_json()["verdict"] == "transient"
    # Every rank at once says nothing about one of them.
    everyone = Rerun.start(spike(), first_pass(ranks=1))
    assert everyone is not None
    for s in range(100, 111):
        verdict = everyone.observe(s, Seen(2 * s, 2.0, 1.0))
    assert verdict is not None and verdict.moved_first == ()


def test_a_nan_is_judged_where_it_comes_back() -> None:
    trace = Trace()
    for s in range(1, 24):
        trace.add(s, Seen(s, math.nan if s == 23 else 1.0, 1.0))
    nan = Finding(Incident.NONFINITE, "nonfinite", Severity.CRITICAL, 23, 23, "nan",
                  onset_cursor=23)
    back = Rerun.start(nan, trace)
    assert back is not None and back.baseline == 1.0  # the median before it
    assert back.observe(22, Seen(22, 1.0, 1.0)) is None
    verdict = back.observe(23, Seen(23, math.nan, 1.0))
    assert verdict is not None and verdict.reproduced and verdict.again == math.inf
    gone = Rerun.start(nan, trace)
    assert gone is not None
    verdict = gone.observe(23, Seen(23, 1.01, 1.0))
    assert verdict is not None and not verdict.reproduced
    # Other data under the same step (a skip range moved it) proves nothing about the data.
    moved = Rerun.start(nan, trace)
    assert moved is not None
    verdict = moved.observe(23, Seen(40, math.nan, 1.0))
    assert verdict is not None and not verdict.reproduced


def test_a_rerun_in_flight_survives_a_takeover_as_json() -> None:
    run = Rerun.start(spike(), first_pass())
    assert run is not None
    run.observe(100, Seen(200, 8.0, 1.0))
    heir = Rerun.from_json(json.loads(json.dumps(run.to_json())))
    assert heir.to_json() == run.to_json()
    assert Rerun.start(spike(), Trace()) is None  # nothing remembered: nothing to compare


# -- the rules -------------------------------------------------------------------------------


def test_a_spikes_rollback_reruns_first_and_the_reproduction_skips_without_a_new_rung() -> None:
    rules = Rules(load_policy("default"))
    known = Known(SHELF, {s: 2 * s for s in range(1, 111)})
    first, plan = rules.judge(spike(), 0.0, known)
    assert first.action is Action.ROLLBACK and rerun.asked(first.finding)
    assert (first.skip_before, first.skip_after, first.lr_scale) == (0, 0, 1.0)
    assert "rerun steps from step 41 to 110 first" in first.reason
    assert plan is not None and plan.skip is None and plan.region is None
    assert plan.checkpoint == Saved(40, 80, good=True)  # the spike's own checkpoint rule
    # The rerun saves where the data's rollback would skip from: onset 100's batch 199, less
    # the 10 batches before it.
    assert plan.save_at == 199 - 10

    run = Rerun.start(first.finding, first_pass())
    assert run is not None
    for s in range(41, 111):
        verdict = run.observe(s, Seen(2 * s, 8.0 if s >= 100 else 2.0, 1.0))
    assert verdict is not None
    data, plan = rules.judge(verdict.as_finding(), 60.0, known)
    assert data.action is Action.ROLLBACK and plan is not None and plan.skip is not None
    assert (data.skip_before, data.skip_after, data.lr_scale) == (10, 50, 0.5)
    assert data.reason.startswith("loss spike reproduced on the rerun at batches 198-219")
    # It climbed no rung: the next spike elsewhere is the ladder's second rollback...
    later, _ = rules.judge(spike(step=1010, onset=1000), 120.0, Known(
        Shelf((Saved(900, 1800, good=True),), 20), {}))
    assert "rung 2/4" in later.reason and rerun.asked(later.finding)
    # ...and was not charged: a rerun and its reproduction are one intervention.
    assert len(rules.state_dict()["interventions"]) == 2


def test_when_a_rerun_is_not_worth_it() -> None:
    known = Known(SHELF, {})
    # Off, or longer than the policy allows in steps or at the run's measured pace.
    for overrides, step_s in [({"rollback.rerun_max_steps": 0}, None),
                              ({"rollback.rerun_max_steps": 50}, None),
                              ({"rollback.rerun_max_s": 60.0}, 1.0)]:
        remedy, _ = Rules(load_policy("default", overrides)).judge(
            spike(), 0.0, Known(SHELF, {}, step_s=step_s))
        assert remedy.action is Action.ROLLBACK and not rerun.asked(remedy.finding), overrides
        assert remedy.lr_scale == 0.5
    assert rerun.asked(Rules(load_policy("default", {"rollback.rerun_max_s": 60.0})).judge(
        spike(), 0.0, Known(SHELF, {}, step_s=0.5))[0].finding)
    # The same region again, after its data was skipped, is the data's without asking.
    rules = Rules(load_policy("default"))
    asked, _ = rules.judge(spike(), 0.0, known)
    rules.judge(rerun.replace(asked.finding, evidence={"rerun": "reproduced"}), 30.0, known)
    again, _ = rules.judge(spike(step=130, onset=125), 60.0, known)
    assert not rerun.asked(again.finding) and again.skip_after == 100
    # Not a spike: a hang or a crash is not rerun here (policies/cause.py holds its repeats).
    hang = Finding(Incident.HANG, "hang", Severity.CRITICAL, 120, 120, "stalled")
    assert not rerun.asked(Rules(load_policy("default")).judge(hang, 0.0, known)[0].finding)


# -- the watch ---------------------------------------------------------------------------------


def record(step: int, losses: tuple[float, ...]) -> StepRecord:
    return StepRecord(step, float(step), tuple(
        RankStep(rank=r, step=step, time=float(step), cursor=2 * step, loss=x, grad_norm=1.0,
                 step_time=0.1) for r, x in enumerate(losses)), world_size=len(losses))


def test_the_watch_reruns_and_journals_the_verdict_of_a_transient_spike() -> None:
    watch = Watch(load_policy("default"))
    for s in range(1, 111):
        watch.observe_record(record(s, (2.0, 14.0 if s >= 100 else 2.0)))
    remedy = watch.judge(spike(), 0.0, SHELF)
    assert rerun.asked(remedy.finding)
    directive, _ = watch.launch(1, remedy, Resume(path="/ckpt/40", step=40, cursor=80))
    assert directive.skip == () and directive.lr_scale == 1.0 and watch.rerun is not None
    watch.new_attempt(0.0, directive)
    # A detector re-detecting the spike during the rerun would be left to the verdict; the
    # rerun is clean here: the verdict comes at the step it was detected at, and no finding.
    found = [f for s in range(41, 111) for f in watch.observe_record(record(s, (2.0, 2.01)))]
    assert [f for f in found if f.incident is Incident.LOSS_SPIKE] == []
    assert watch.rerun is None
    (verdict,) = watch.take_verdicts()
    assert not verdict.reproduced and verdict.moved_first == (1,)
    # The state a supervisor taking over reads carries a rerun in flight.
    watch.rerun = Rerun.start(remedy.finding, watch.trace)
    heir = Watch(load_policy("default"))
    heir.load_state_dict(json.loads(json.dumps(watch.state_dict())))
    assert heir.rerun is not None and heir.rerun.to_json() == watch.rerun.to_json()


def test_the_watch_turns_a_reproduced_spike_into_the_datas_rollback() -> None:
    watch = Watch(load_policy("default"))
    for s in range(1, 111):
        watch.observe_record(record(s, (2.0, 14.0 if s >= 100 else 2.0)))
    remedy = watch.judge(spike(), 0.0, SHELF)
    assert watch.replayed(remedy) is None  # no rerun yet
    directive, _ = watch.launch(1, remedy, Resume(path="/ckpt/40", step=40, cursor=80))
    assert directive.save_at is not None and directive.save_at > 80
    watch.new_attempt(0.0, directive)
    found = [f for s in range(41, 111)
             for f in watch.observe_record(record(s, (2.0, 14.0 if s >= 100 else 2.0)))]
    (again,) = [f for f in found if f.incident is Incident.LOSS_SPIKE]  # not re-detected
    assert rerun.reproduced(again)
    data = watch.judge(again, 60.0, SHELF)
    # What the rerun saved from step 40 up to the skip's start is the data's rollback's.
    skip_start = watch.replayed(data)
    assert skip_start == (40, directive.save_at)
    directive, entries = watch.launch(2, data, Resume(path="/ckpt/40", step=40, cursor=80))
    assert directive.skip and directive.skip[0].start == skip_start[1]
    assert directive.lr_scale == 0.5 and entries and directive.save_at is None
    assert watch.replayed(data) is None  # once
    assert watch.rerun is None


def test_a_rerun_on_another_global_batch_cannot_decide_and_is_taken_as_the_datas() -> None:
    """The first pass drew 8 samples a global batch (an ElasticSampler on 4 ranks of 2); a
    node was lost at the rerun's relaunch and its stream says 4: at the same batches lie other
    samples, so the rerun tells nothing. The spike is taken as the data's at once, as it was
    before reruns: rolled back to before it (not to the rerun's own save), skipped in samples,
    the LR cut, no new rung."""
    watch = Watch(load_policy("default"))
    watch.observe_stream({"cursor": 0, "samples": 0, "global_batch": 8})
    for s in range(1, 111):
        watch.observe_record(record(s, (2.0, 14.0 if s >= 100 else 2.0)))
    remedy = watch.judge(spike(), 0.0, SHELF)
    directive, _ = watch.launch(1, remedy, Resume(path="/ckpt/40", step=40, cursor=80,
                                                   samples=640))
    watch.new_attempt(0.0, directive)
    assert watch.observe_stream({"cursor": 80, "samples": 640, "global_batch": 8}) == []
    (found,) = watch.observe_stream({"cursor": 80, "samples": 640, "global_batch": 4})
    assert found.evidence["rerun"] == rerun.UNDECIDED and rerun.taken_as_data(found)
    assert watch.rerun is None
    (verdict,) = watch.take_verdicts()
    assert verdict.to_json()["verdict"] == "undecided" and not verdict.reproduced
    assert "draws 4 samples a global batch where the first pass drew 8" in verdict.summary()
    assert verdict.summary().endswith("-> taken as the data's")
    data = watch.judge(found, 60.0, SHELF)
    assert data.action is Action.ROLLBACK and "taken as the data's: rolled back" in data.reason
    assert watch.replayed(data) is None  # not from what the rerun saved: it drew other data
    directive, entries = watch.launch(2, data, Resume(path="/ckpt/40", step=40, cursor=80,
                                                       samples=640))
    (skip,) = directive.skip
    assert skip.samples == (skip.start * 8, skip.end * 8)  # counted at the first pass's size
    assert directive.lr_scale == 0.5 and entries and watch.rerun is None


def test_no_rerun_without_a_data_cursor() -> None:
    """Stdout mode (no ``run.batches()``): nothing says a rerun meets the same batches."""
    blind = Finding(Incident.LOSS_SPIKE, "loss_spike", Severity.CRITICAL, 110, 100, "spike",
                    evidence={"baseline": 2.0}, onset_cursor=0)
    remedy, _ = Rules(load_policy("default")).judge(blind, 0.0, Known(SHELF, {}))
    assert remedy.action is Action.ROLLBACK and not rerun.asked(remedy.finding)
