"""What a failed run tells its scheduler (``run.exit_codes``): requeue for a cause outside
the job, stop for the job's own and for a requeue that made no progress. Pure."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from babysit.policies.types import Action, Finding, Incident, Remedy, Severity
from babysit.supervisor.run import exit_codes, run_dir
from babysit.supervisor.run.exit_codes import REQUEUE, STOP


def failed(incident: Incident, **evidence: Any) -> Remedy:
    finding = Finding(incident=incident, detector="t", severity=Severity.CRITICAL, step=40,
                      onset_step=40, message="m", evidence=evidence)
    return Remedy(Action.STOP, finding, "the ladder's last rung")


@pytest.mark.parametrize(("remedy", "code"), [
    (failed(Incident.NODE_LOST, host="gpu-3"), REQUEUE),
    (failed(Incident.SDC, host="gpu-5"), REQUEUE),
    (failed(Incident.HANG), REQUEUE),
    (failed(Incident.CRASH, **{"class": "hardware"}), REQUEUE),
    (failed(Incident.CRASH, **{"class": "network"}), REQUEUE),
    (failed(Incident.CRASH, **{"class": "user_code"}), STOP),
    (failed(Incident.CRASH, **{"class": "hardware", "deterministic": True}), STOP),
    (failed(Incident.HANG, follows="code"), STOP),
    (failed(Incident.HANG, follows="data"), STOP),
    (failed(Incident.LOSS_SPIKE), STOP),
    (failed(Incident.RESUME), STOP),
    (None, STOP),
])
def test_requeue_only_for_a_cause_outside_the_job(remedy: Remedy | None, code: int) -> None:
    assert exit_codes.for_failure(remedy, step=40, requeued_at=[]).code == code


def test_a_requeue_names_the_host_to_exclude() -> None:
    verdict = exit_codes.for_failure(failed(Incident.SDC, host="gpu-5"), 40, [])
    assert verdict.exclude == ("gpu-5",)
    assert verdict.to_json()["verdict"] == "requeue"
    assert verdict.to_json()["exclude_hosts"] == ["gpu-5"]


def test_a_requeue_that_made_no_progress_since_the_last_one_stops() -> None:
    lost = failed(Incident.NODE_LOST)
    assert exit_codes.for_failure(lost, step=90, requeued_at=[40]).code == REQUEUE
    stuck = exit_codes.for_failure(lost, step=40, requeued_at=[10, 40])
    assert stuck.code == STOP and "no progress since the last requeue (step 40" in stuck.why


def test_requeued_steps_come_from_earlier_sessions_run_finished_entries() -> None:
    entries = [{"event": "run_finished", "exit_code": REQUEUE, "step": 12},
               {"event": "run_finished", "exit_code": 0, "step": 30},
               {"event": "launch", "exit_code": REQUEUE, "step": 50},
               {"event": "run_finished", "exit_code": REQUEUE, "step": 41}]
    assert exit_codes.requeued_steps(entries) == [12, 41]


def test_excluded_hosts_accumulate_once_each(tmp_path: Path) -> None:
    run_dir.exclude_hosts(tmp_path, ["gpu-5"])
    path = run_dir.exclude_hosts(tmp_path, ["gpu-5", "gpu-9"])
    assert path.read_text() == "gpu-5\ngpu-9\n"
