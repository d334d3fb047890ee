"""A run's Slurm job ends with the run: what the babysitter that led the run to its end does to
the job, and how long a SIGTERM leaves it, under ``srun``.

At the end, by the run's exit code (its ``run_finished`` entry)::

    0, 1 (succeeded, stop)     nothing: every node's babysitter exits with the run, srun returns,
                               the batch script goes on and ends the job. But a node that was
                               lost (its slurmd, its machine or its link gone) keeps its srun
                               task: srun waits for it until Slurm marks the node down
                               (SlurmdTimeout, 300 s by default) and the job holds its whole
                               allocation meanwhile. Then the job is cancelled (``scancel``),
                               which releases every node at once
    75 (requeue)               the job is requeued (``scontrol requeue``), then the hosts in
                               RUN_DIR/exclude_hosts and the lost nodes added to its
                               ExcNodeList (Slurm takes that of a pending job only). A job that
                               cannot be requeued (``Requeue=0``, an salloc session) ends as
                               above
    128+15 (SIGTERM), the      Slurm's warning before the time limit (``--signal=TERM@...``),
    job still RUNNING          or ``scancel --signal=TERM``: requeued as above, to resume from
                               the final checkpoint; not when the session before ended so too,
                               at a step this one did not pass (a requeue loop)
    a SIGTERM, the job ending  ``scancel``, the time limit itself: nothing, Slurm ends the job

Slurm's own way of ending a step when its first task exits (``srun --wait``,
``--kill-on-bad-exit``) waits ``KillWait + 2`` s (32 s by default) for the task on a dead node
before srun gives up, and acts on the first babysitter to exit, which may be a node evicted
while the run goes on; ``scancel`` of the step alone leaves srun waiting for the dead node. Only
the job's own end (cancel or requeue) releases the allocation at once.

After a SIGTERM the ranks have until Slurm kills the step: ``KillWait`` seconds when the job is
ending (``scancel``: 30 s by default), so the wait for a final checkpoint is cut to fit
(``sigterm_grace``), leaving the stop its ``launch.stop_grace_s`` and the run's record its last
words.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from babysit.supervisor.config.plan import RunPlan
from babysit.supervisor.node import shield
from babysit.supervisor.run import exit_codes, journal, run_dir

SIGTERM_CODE = 128 + int(signal.SIGTERM)
RECORD_S = 3.0
"""Seconds kept, of what Slurm leaves after a SIGTERM, for the run's last entries."""
SCONTROL_S = 20.0
"""How long one ``scontrol`` or ``scancel`` may take before it counts as failed."""
UPDATE_TRIES, UPDATE_PAUSE_S = 5, 0.5
"""A requeued job's ``ExcNodeList`` update: tries, and the pause between them."""


@dataclass(frozen=True, slots=True)
class Job:
    """What ``scontrol show job`` says of the job, as far as its end needs."""

    state: str
    requeue: bool
    batch: bool
    excluded: str
    """``ExcNodeList`` as Slurm writes it (a host list), empty for none."""

    @classmethod
    def parse(cls, text: str) -> Job:
        fields = dict(re.findall(r"(\w+)=(\S*)", text))
        excluded = fields.get("ExcNodeList", "")
        return cls(state=fields.get("JobState", "UNKNOWN"), requeue=fields.get("Requeue") == "1",
                   batch=fields.get("BatchFlag") == "1",
                   excluded="" if excluded == "(null)" else excluded)


@dataclass(frozen=True, slots=True)
class Ending:
    """What the run's end does to its job, and why."""

    action: str | None
    """``requeue``, ``cancel``, or None (the job ends by itself)."""
    why: str
    exclude: tuple[str, ...] = ()
    """Nodes added to the job's ``ExcNodeList`` before a requeue."""


def session(entries: Sequence[dict[str, Any]], pid: int) -> list[dict[str, Any]]:
    """The entries of the session that process ``pid`` wrote: from its ``run_started`` on."""
    starts = [i for i, e in enumerate(entries)
              if e.get("event") == "run_started" and e.get("pid") == pid]
    return list(entries[starts[-1]:]) if starts else []


def lost_nodes(entries: Sequence[dict[str, Any]]) -> dict[int, str]:
    """The nodes lost and not back (their babysitter's srun task may never exit), with their
    hosts: those whose last word in ``entries`` is ``node_lost``. An evicted node was told to
    leave and does."""
    last: dict[int, dict[str, Any]] = {}
    for e in entries:
        if e.get("event") in ("node_joined", "node_lost", "node_evicted") and \
                isinstance(e.get("node"), int):
            last[e["node"]] = e
    return {n: str(e.get("host") or "") for n, e in sorted(last.items())
            if e["event"] == "node_lost"}


def decide(entries: Sequence[dict[str, Any]], earlier: Sequence[dict[str, Any]], job: Job,
           exclude_hosts: Sequence[str] = ()) -> Ending:
    """Pure: what to do to the job once the session's ``entries`` (ending in its
    ``run_finished``) are written. ``earlier``: the run directory's entries before the
    session; ``exclude_hosts``: the run directory's ``exclude_hosts``."""
    finished = next((e for e in reversed(entries) if e.get("event") == "run_finished"), None)
    if finished is None:
        return Ending(None, "this babysitter did not finish the run (another leads it)")
    if job.state != "RUNNING":
        return Ending(None, f"the job is {job.state}: Slurm ends it")
    code = int(finished.get("exit_code", 1))
    lost = lost_nodes(entries)
    step = int(finished.get("step") or 0)
    requeue = None
    if code == exit_codes.REQUEUE:
        requeue = f"the run's verdict is requeue ({finished.get('why') or finished.get('reason')})"
    elif code == SIGTERM_CODE:
        before = [e for e in earlier if e.get("event") == "run_finished"]
        # A session that ended before its first step journaled no step: it was at step 0.
        was = int(before[-1].get("step") or 0) if before else 0
        if before and before[-1].get("exit_code") == SIGTERM_CODE and step <= was:
            return _left(lost, f"stopped by SIGTERM at step {step}, as the session before it "
                               f"was at step {was}: no progress, so no requeue")
        requeue = (f"a SIGTERM while the job runs (its --signal before the time limit, or "
                   f"scancel --signal=TERM), stopped at step {step}: the requeued job resumes "
                   f"from its newest checkpoint")
    if requeue is not None:
        if job.requeue and job.batch:
            hosts = [*exclude_hosts, *(h for h in lost.values() if h)]
            return Ending("requeue", requeue, tuple(dict.fromkeys(hosts)))
        why = "Requeue=0" if job.batch else "not a batch job"
        return _left(lost, f"{requeue}; but the job cannot be requeued ({why})")
    return _left(lost, f"the run ended ({finished.get('state')}, exit code {code})")


def _left(lost: dict[int, str], why: str) -> Ending:
    if not lost:
        return Ending(None, f"{why}: every node's babysitter exits with it")
    nodes = ", ".join(f"node {n} ({h or '?'})" for n, h in lost.items())
    return Ending("cancel", f"{why}; {nodes} was lost: its srun task would hold the job's "
                            f"allocation until Slurm marks the node down")


def _scontrol(*args: str) -> tuple[bool, str]:
    """Run one of Slurm's commands; whether it succeeded, and what it said. It starts with
    SIGTERM ignored: babysit runs it inside the job, and the requeue it asks for signals every
    process of the job, itself included, before it can report that the requeue was done."""
    try:
        done = subprocess.run(list(args), capture_output=True, text=True, timeout=SCONTROL_S,
                              preexec_fn=shield.ignore_sigterm)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"{' '.join(args)}: {exc}"
    out = (done.stdout + done.stderr).strip()
    if done.returncode < 0 and not out:
        out = f"killed by {signal.Signals(-done.returncode).name}"
    return done.returncode == 0, out if done.returncode == 0 else f"{' '.join(args)}: {out}"


def show(job_id: str) -> Job | None:
    """The job as ``scontrol show job`` says; None when it cannot say."""
    ok, out = _scontrol("scontrol", "show", "job", "--oneliner", job_id)
    return Job.parse(out) if ok else None


def perform(job_id: str, ending: Ending, job: Job, lost: bool) -> str | None:
    """Do ``ending`` to the job; the error, or None. A requeue comes first, its hosts to
    leave out after it: Slurm changes ``ExcNodeList`` only while a job is pending, which a
    requeued job is until its credential expires (``AuthInfo=cred_expire``, 120 s). A requeue
    Slurm refuses ends the job instead when ``lost`` nodes would hold it."""
    if ending.action == "requeue":
        ok, out = _scontrol("scontrol", "requeue", job_id)
        if not ok:
            if lost:
                _scontrol("scancel", job_id)
                return f"{out}; cancelled instead"
            return out
        if ending.exclude:
            merged = ",".join(filter(None, [job.excluded, *ending.exclude]))
            # The requeue signals every process of the job: an scontrol started at that moment
            # may die with it. Tried again, a few times.
            for _ in range(UPDATE_TRIES):
                ok, out = _scontrol("scontrol", "update", f"JobId={job_id}",
                                    f"ExcNodeList={merged}")
                if ok:
                    break
                time.sleep(UPDATE_PAUSE_S)
            if not ok:
                return out
        return None
    if ending.action == "cancel":
        ok, out = _scontrol("scancel", job_id)
        return None if ok else out
    return None


def end(plan: RunPlan, log: Callable[[str], None]) -> Ending | None:
    """At the end of a run this babysitter led to its end under ``srun``: end, requeue or
    leave its Slurm job (see the module's table), journal ``slurm_job`` after ``run_finished``,
    and say so. Returns what was done (None outside Slurm)."""
    if plan.slurm is None:
        return None
    job_id = plan.slurm.step.job_id
    path = plan.shared_dir / "events.jsonl"
    entries = list(journal.read(path))
    mine = session(entries, os.getpid())
    if not any(e.get("event") == "run_finished" for e in mine):
        return None  # fenced, or never started: the run is another babysitter's to end
    job = show(job_id)
    if job is None:
        log(f"babysit: cannot read Slurm job {job_id} (scontrol show job): leaving it as it is")
        return None
    hosts = (plan.shared_dir / run_dir.EXCLUDE_HOSTS)
    exclude = hosts.read_text().split() if hosts.exists() else []
    ending = decide(mine, entries[:len(entries) - len(mine)], job, exclude)
    error = perform(job_id, ending, job, lost=bool(lost_nodes(mine)))
    fields: dict[str, Any] = {"job_id": job_id, "action": ending.action, "why": ending.why,
                              "exclude": list(ending.exclude), "error": error}
    last = mine[-1]
    done = journal.Journal(path).open()
    try:
        done.write("slurm_job", time.time(), int(last.get("attempt", 0)), last.get("step"),
                   **fields)
    finally:
        done.close()
    what = {"requeue": "requeued", "cancel": "cancelled", None: "left to end by itself"}
    log(f"babysit: Slurm job {job_id} {what[ending.action]}: {ending.why}"
        + (f" (failed: {error})" if error else ""))
    return ending


def sigterm_grace(plan: RunPlan) -> Callable[[float], float]:
    """The final checkpoint's wait after a SIGTERM, given the configured one: under ``srun``,
    when the job is ending (``scancel``, the time limit) and Slurm kills the step
    ``KillWait`` s after its SIGTERM, no more than what leaves the stop
    (``launch.stop_grace_s``) and the record (``RECORD_S``) inside it."""
    if plan.slurm is None:
        return lambda grace: grace
    job_id, stop_s = plan.slurm.step.job_id, plan.config.launch.stop_grace_s

    def grace(configured: float) -> float:
        job = show(job_id)
        if job is None or job.state == "RUNNING":
            return configured  # Slurm's warning ahead of the end: its time is the user's
        ok, out = _scontrol("scontrol", "show", "config")
        found = re.search(r"^KillWait\s*=\s*(\d+)", out, re.MULTILINE) if ok else None
        if found is None:
            return configured
        return max(0.0, min(configured, int(found.group(1)) - stop_s - RECORD_S))

    return grace
