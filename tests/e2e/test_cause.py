"""Whose fault is it, with real torchrun and gloo.

A fault that follows the data: one rank's loader meets the same global batch in every attempt (a
file it deadlocks on, a sample its decoder crashes on). The first time is a hang or a crash like
any other and is relaunched; the second time, at the same batch on the same rank, it is the
data's: babysit rolls back, skips that batch, and the run finishes where a person's fix (the
data set without that batch) finishes: the same final evaluation, to the last digits, on CPU.

A spike that is the machine's: one weight blown up on one rank, on the first attempt only. The
rerun of the same steps does not meet it: nothing is skipped, the LR is left alone, and the run
finishes exactly where a run without the glitch does."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import FAST_POLICY, babysat, journal, kept_indices, read_jsonl, run_babysit

pytestmark = pytest.mark.e2e

STEPS = ("--steps", "30", "--eval-every", "10")
NO_STANDBY = "  warm_standby: false\n"
"""For the reference runs, which never relaunch: no standby's start-up beside their training."""


def last_eval(run_dir: Path) -> float:
    """The held-out loss rank 0 reported last (at step 30)."""
    (last,) = [e["data"] for e in journal(run_dir, "worker_scalars")
               if e["rank"] == 0 and e["data"]["step"] == 30]
    return float(last["values"]["eval_loss"])


@pytest.fixture(scope="module")
def fixed(tmp_path_factory: pytest.TempPathFactory) -> float:
    """The final evaluation of a clean run on the data set without global batch 13."""
    tmp = tmp_path_factory.mktemp("fixed")
    result, run_dir = babysat(tmp, "fixed", *STEPS, "--drop-batch", "13", launch_extra=NO_STANDBY)
    assert result.returncode == 0, result.stdout + result.stderr
    return last_eval(run_dir)


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> float:
    """The final evaluation of a run without any fault."""
    tmp = tmp_path_factory.mktemp("clean")
    result, run_dir = babysat(tmp, "clean", *STEPS, launch_extra=NO_STANDBY)
    assert result.returncode == 0, result.stdout + result.stderr
    return last_eval(run_dir)


def test_a_spike_the_rerun_does_not_meet_is_transient_and_costs_no_data(
        tmp_path: Path, clean: float) -> None:
    result, run_dir = babysat(tmp_path, "glitch", *STEPS, "--glitch", "1:16")
    assert result.returncode == 0, result.stdout + result.stderr

    (spike,) = [e for e in journal(run_dir, "finding")
                if e["finding"]["incident"] == "loss_spike"]
    assert spike["remedy"]["action"] == "rollback" and spike["finding"]["onset_step"] == 17
    # From the newest good checkpoint a spike's rollback may use (5 or 10: as promoted by then).
    (resume,) = [e for e in journal(run_dir, "resume") if e.get("from")]
    assert resume["checkpoint_step"] in (5, 10)
    assert f"rerun steps from step {resume['checkpoint_step'] + 1} to 17 first" \
        in spike["remedy"]["reason"]
    (verdict,) = journal(run_dir, "rerun")
    assert verdict["verdict"] == "transient" and verdict["moved_first"] == [1]
    assert "not reproduced on the rerun" in verdict["summary"]
    assert "not reproduced on the rerun" in result.stdout
    # The rerun is the continuation: one relaunch, nothing skipped, the LR never touched.
    _, rerun = journal(run_dir, "launch")
    assert rerun["directive"]["skip"] == [] and rerun["directive"]["lr_scale"] == 1.0
    assert journal(run_dir, "lr_scale") == [] and journal(run_dir, "worker_skip") == []
    (finished,) = journal(run_dir, "run_finished")
    assert finished["state"] == "succeeded" and finished["step"] == 30
    assert last_eval(run_dir) == clean  # bit-exact: the rerun replayed the clean run
    status = run_babysit("status", str(run_dir), cwd=tmp_path, timeout=60)
    assert "not reproduced on the rerun" in status.stdout and "rank 1 moved first" in status.stdout


# A loader's segfault (--bad-batch) takes the same path as its Python exception, once classified
# (tests/policies/test_cause.py); the exception is what a corrupt file usually raises.
@pytest.mark.parametrize("fault, incident", [("--stuck-batch", "hang"),
                                             ("--raise-batch", "crash")])
def test_a_fault_at_the_same_batch_twice_is_the_datas_and_that_batch_is_skipped(
        tmp_path: Path, fixed: float, fault: str, incident: str) -> None:
    # Checkpoints every 25 steps; rank 1's loader meets batch 13 (drawn for step 14). Each time,
    # the live ranks keep the state of step 13 (just-in-time), so the relaunch resumes right
    # before that batch and meets it again before its first step. A hang there is allowed what
    # this run's first steps took (at least first_step_floor_s), not the fast policy's
    # startup_s (60 s).
    policy = (f"{{name: {FAST_POLICY}, overrides: "
              "{detectors: {hang: {first_step_floor_s: 8.0}}}}")
    result, run_dir = babysat(tmp_path, incident, *STEPS, fault, "1:13", policy=policy,
                              checkpoints="{every_steps: 25, probation_steps: 5, "
                                          "async_save: false}")
    assert result.returncode == 0, result.stdout + result.stderr

    findings = [e for e in journal(run_dir, "finding") if e["finding"]["incident"] == incident]
    assert [e["remedy"]["action"] for e in findings] == ["relaunch", "rollback"]
    if incident == "hang":
        stalled = findings[1]["finding"]["evidence"]["stalled"]
        assert {v["waiting_in"] for v in stalled.values()} == {"first step"}
        assert all(v["allowance_s"] < 60.0 for v in stalled.values())
    else:  # raised by the loader: relaunched once (never, as user code), then placed
        first = findings[0]["finding"]
        assert first["evidence"]["class"] == "data" and first["ranks"] == [1]
        assert "ValueError: corrupt sample in global batch 13" in first["message"]
        assert "data crash 1/1: relaunch at once" in findings[0]["remedy"]["reason"]
    data = findings[1]["remedy"]["reason"]
    assert f"same {incident} at global batch 13 on rank 1" in data
    assert "the data's: rolled back and batch 13 skipped, the LR unchanged" in data
    # Both relaunches resumed from the state of step 13 the live ranks kept (the second fault
    # had no step of its own to keep), not from step 0: nothing else was replayed.
    kept = [(e["outcome"], e["checkpoint_step"])
            for e in journal(run_dir, "just_in_time")]
    assert kept == [("saved", 13), ("nothing", 13)], kept
    resumed = [e["checkpoint_step"] for e in journal(run_dir, "resume") if e.get("from")]
    assert resumed == [13, 13]
    # The third attempt skips exactly batch 13, at the LR the run had, and its first step is 14.
    launch = journal(run_dir, "launch")[2]["directive"]
    assert launch["skip"] == [{"start": 13, "end": 14}] and launch["lr_scale"] == 1.0
    assert journal(run_dir, "lr_scale") == []
    assert min(m["step"] for m in read_jsonl(run_dir / "metrics.jsonl") if m["attempt"] == 2) \
        == 14
    # Every resume was checked at its first forward, and took.
    checks = journal(run_dir, "resume_check")
    assert checks and all(e["data"]["took"] for e in checks)
    skipped = [e["data"] for e in journal(run_dir, "worker_skip")]
    assert skipped and all((s["start"], s["end"]) == (13, 14) for s in skipped)
    (finished,) = journal(run_dir, "run_finished")
    assert finished["state"] == "succeeded" and finished["step"] == 30
    # Resumed bit-exact from the kept state, batch 13 left out: what a person's fix trains.
    assert last_eval(run_dir) == pytest.approx(fixed, rel=1e-6)


def test_a_corrupt_sample_is_skipped_by_its_place_in_the_data_stream(tmp_path: Path) -> None:
    """The textbook case with babysit's ElasticSampler: one sample of the data set is corrupt
    and its reader raises, on whichever rank draws it. The second time at the same batch it
    is the data's: the skip is given to the next attempt in samples (the global batch's place
    in the stream, which the ranks reported), so it would hold at any world size; here the
    ranks skip exactly those 8 samples and train every other one once, in stream order."""
    from babysit import ElasticSampler

    n, indices = 1000, tmp_path / "indices"
    stream = iter(ElasticSampler(n, 1, rank=0, world_size=1, seed=0))
    order = [next(stream)[0] for _ in range(8 * 31)]
    corrupt = order[85]  # global batch 10 (2 ranks of 4): stream positions 80-87, rank 1's
    result, run_dir = babysat(tmp_path, "sample", *STEPS, "--elastic-data", str(n),
                              "--index-log", str(indices), "--raise-sample", str(corrupt))
    assert result.returncode == 0, result.stdout + result.stderr

    crashes = [e for e in journal(run_dir, "finding") if e["finding"]["incident"] == "crash"]
    assert [e["remedy"]["action"] for e in crashes] == ["relaunch", "rollback"]
    assert f"ValueError: corrupt sample {corrupt}" in crashes[0]["finding"]["message"]
    assert "same crash at global batch 10 on rank 1" in crashes[1]["remedy"]["reason"]
    # Each attempt said where its stream was; the third skips batch 10 as samples 80-87.
    streams = [e["data"] for e in journal(run_dir, "worker_stream")]
    assert [s["global_batch"] for s in streams] == [8, 8, 8]
    launch = journal(run_dir, "launch")[2]["directive"]
    assert launch["skip"] == [{"start": 10, "end": 11, "samples": [80, 88]}]
    skipped = [e["data"] for e in journal(run_dir, "worker_skip")]
    assert skipped and all(s["samples"] == [80, 88] for s in skipped)
    # What the run kept (each attempt's steps up to where the next resumed): the stream in
    # order, the corrupt sample's global batch left out, nothing else.
    kept, _ = kept_indices(journal(run_dir, "launch"), indices, 30)
    assert kept == order[:80] + order[88:8 * 31]
    (finished,) = journal(run_dir, "run_finished")
    assert finished["state"] == "succeeded" and finished["step"] == 30
    status = run_babysit("status", str(run_dir), cwd=tmp_path, timeout=60)
    assert "skip batches 10-10 (samples 80-87)" in status.stdout, status.stdout
    report = run_babysit("report", str(run_dir), cwd=tmp_path, timeout=120)
    assert report.returncode == 0, report.stderr


def test_a_resume_that_did_not_take_is_tried_once_older_then_stopped(tmp_path: Path) -> None:
    # Rank 1 is killed at step 22; every resume re-initialises the model after attach().
    result, run_dir = babysat(tmp_path, "overwrite", *STEPS, "--at", "0:1:22:SIGKILL",
                              "--reinit-after-attach")
    assert result.returncode == 1, result.stdout + result.stderr

    findings = [e for e in journal(run_dir, "finding") if e["finding"]["incident"] == "resume"]
    assert [e["remedy"]["action"] for e in findings] == ["rollback", "stop"]
    assert "the restore did not take" in findings[0]["finding"]["message"]
    assert "no batches skipped, LR kept" in findings[0]["remedy"]["reason"]
    # From the state the live rank kept of step 21 (just-in-time, pending), then once from the
    # next older good checkpoint (never a just-in-time one).
    resumed = [e["checkpoint_step"] for e in journal(run_dir, "resume") if e.get("from")]
    assert resumed[0] == 21 and resumed[1] <= 20 and len(resumed) == 2
    assert [f["finding"]["step"] for f in findings] == resumed
    failed = [e for e in journal(run_dir, "resume_check") if not e["data"]["took"]]
    assert failed and failed[0]["data"]["restored"] != failed[0]["data"]["seen"]
    (finished,) = journal(run_dir, "run_finished")
    assert finished["state"] == "failed"
    assert "the restore did not take" in result.stdout
