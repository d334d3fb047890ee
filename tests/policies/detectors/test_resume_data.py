"""A resume whose global batch changed (``policies/detectors/resume_data.py``), pure, and as the
watch runs it on real directives (``supervisor.run.watch``). The same runs for real across a
node eviction in ``tests/e2e/test_multinode.py``."""

from __future__ import annotations

from babysit.policies.detectors.resume_data import GlobalBatch, ResumeData
from babysit.policies.loader import load_policy
from babysit.policies.types import Finding, Incident, RankStep, Severity, StepRecord
from babysit.supervisor.contract.directive import Directive, Resume
from babysit.supervisor.run.watch import Watch


def record(step: int, world: int, per_rank: float | None = 4.0, cursor: int | None = None,
           reported: int | None = None) -> StepRecord:
    """Step ``step`` of ``world`` ranks, each drawing ``per_rank`` samples of one global batch
    (the cursor after it is ``step`` unless said); ``reported`` ranks' reports arrived."""
    ranks = tuple(RankStep(rank=r, step=step, time=float(step), loss=1.0, samples=per_rank,
                           cursor=step if cursor is None else cursor)
                  for r in range(world if reported is None else reported))
    return StepRecord(step=step, time=float(step), ranks=ranks, world_size=world)


def resumed(first: list[StepRecord], then: list[StepRecord], checkpoint: int,
            cursor: int | None, samples: int | None = None) -> list[Finding]:
    memory = GlobalBatch()
    for r in first:
        memory.observe(r)
    memory.new_attempt()
    check = ResumeData.start(memory, checkpoint, cursor, samples)
    assert check is not None
    return [f for r in then if (f := check.observe(r.step, memory.observe(r))) is not None]


def test_three_ranks_resumed_on_two_with_the_same_batch_each_is_told_what_it_repeats() -> None:
    """3 ranks of 4 samples to step 20 (cursor 20: 240 samples), resumed from step 12 on 2 ranks
    of 4: a loader seeking to global batch 12 starts at sample 96, not 144."""
    [finding] = resumed([record(s, 3) for s in range(1, 21)],
                        [record(s, 2) for s in range(13, 30)], 12, 12)
    assert finding.incident is Incident.RESUME and finding.severity is Severity.WARNING
    assert finding.detector == "resume_data" and finding.step == 16
    ev = finding.evidence
    assert (ev["batch_before"], ev["world_before"], ev["batch_now"], ev["world_now"]) == \
        (12.0, 3, 8.0, 2)
    assert "starts at sample 96, not 144, and trains on 48 samples a second time" \
        in finding.message


def test_a_loader_that_counts_samples_is_told_only_of_its_optimizers_batch() -> None:
    """The same resize with an ElasticSampler: the checkpoint recorded sample 144 at its
    cursor, the data went on there; what changed is the batch the LR was tuned for."""
    [finding] = resumed([record(s, 3) for s in range(1, 21)],
                        [record(s, 2) for s in range(13, 30)], 12, 12, samples=144)
    assert finding.evidence["samples"] == 144
    assert "recorded sample 144 of the data stream, where an ElasticSampler goes on, none " \
        "skipped or repeated" in finding.message
    assert "0.667x the samples its learning rate was set for" in finding.message
    assert "a second time" not in finding.message


def test_the_same_global_batch_on_another_world_size_is_an_exact_resume() -> None:
    """12 samples a global batch: 4 on each of 3 ranks, then 6 on each of 2."""
    assert resumed([record(s, 3, 4.0) for s in range(1, 21)],
                   [record(s, 2, 6.0) for s in range(13, 30)], 12, 12) == []


def test_growing_says_the_samples_it_never_trains_on() -> None:
    [finding] = resumed([record(s, 2) for s in range(1, 21)],
                        [record(s, 3) for s in range(11, 30)], 10, 10)
    assert "starts at sample 120, not 80, and never trains on 40 samples" in finding.message


def test_what_cannot_be_told_says_nothing() -> None:
    """No samples reported, or not by every rank (a dropped report is no smaller batch), or a
    checkpoint older than every step remembered: no check, no finding."""
    memory = GlobalBatch()
    for s in range(1, 21):
        memory.observe(record(s, 3, per_rank=None))
    assert ResumeData.start(memory, 12, 12) is None
    memory = GlobalBatch()
    for s in range(1, 21):
        assert memory.observe(record(s, 3, reported=2)) is None
    assert ResumeData.start(memory, 12, 12) is None
    memory = GlobalBatch(memory=5)
    for s in range(1, 21):
        memory.observe(record(s, 3))
    assert ResumeData.start(memory, 12, 12) is None  # steps 16..20 remembered
    assert ResumeData.start(memory, None, None) is None  # a fresh start


def test_gradient_accumulation_counts_per_global_batch() -> None:
    """Two global batches a step (the cursor moves by 2): 24 samples a step is still 12 a
    batch, the same as one batch of 12 a step after the resume."""
    assert resumed([record(s, 3, 8.0, cursor=2 * s) for s in range(1, 21)],
                   [record(s, 3, 4.0, cursor=24 + s - 12) for s in range(13, 30)], 12, 24) == []


def test_the_watch_checks_a_resized_resume_once_and_a_rollback_on_the_same_size_never() -> None:
    watch = Watch(load_policy("default"))
    watch.new_attempt(0.0, Directive(attempt=0))
    for s in range(1, 21):
        assert watch.observe_record(record(s, 3)) == []
    watch.new_attempt(1.0, Directive(attempt=1, resume=Resume("ckpt", 10, 10)))
    for s in range(11, 21):  # the same size again (a rollback): exact
        assert [f for f in watch.observe_record(record(s, 3))
                if f.detector == "resume_data"] == []
    watch.new_attempt(2.0, Directive(attempt=2, resume=Resume("ckpt", 15, 15)))
    found = [f for s in range(16, 40) for f in watch.observe_record(record(s, 2))
             if f.detector == "resume_data"]
    assert [f.step for f in found] == [19]
    remedy = watch.judge(found[0], 3.0, None)
    assert remedy.action.value == "alert"  # a warning, under the resume ladder's act_on


def test_a_supervisor_that_takes_over_still_checks_the_next_resume() -> None:
    """The global batches are in the watch's journaled state, in runs of steps alike (a few
    entries, not one per step): a new leader, or a restarted babysit, reads them back and
    checks the next resize as the one that saw the steps would have."""
    import json

    watch = Watch(load_policy("default"))
    watch.new_attempt(0.0, Directive(attempt=0))
    for s in range(1, 21):
        watch.observe_record(record(s, 3))
    state = json.loads(json.dumps(watch.state_dict()))
    assert state["global_batch"] == [[2, 20, 12.0, 3]]  # the first step tells no batch
    heir = Watch(load_policy("default"))
    heir.load_state_dict(state)
    heir.new_attempt(1.0, Directive(attempt=1, resume=Resume("ckpt", 15, 15)))
    found = [f for s in range(16, 40) for f in heir.observe_record(record(s, 2))
             if f.detector == "resume_data"]
    assert [f.evidence["batch_before"] for f in found] == [12.0]
    # A resize mid-memory is two runs, and reads back exactly.
    memory = GlobalBatch()
    for r in [record(s, 3) for s in range(1, 6)] + [record(s, 2) for s in range(6, 10)]:
        memory.observe(r)
    again = GlobalBatch()
    again.load_state_dict(memory.state_dict())
    assert memory.state_dict() == [[2, 5, 12.0, 3], [6, 9, 8.0, 2]]
    assert again.before(5) == memory.before(5) == (12.0, 3)
    assert again.before(9) == (8.0, 2)
