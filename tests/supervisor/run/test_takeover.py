"""A takeover and a preemption (``supervisor.run.takeover``, ``supervisor.run.preemption``):
checkpoints written while no supervisor watched, a job that finished meanwhile, and what a missing
final checkpoint leaves the next run. For real: ``tests/e2e/test_takeover.py``."""

from __future__ import annotations

import json
from pathlib import Path

from babysit.checkpoints import Catalog
from babysit.supervisor.run import preemption, takeover
from tests.checkpoints.test_catalog import make_ckpt


def test_unwatched_checkpoints_stay_pending_until_their_probation_is_observed(
        tmp_path: Path) -> None:
    from babysit.supervisor.run.recovery import Recovery

    catalog = Catalog(tmp_path)
    for step in (10, 15, 20, 25):
        make_ckpt(tmp_path, step, size=100)
    recovery = Recovery(catalog, probation_steps=5, keep=10)
    # The previous supervisor saw up to step 12; the workers went on to 25 alone.
    resume, entries = recovery.resume_latest(watched_until=12)
    assert resume is not None and resume.step == 25
    pending = [e[1]["checkpoint_step"] for e in entries if e[0] == "checkpoint_verdict"]
    assert pending == [10, 15, 20]
    recovery.on_progress(40)
    verdicts = {c.step: c.verdict.value for c in catalog.checkpoints()}
    # 25's probation (26-30) was observed after the resume; 10's ran past 12 unwatched.
    assert verdicts == {10: "pending", 15: "pending", 20: "pending", 25: "good"}


def test_a_job_that_finished_unwatched_is_recognised(tmp_path: Path) -> None:
    closed = tmp_path / "closed"
    closed.mkdir()
    (closed / "0.json").write_text(json.dumps({"rank": 0, "world_size": 2, "step": 40}))
    assert takeover.finished_unwatched(tmp_path) is None  # rank 1 did not close
    (closed / "1.json").write_text(json.dumps({"rank": 1, "world_size": 2, "step": 40}))
    assert takeover.finished_unwatched(tmp_path) == 40


def test_a_missing_final_checkpoint_names_what_the_next_run_resumes_from(
        tmp_path: Path) -> None:
    catalog = Catalog(tmp_path)
    assert "from scratch" in preemption.fallback(catalog).describe()
    make_ckpt(tmp_path, 1000, size=100)
    fallback = preemption.fallback(catalog)
    assert fallback.step == 1000
    message = preemption.missing_message("none arrived within 30 s", fallback)
    assert "no final checkpoint" in message and "step 1000" in message


def test_a_takeover_gives_an_inherited_skip_in_the_samples_of_the_attempt_it_watched(
        tmp_path: Path) -> None:
    """The supervisor died after the attempt's rank 0 said where its ElasticSampler's stream
    was: the next supervisor's skip of that attempt's batches goes out in samples too."""
    from babysit.policies.loader import load_policy
    from babysit.supervisor.contract.directive import SkipRange
    from babysit.supervisor.run.journal import prior_run
    from babysit.supervisor.run.watch import Watch

    prior = prior_run([
        {"event": "run_started", "attempt": 0},
        {"event": "launch", "attempt": 0, "pid": 0, "directive": {"skip": [
            {"start": 2, "end": 3, "samples": [16, 24]}]}},
        {"event": "worker_stream", "attempt": 0, "rank": 0,
         "data": {"cursor": 4, "samples": 24, "global_batch": 8}},
    ])
    assert prior is not None
    watch = Watch(load_policy("default"))
    takeover.take_over(prior, tmp_path, 1.0, watch)
    assert watch.skips == [SkipRange(2, 3, (16, 24))]  # the orders it ran with, in samples
    assert watch.in_samples(SkipRange(10, 12)) == SkipRange(10, 12, (72, 88))
    assert watch.in_samples(SkipRange(3, 5)) == SkipRange(3, 5, (16, 32))  # before its report
