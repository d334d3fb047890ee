"""An incident told to a person: the finding, the remedy as applied, recovery, the run's end.
Pure: facts in, alerts out, clocks passed in."""

from __future__ import annotations

from babysit.policies.types import Action, Finding, Incident, Remedy, Severity
from babysit.supervisor.contract.directive import Directive, LrRamp, Resume, SkipRange
from babysit.supervisor.services.alerts import slack_payload, webhook_payload
from babysit.supervisor.services.alerts.story import IncidentStory

SPIKE = Finding(Incident.LOSS_SPIKE, "loss_spike", Severity.CRITICAL, step=34, onset_step=31,
                message="loss 9.12 at step 34 broke out to 4x its baseline 2.31",
                evidence={"loss": 9.12, "baseline": 2.31})
ROLLBACK = Remedy(Action.ROLLBACK, SPIKE, "loss_spike intervention 1 -> ladder rung 1/3: "
                  "rollback", skip_before=2, skip_after=8, lr_scale=0.5)
HANG = Finding(Incident.HANG, "hang", Severity.CRITICAL, step=14, onset_step=14,
               message="hang at step 14: rank 1 is stuck", ranks=(1,),
               evidence={"host": "gpu-7", "node": 2})


def directive(attempt: int, resume: int | None, skip: tuple[SkipRange, ...] = (),
              lr: float = 1.0) -> Directive:
    at = Resume(f"/ckpt/{resume}", resume, resume) if resume is not None else None
    return Directive(attempt=attempt, resume=at, skip=skip, lr_scale=lr)


def test_a_rollback_is_told_as_finding_applied_remedy_and_recovery() -> None:
    story = IncidentStory("gpt", host="node-a")
    assert story.launched(directive(0, None), now=100.0) is None  # the first attempt: no news
    assert story.step(33, now=150.0) is None
    found = story.incident(ROLLBACK, attempt=0, incident_dir="/r/incidents/0001-loss_spike-step34",
                           now=151.0)
    assert found.kind == "incident" and found.incident_id == "0001-loss_spike-step34"
    assert found.title.startswith("[gpt #0001-loss_spike-step34] loss 9.12 at step 34")
    assert "rolling back" in (found.action or "") and "LR x0.5" in (found.action or "")
    assert found.host == "node-a" and found.needs is None and found.evidence["loss"] == 9.12

    applied = story.launched(directive(1, 30, (SkipRange(29, 42),), lr=0.5), now=160.0)
    assert applied is not None and applied.kind == "remedy"
    assert applied.remedy is not None
    assert applied.remedy["resume_step"] == 30 and applied.remedy["lr_scale"] == 0.5
    assert applied.remedy["skipped_batches"] == [[29, 41]]
    assert "resumed from step 30" in applied.title and "skipped batches 29-41" in applied.title
    assert "LR x0.5 of the schedule (was x1)" in (applied.action or "")

    assert story.step(34, now=170.0) is None  # not past the trouble yet
    recovered = story.step(35, now=171.0)
    assert recovered is not None and recovered.kind == "recovered"
    assert recovered.evidence["time_lost_s"] == 21.0  # from the last good step (150) to now
    assert recovered.evidence["first_healthy_step"] == 35
    assert story.step(36, now=172.0) is None  # once
    # Every message of the incident carries its id and prefix, and is news once (dedup key).
    msgs = (found, applied, recovered)
    assert {m.incident_id for m in msgs} == {"0001-loss_spike-step34"}
    assert len({m.key for m in msgs}) == 3

    done = story.finished(state="succeeded", exit_code=0, reason="workers finished", attempt=1,
                          step=60, now=200.0)
    assert done.kind == "finished" and done.severity is Severity.INFO
    assert "run finished" in done.title and "1 incident(s)" in done.title
    assert done.evidence["time_lost_s"] == 21.0 and done.evidence["elapsed_s"] == 100.0
    assert "goodput" not in done.evidence  # no ledger yet: never a made-up figure


def test_a_hang_on_another_node_names_rank_node_and_host() -> None:
    story = IncidentStory("gpt", host="leader-host")
    remedy = Remedy(Action.RELAUNCH, HANG, "hang intervention 1 -> ladder rung 1/3: relaunch")
    alert = story.incident(remedy, attempt=0, incident_dir=None, now=10.0)
    assert alert.host == "gpu-7" and alert.node == "2" and alert.ranks == (1,)
    assert "rank 1 on host gpu-7 (node 2)" in (alert.action or "")
    assert alert.incident_id == "0001"  # no folder: numbered
    applied = story.launched(directive(1, 10), now=12.0)
    assert applied is not None and "resumed from step 10" in applied.title
    assert applied.remedy is not None and applied.remedy["skipped_batches"] == []


def test_a_stop_or_a_run_ending_crash_says_a_person_is_needed() -> None:
    story = IncidentStory("gpt", host="h")
    crash = Finding(Incident.CRASH, "crash", Severity.CRITICAL, step=5, onset_step=5,
                    message="oom crash", ranks=(0,))
    alert = story.incident(Remedy(Action.ALERT, crash, "no rung left"), attempt=3,
                           incident_dir=None, now=1.0, ends_run=True)
    assert alert.severity is Severity.CRITICAL and "stopping the run" in (alert.action or "")
    assert alert.needs is not None and "A person" in alert.needs
    assert story.launched(directive(4, 0), now=2.0) is None  # nothing is under way
    failed = story.finished(state="failed", exit_code=1, reason="no rung left", attempt=3,
                            step=5, now=3.0, goodput=0.5)
    assert failed.kind == "failed" and failed.severity is Severity.CRITICAL
    assert failed.needs and failed.evidence["goodput"] == 0.5 and "goodput 50.0%" in failed.title
    stopped = story.finished(state="stopped", exit_code=130, reason="signal 2", attempt=3,
                             step=5, now=4.0)
    assert stopped.kind == "stopped" and stopped.severity is Severity.WARNING
    assert stopped.needs and "resumes" in stopped.needs and "run stopped" in stopped.title


def test_an_alert_only_remedy_is_one_warning_without_an_incident() -> None:
    story = IncidentStory("gpt", host="h")
    slow = Finding(Incident.STRAGGLER, "straggler", Severity.WARNING, step=9, onset_step=9,
                   message="straggler at step 9: rank 1", ranks=(1,))
    alert = story.incident(Remedy(Action.ALERT, slow, "alert only"), attempt=0,
                           incident_dir=None, now=1.0)
    assert alert.kind == "warning" and alert.incident_id is None and story.incidents == 0
    assert alert.key == "straggler:straggler:1"  # repeats de-duplicate


def test_payloads_show_the_applied_remedy() -> None:
    story = IncidentStory("gpt", host="node-a")
    story.launched(directive(0, None), now=0.0)
    story.incident(ROLLBACK, attempt=0, incident_dir=None, now=1.0)
    applied = story.launched(directive(1, 30, (SkipRange(29, 42),), lr=0.5), now=2.0)
    assert applied is not None
    body = webhook_payload(applied)
    assert body["version"] == 1 and body["kind"] == "remedy" and body["incident_id"] == "0001"
    assert body["remedy"]["resume_step"] == 30 and body["remedy"]["lr_rewarm_steps"] is None
    slack = slack_payload(applied)
    sections = [b for b in slack["blocks"] if b["type"] == "section" and "fields" in b]
    assert all(len(b["fields"]) <= 10 for b in sections)  # Block Kit refuses more
    shown = {f["text"].split("\n")[0].strip("*"): f["text"].split("\n")[1]
             for b in sections for f in b["fields"]}
    assert shown["Resumed from step"] == "30" and shown["Skipped batches"] == "29-41"
    assert shown["LR scale"] == "x0.5" and shown["Host"] == "node-a"
    assert shown["Rank(s)"] == "all"


def test_a_rollback_whose_lr_cut_wears_off_says_over_which_batches() -> None:
    story = IncidentStory("gpt", host="h")
    story.launched(directive(0, None), now=0.0)
    remedy = Remedy(Action.ROLLBACK, SPIKE, "rung 1", skip_before=2, skip_after=8,
                    lr_scale=0.5, lr_rewarm=50)
    found = story.incident(remedy, attempt=0, incident_dir=None, now=1.0)
    assert "LR x0.5, re-warming over 50 batches past the skipped ones" in (found.action or "")
    ramp = LrRamp(cut=29, start=42, end=92, to=1.0)
    applied = story.launched(Directive(attempt=1, resume=Resume("/c", 30, 30),
                                       skip=(SkipRange(29, 42),), lr_scale=0.5, lr_ramp=ramp),
                             now=2.0)
    assert applied is not None and applied.remedy is not None
    assert "LR x0.5 from batch 29, back to x1 over batches 42-91" in (applied.action or "")
    assert applied.remedy["lr_rewarm_steps"] == 50
    assert applied.remedy["lr_ramp"] == {"cut": 29, "start": 42, "end": 92, "to": 1.0}
