"""What ``babysit run`` exits with, for the scheduler that started it.

Slurm (``--requeue`` in a job script's ``if``), Kubernetes (a Job's ``podFailurePolicy`` on
exit codes, JobSet's failure policy) and NVRx's launcher act on a process's exit code; the
recipes in docs/multinode.md use these::

    0        the run succeeded
    1        stop: do not run this again as it is. The job's own fault (a deterministic crash,
             data, code, a restore that did not take), a bad config, or no progress across
             the last requeues: running it again would repeat it
    75       requeue (EX_TEMPFAIL): the cause was outside the job (nodes lost and not back, a
             machine fault the policy gave up on, this node cut off or fenced) and a new
             allocation, without the hosts in RUN_DIR/exclude_hosts, is likely to go on
    128+N    stopped by signal N (a scheduler's preemption or time limit: its own business)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from babysit.policies.types import Incident, Remedy

STOP = 1
REQUEUE = 75

MACHINE_CRASHES = frozenset({"hardware", "network", "signal"})
"""Crash classes whose cause lies outside the job: a GPU or link fault, a killed process."""


@dataclass(frozen=True, slots=True)
class Verdict:
    """What a failed run tells its scheduler, and why."""

    code: int
    why: str
    exclude: tuple[str, ...] = ()
    """Hosts the fault was traced to: a requeue should run without them."""

    def to_json(self) -> dict[str, Any]:
        return {"verdict": "requeue" if self.code == REQUEUE else "stop", "why": self.why,
                "exclude_hosts": list(self.exclude)}


def for_failure(remedy: Remedy | None, step: int, requeued_at: Sequence[int]) -> Verdict:
    """The verdict on a run that failed with ``remedy`` as its last word, at ``step`` (the
    newest it reached); ``requeued_at``: the steps at which earlier sessions of this run
    directory ended in a requeue, oldest first.

    Requeue when the cause is outside the job: a node lost, a silent data corruption, a hang
    that followed neither the data nor the code, a crash of a machine class. Stop for the
    job's own (the data, the code, a loss that will not settle, a restore that did not take)
    and when the last requeue made no progress: a requeue that cannot get past the same step
    would repeat for ever.
    """
    if remedy is None:
        return Verdict(STOP, "the workers failed and no policy answered")
    finding = remedy.finding
    ev = finding.evidence
    incident = finding.incident
    machine = (incident in (Incident.NODE_LOST, Incident.SDC, Incident.GPU_FAULT, Incident.HANG)
               or (incident is Incident.CRASH and ev.get("class") in MACHINE_CRASHES))
    if ev.get("follows") in ("data", "code") or ev.get("deterministic") or not machine:
        return Verdict(STOP, f"the job's own: {remedy.reason}")
    if requeued_at and step <= requeued_at[-1]:
        return Verdict(STOP, f"no progress since the last requeue (step {requeued_at[-1]}, "
                             f"now {step}): {remedy.reason}")
    host = ev.get("host")
    exclude = (str(host),) if isinstance(host, str) and host else ()
    return Verdict(REQUEUE, f"outside the job ({incident.value}): {remedy.reason}", exclude)


def requeued_steps(entries: Sequence[Mapping[str, Any]]) -> list[int]:
    """The steps at which earlier sessions ended in a requeue (their ``run_finished``)."""
    return [int(e.get("step") or 0) for e in entries
            if e.get("event") == "run_finished" and e.get("exit_code") == REQUEUE]


def on_finish(code: int, failed: bool, remedy: Remedy | None, step: int,
              requeued_at: Sequence[int], exclude: Callable[[Sequence[str]], object]
              ) -> tuple[int, dict[str, Any]]:
    """The code a run ending with ``code`` exits with, and its ``run_finished`` verdict fields:
    a failed run (``failed``, ``code`` the state machine's ``STOP``) gets the requeue-or-stop
    verdict of ``for_failure``, and the hosts it names go to ``exclude`` (into
    ``RUN_DIR/exclude_hosts``)."""
    if code != STOP or not failed:
        return code, {}
    judged = for_failure(remedy, step, requeued_at)
    if judged.exclude:
        exclude(judged.exclude)
    return judged.code, judged.to_json()
