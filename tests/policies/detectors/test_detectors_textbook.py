"""The textbook incident: 8 ranks, rank 5 slows to 2.7x at step 7, the loss jumps at step 9.

Only eight steps of history exist when the loss jumps: the spike must still be flagged at the
step it happens, and the straggler must be named at the step it starts.
"""

from __future__ import annotations

import random

from babysit.policies.detectors import LossSpikeDetector, StragglerDetector
from babysit.policies.loader import load_policy
from babysit.policies.pipeline import Pipeline
from babysit.policies.types import Incident, RankStep, Severity, StepRecord

WORLD = 8


def textbook(steps: int = 14, spike_at: int = 9, slow_from: int = 7) -> list[StepRecord]:
    rng = random.Random(7)
    records = []
    for step in range(1, steps + 1):
        # A smooth, steadily falling curve: 1 % per step, no noise at all.
        loss = 6.0 * 0.99**step * (1.6 if step == spike_at else 1.0)
        ranks = []
        for rank in range(WORLD):
            t = 0.50 + rng.uniform(-0.01, 0.01)
            if rank == 5 and step >= slow_from:
                t *= 2.7
            ranks.append(RankStep(rank=rank, step=step, time=100.0 + step, loss=loss,
                                  grad_norm=1.0, step_time=t, data_wait=0.002))
        records.append(StepRecord(step=step, time=100.0 + step, ranks=tuple(ranks),
                                  world_size=WORLD))
    return records


def test_straggler_named_from_the_step_it_slows_once_it_lasts() -> None:
    det = StragglerDetector()
    fired = [(r.step, f) for r in textbook() if (f := det.observe(r)) is not None]
    assert len(fired) == 1, "one finding per straggling episode, not one per step"
    step, finding = fired[0]
    # Slow from step 7 at 2.7x: reported on its second slow step (one step is a blip), with
    # the onset where it began.
    assert step == 8 and finding.onset_step == 7
    assert finding.ranks == (5,)
    assert finding.incident is Incident.STRAGGLER
    assert finding.evidence["5"]["signal"] == "compute"
    assert 2.5 < finding.evidence["5"]["ratio"] < 2.9


def test_loss_jump_flagged_at_step_9_with_eight_points_of_history() -> None:
    det = LossSpikeDetector()
    fired = [(r.step, f) for r in textbook() if (f := det.observe(r)) is not None]
    assert fired, "the jump at step 9 was not flagged"
    step, finding = fired[0]
    assert step == 9 and finding.onset_step == 9
    assert finding.severity is Severity.WARNING
    assert finding.evidence["ratio"] > 1.5
    # It recovered at step 10: a one-step jump never becomes a rollback.
    assert all(f.severity is Severity.WARNING for _, f in fired)


def test_pipeline_alerts_on_both_and_rolls_back_nothing() -> None:
    pipe = Pipeline(load_policy("default"))
    decisions = [d for r in textbook() for d in pipe.observe(r)]
    got = {(d.step, d.detector, d.action) for d in decisions}
    assert got == {(8, "straggler", "alert"), (9, "loss_spike", "alert")}
