"""Checkpoint verdicts when the run compares replicas: only agreeing checks vouch for weights.

The scenario a review found: checkpoints every 50 steps, probation 50, keep 3, SDC checks every
200. The check at 1000 agrees, the one at 1200 does not. Without the vouching rule the
checkpoints saved after the corruption were promoted and retention deleted every one from
before it, so the rollback restarted from scratch."""

from __future__ import annotations

from pathlib import Path

from babysit.checkpoints import Catalog, Verdict
from babysit.policies.types import Action, Finding, Incident, Remedy, Severity
from babysit.supervisor.run.recovery import Recovery
from tests.checkpoints.test_catalog import make_ckpt
from tests.journal_text import problems


def sdc_finding(step: int, last_agreeing: int) -> Finding:
    return Finding(Incident.SDC, "sdc", Severity.CRITICAL, step=step,
                   onset_step=last_agreeing + 1, message="rank 1 disagrees", ranks=(1,))


def run_until_disagreement(root: Path, sdc_checks: bool) -> Recovery:
    recovery = Recovery(Catalog(root), probation_steps=50, keep=3, sdc_checks=sdc_checks)
    for step in range(50, 1201, 50):
        make_ckpt(root, step, size=100)
        recovery.on_checkpoint(step)
        if step % 200 == 0 and step <= 1000:
            recovery.vouch(step)  # the checks up to 1000 agree
        for healthy in range(step, step + 50, 10):
            recovery.on_progress(healthy)
    return recovery


def test_sdc_rollback_finds_a_checkpoint_from_before_the_corruption(tmp_path: Path) -> None:
    recovery = run_until_disagreement(tmp_path, sdc_checks=True)
    finding = sdc_finding(1200, last_agreeing=1000)
    recovery.on_finding(finding, Remedy(Action.ROLLBACK, finding, "sdc"))
    resume, _ = recovery.resume_for(Remedy(Action.ROLLBACK, finding, "sdc"))
    assert resume is not None and resume.step == 1000
    verdicts = {c.step: c.verdict for c in Catalog(tmp_path).checkpoints()}
    assert all(v is Verdict.SUSPECT for s, v in verdicts.items() if s > 1000)
    # A later relaunch (or a takeover) may use pending checkpoints, never these suspect ones.
    latest, _ = recovery.resume_latest()
    assert latest is not None and latest.step == 1000


def test_without_vouching_the_same_run_would_lose_everything(tmp_path: Path) -> None:
    recovery = run_until_disagreement(tmp_path, sdc_checks=False)
    finding = sdc_finding(1200, last_agreeing=1000)
    recovery.on_finding(finding, Remedy(Action.ROLLBACK, finding, "sdc"))
    resume, entries = recovery.resume_for(Remedy(Action.ROLLBACK, finding, "sdc"))
    assert resume is None and entries[-1][1]["reason"].startswith("no usable checkpoint")


def test_a_spike_that_only_warns_leaves_its_checkpoints_good(tmp_path: Path) -> None:
    """A spike that heals by itself is a warning (an alert); the checkpoints around it stay good,
    so a later rollback for something else need not go further back than it must. The same
    onset acted on (a rollback) condemns them."""
    recovery = Recovery(Catalog(tmp_path), probation_steps=50, keep=10)
    for step in range(50, 401, 50):
        make_ckpt(tmp_path, step, size=100)
        recovery.on_checkpoint(step)
        for healthy in range(step, step + 50, 10):
            recovery.on_progress(healthy)
    spike = Finding(Incident.LOSS_SPIKE, "loss_spike", Severity.WARNING, step=330,
                    onset_step=320, message="loss 1.3x its baseline; healing")

    assert recovery.on_finding(spike, Remedy(Action.ALERT, spike, "warning: alert")) == []
    assert Catalog(tmp_path).get(300).verdict is Verdict.GOOD  # type: ignore[union-attr]

    entries = recovery.on_finding(spike, Remedy(Action.ROLLBACK, spike, "not healed"))
    assert [e[1]["checkpoint_step"] for e in entries] == [300, 350, 400]  # near and after it
    assert Catalog(tmp_path).get(300).verdict is Verdict.SUSPECT  # type: ignore[union-attr]


def test_the_data_remedy_after_a_rerun_resumes_from_the_reruns_own_save(tmp_path: Path) -> None:
    """A spike at step 160 (onset 155) rerun from the good checkpoint of step 100: the rerun
    saved at step 125 (cursor 250), where the data's rollback skips from (batch 260). The steps
    since 100 were trained on the batches the remedy trains on, so it resumes there, not from
    100 a third time: the suspect verdict the onset gave it becomes pending. A save past the
    skip's start, or none in the rerun, leaves the rule as it was."""
    recovery = Recovery(Catalog(tmp_path), probation_steps=50, keep=10)
    make_ckpt(tmp_path, 100, size=100)
    recovery.on_progress(150)  # 100 is good
    make_ckpt(tmp_path, 125, size=100)
    make_ckpt(tmp_path, 150, size=100)
    spike = Finding(Incident.LOSS_SPIKE, "loss_spike", Severity.CRITICAL, step=160,
                    onset_step=155, message="reproduced on the rerun",
                    evidence={"rerun": "reproduced"})
    remedy = Remedy(Action.ROLLBACK, spike, "the data's")
    recovery.on_finding(spike, remedy)
    assert Catalog(tmp_path).get(125).verdict is Verdict.SUSPECT  # type: ignore[union-attr]

    before, _ = recovery.resume_for(remedy, (100, 240))  # 125 consumed batch 249: past it
    assert before is not None and before.step == 100
    resume, entries = recovery.resume_for(remedy, (100, 260))
    assert resume is not None and (resume.step, resume.cursor) == (125, 250)
    verdict, chosen = entries[-2:]
    assert verdict == ("checkpoint_verdict", {"checkpoint_step": 125, "verdict": "pending",
                                              "replayed": chosen[1]["replayed"]})
    assert chosen[0] == "resume" and chosen[1]["verdict"] == "pending"
    assert chosen[1]["replayed"].startswith("replayed by the rerun of steps 101-160")
    assert Catalog(tmp_path).get(125).verdict is Verdict.PENDING  # type: ignore[union-attr]
    assert Catalog(tmp_path).get(150).verdict is Verdict.SUSPECT  # type: ignore[union-attr]


def test_a_relaunch_takes_a_checkpoint_saved_where_the_ranks_were_past_the_finding(
        tmp_path: Path) -> None:
    """A hang's finding is dated with the newest merged step, which can lag behind the step the
    ranks reached and saved at (a lost node's last summary never comes): the relaunch takes
    that newest checkpoint rather than training its steps and saving it a second time; and a
    just-in-time one the fault's ranks kept, whatever its step."""
    recovery = Recovery(Catalog(tmp_path), probation_steps=5, keep=10)
    for step in (10, 20, 30):
        make_ckpt(tmp_path, step, size=100)
    hang = Finding(Incident.HANG, "hang", Severity.CRITICAL, step=25, onset_step=25,
                   message="rank 1 hung")
    remedy = Remedy(Action.RELAUNCH, hang, "relaunch")
    assert recovery.resume_for(remedy)[0].step == 20  # type: ignore[union-attr]
    assert recovery.resume_for(remedy, newest=30)[0].step == 30  # type: ignore[union-attr]
    make_ckpt(tmp_path, 33, size=100)
    recovery.hear({"event": "just_in_time", "outcome": "saved", "checkpoint_step": 33})
    assert recovery.resume_for(remedy, newest=32)[0].step == 33  # type: ignore[union-attr]
    # A spike's rollback is bounded by its onset, whatever the ranks reached.
    spike = Finding(Incident.LOSS_SPIKE, "loss_spike", Severity.CRITICAL, step=31,
                    onset_step=25, message="spike")
    assert recovery.resume_for(Remedy(Action.ROLLBACK, spike, "x"), newest=31)[0] is None


def _just_in_time(root: Path, step: int, streams_lost: tuple[int, ...]) -> None:
    """A just-in-time checkpoint of ``step`` as the live ranks commit it: rank 0 wrote the
    state, rank 1 its mark; ``streams_lost``' random streams died with their node."""
    from babysit.checkpoints import just_in_time
    from babysit.checkpoints.manifest import hash_file

    plan = just_in_time.Plan(step, step, None, 1.0, writers=(0,), marks=(1,),
                             streams_lost=streams_lost)
    staged = just_in_time.staging_dir(root, step)
    staged.mkdir(parents=True)
    for name, data in (("__0_0.distcp", b"weights"), ("__0.metadata", b"meta"),
                       ("rank_00000.pt", b"rank 0"), (just_in_time.mark_name(1), b"mark")):
        (staged / name).write_bytes(data)
    files = [hash_file(staged, n) for n in ("__0_0.distcp", "__0.metadata", "rank_00000.pt")]
    just_in_time.commit(root, plan, files, world_size=4, fault="preemption")


def test_a_takeover_resuming_from_just_in_time_state_says_what_it_lost_in_words(
        tmp_path: Path) -> None:
    """A supervisor taking over binds its choice by no step: the ``resume`` entry says so with
    a null ``before_step``, not a huge number, counts the steps the state lost up to the
    newest step the dead supervisor saw, and names the ranks that lost their random streams
    in words."""
    make_ckpt(tmp_path, 20, size=100)
    _just_in_time(tmp_path, 39, streams_lost=(2, 3))
    resume, entries = Recovery(Catalog(tmp_path), probation_steps=5,
                               keep=10).resume_latest(watched_until=39)
    assert resume is not None and resume.step == 39
    [said] = [fields for event, fields in entries if event == "resume"]
    assert said["before_step"] is None and said["checkpoint_step"] == 39
    assert said["just_in_time"]["lost_steps"] == 1 and said["just_in_time"]["periodic_step"] == 20
    assert said["summary"] == (
        "resumed from the just-in-time state of step 39, written by rank 0 after the "
        "preemption (1 step lost; the newest checkpoint was of step 20); ranks 2 and 3 resume "
        "with fresh random streams")
    assert problems([{"event": event, **fields} for event, fields in entries]) == []
    # Not knowing how far the run got, it says nothing of the steps lost.
    _, entries = Recovery(Catalog(tmp_path), probation_steps=5, keep=10).resume_latest()
    [said] = [fields for event, fields in entries if event == "resume"]
    assert said["just_in_time"]["lost_steps"] is None
    assert "(the newest checkpoint was of step 20); ranks 2 and 3" in said["summary"]
