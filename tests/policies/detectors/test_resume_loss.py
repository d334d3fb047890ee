"""A resume that did not take, seen in the loss of its first steps (detectors/resume_loss.py)."""

from __future__ import annotations

import math
import random

from babysit.policies.detectors.resume_loss import ResumeLoss, ResumeLossConfig
from babysit.policies.types import Incident

CONFIG = ResumeLossConfig()


def curve(n: int = 200, start: float = 11.0, end: float = 2.2, noise: float = 0.03,
          seed: int = 0) -> dict[int, float]:
    """A pretraining-like curve: from ``start`` down to ``end``, with multiplicative noise."""
    rng = random.Random(seed)
    return {s: (end + (start - end) * math.exp(-s / 30)) * math.exp(rng.gauss(0, noise))
            for s in range(1, n + 1)}


def test_a_resume_back_near_the_initial_loss_did_not_take() -> None:
    """The Pythia-410m resumes: ~2.2 at the checkpoint, ~11 on the steps after it."""
    losses = curve()
    check = ResumeLoss.start(CONFIG, 150, losses)
    assert check is not None
    found = [f for s, y in enumerate([10.9, 10.7, 11.2, 10.8, 10.6], start=151)
             if (f := check.observe(s, y)) is not None]
    (finding,) = found
    assert finding.incident is Incident.RESUME and finding.step == 150
    assert finding.message.startswith("resume from step 150: loss 10.8 vs 2.304 recorded (4.69x")
    assert "the restore did not take" in finding.message
    assert finding.evidence["steps_seen"] == 5 and check.done
    assert check.observe(156, 11.0) is None  # one verdict per resume


def test_a_resume_that_took_says_nothing_on_healthy_curves() -> None:
    # The same curve resumed: the next steps of it, however noisy the curve.
    for noise in (0.003, 0.03, 0.3):
        for seed in range(20):
            losses = curve(noise=noise, seed=seed)
            check = ResumeLoss.start(CONFIG, 150, {s: y for s, y in losses.items() if s <= 150})
            assert check is not None
            assert all(check.observe(s, losses[s]) is None for s in range(151, 201)), (noise, seed)
    # A noisy curve (a tiny model's loss jumping 2x from step to step) is judged by its noise:
    # twice its level is no verdict there.
    rng = random.Random(1)
    noisy = {s: 8.0 * math.exp(rng.gauss(0, 0.7)) for s in range(1, 101)}
    check = ResumeLoss.start(CONFIG, 100, noisy)
    assert check is not None
    assert all(check.observe(s, 16.0) is None for s in range(101, 106))


def test_not_judged_without_a_record_or_with_nothing_finite() -> None:
    assert ResumeLoss.start(CONFIG, 150, {}) is None
    assert ResumeLoss.start(CONFIG, 150, {149: 2.0, 150: 2.1, 151: 2.0}) is None  # too few
    check = ResumeLoss.start(CONFIG, 150, curve())
    assert check is not None
    # Steps at or before the checkpoint's, and non-finite losses (the NaN detector's), count not.
    assert all(check.observe(s, 11.0) is None for s in (148, 149, 150))
    assert all(check.observe(151, y) is None for y in (math.nan, math.inf, None, -1.0))
    assert check.seen == []


def test_the_watch_checks_each_resume_once_against_what_it_recorded() -> None:
    from babysit.policies.loader import load_policy
    from babysit.policies.types import RankStep, StepRecord
    from babysit.supervisor.contract.directive import Resume
    from babysit.supervisor.run.watch import Watch

    def record(step: int, loss: float) -> StepRecord:
        return StepRecord(step, float(step), (RankStep(0, step, float(step), step, loss),), 1)

    watch = Watch(load_policy("default"))
    losses = curve()
    for s in range(1, 151):
        watch.observe_record(record(s, losses[s]))
    directive, _ = watch.launch(1, None, Resume(path="/ckpt/140", step=140, cursor=140))
    watch.new_attempt(0.0, directive)
    found = [f for s in range(141, 150) for f in watch.observe_record(record(s, 11.0))
             if f.incident is Incident.RESUME]
    assert [(f.detector, f.step) for f in found] == [("resume_loss", 140)]
    # A relaunch from scratch has nothing to compare.
    directive, _ = watch.launch(2, None, None)
    watch.new_attempt(0.0, directive)
    assert not [f for f in watch.observe_record(record(1, 11.0)) if f.incident is Incident.RESUME]
