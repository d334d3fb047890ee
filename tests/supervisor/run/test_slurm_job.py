"""What a run's end does to its Slurm job (``run.slurm_job``): the decision from the run's own
journal and the job as ``scontrol`` shows it, pure; and how long a SIGTERM leaves the final
checkpoint. The real commands against a real cluster: ``tests/e2e/test_slurm.py``."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

from babysit.supervisor.config import plan as plan_mod
from babysit.supervisor.config.slurm import SlurmStep
from babysit.supervisor.run import slurm_job
from babysit.supervisor.run.slurm_job import Ending, Job, decide, lost_nodes, session
from tests.journal_text import unreadable

SHOWN = ("JobId=42 JobName=llm UserId=ana(1000) GroupId=ana(1000) MCS_label=N/A Priority=1 "
         "Nice=0 Account=(null) QOS=(null) JobState=RUNNING Reason=None Dependency=(null) "
         "Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:0 RunTime=00:01:02 "
         "TimeLimit=00:02:00 NodeList=n[0-1] BatchHost=n0 NumNodes=2 ExcNodeList=n7 "
         "Command=/home/ana/job.sh WorkDir=/home/ana")
"""One line of ``scontrol show job --oneliner`` (Slurm 22.05), as far as it matters here."""
RUNNING = Job.parse(SHOWN)


def entry(event: str, **fields: Any) -> dict[str, Any]:
    return {"time": 0.0, "event": event, "attempt": 0, **fields}


def ran(*middle: dict[str, Any], code: int = 0, state: str = "succeeded",
        step: int = 100, **finished: Any) -> list[dict[str, Any]]:
    """A session's journal: started, ``middle``, finished with ``code``."""
    return [entry("run_started", pid=7), *middle,
            entry("run_finished", state=state, exit_code=code, step=step, **finished)]


def test_the_job_as_scontrol_shows_it() -> None:
    assert Job(state="RUNNING", requeue=True, batch=True, excluded="n7") == RUNNING
    none = Job.parse(SHOWN.replace("ExcNodeList=n7", "ExcNodeList=(null)")
                     .replace("Requeue=1", "Requeue=0").replace("BatchFlag=1", "BatchFlag=0"))
    assert none == Job(state="RUNNING", requeue=False, batch=False, excluded="")


def test_a_run_that_ended_with_every_node_leaves_the_job_to_end_by_itself() -> None:
    ending = decide(ran(entry("node_joined", node=1, host="n1")), [], RUNNING)
    assert ending.action is None and "every node's babysitter exits" in ending.why


def test_a_lost_node_gets_the_job_cancelled_when_the_run_is_over() -> None:
    """Its srun task never exits: srun would hold the allocation until Slurm marks it down."""
    lost = [entry("node_joined", node=1, host="n1"), entry("node_joined", node=2, host="n2"),
            entry("node_lost", node=2, host="n2", why="its connection closed (eof)")]
    ending = decide(ran(*lost), [], RUNNING)
    assert ending == Ending("cancel", ending.why) and "node 2 (n2) was lost" in ending.why
    # Back before the end (a healed partition), or evicted (told to leave, it left): no.
    back = [*lost, entry("node_joined", node=2, host="n2")]
    assert decide(ran(*back), [], RUNNING).action is None
    evicted = [entry("node_joined", node=2, host="n2"), entry("node_evicted", node=2, host="n2")]
    assert decide(ran(*evicted, code=1, state="failed"), [], RUNNING).action is None
    assert lost_nodes(lost) == {2: "n2"}


def test_a_requeue_verdict_requeues_the_job_without_the_hosts_it_names() -> None:
    entries = ran(entry("node_lost", node=3, host="n3"), code=75, state="failed",
                  verdict="requeue", why="outside the job (node_lost): node 3 lost")
    ending = decide(entries, [], RUNNING, exclude_hosts=["n5", "n3"])
    assert ending.action == "requeue" and "node 3 lost" in ending.why
    assert ending.exclude == ("n5", "n3")  # the run's exclude_hosts and its lost nodes, once
    # A job that cannot be requeued ends as srun returns, or is cancelled for its lost node.
    fixed = Job("RUNNING", requeue=False, batch=True, excluded="")
    assert decide(entries, [], fixed).action == "cancel"
    assert "cannot be requeued (Requeue=0)" in decide(entries, [], fixed).why
    interactive = Job("RUNNING", requeue=True, batch=False, excluded="")
    assert decide(ran(code=75, state="failed"), [], interactive).action is None


def test_a_sigterm_while_the_job_runs_is_the_time_limits_warning_and_requeues_it() -> None:
    stopped = ran(code=128 + signal.SIGTERM, state="stopped", step=150)
    ending = decide(stopped, [], RUNNING)
    assert ending.action == "requeue" and "its --signal" in ending.why
    # ...unless the session before stopped so too, at a step this one did not pass.
    earlier = ran(code=128 + signal.SIGTERM, state="stopped", step=150)
    loop = decide(stopped, earlier, RUNNING)
    assert loop.action is None and "no progress" in loop.why
    assert decide(ran(code=143, state="stopped", step=151), earlier, RUNNING).action == "requeue"
    # Two sessions stopped before their first step: neither journaled a step, and the reason
    # says step 0, not None.
    early = [entry("run_started", pid=7),
             entry("run_finished", state="stopped", exit_code=143)]
    again = decide(early, early, RUNNING)
    assert again.action is None and again.why.startswith(
        "stopped by SIGTERM at step 0, as the session before it was at step 0: no progress, "
        "so no requeue")
    assert unreadable(again.why) == []


@pytest.mark.parametrize("state", ["COMPLETING", "CANCELLED", "TIMEOUT", "PREEMPTED"])
def test_a_job_slurm_is_ending_is_left_to_it(state: str) -> None:
    """``scancel``, the time limit itself: Slurm ends the job, a lost node or not."""
    ended = Job(state, requeue=True, batch=True, excluded="")
    entries = ran(entry("node_lost", node=1, host="n1"), code=143, state="stopped")
    ending = decide(entries, [], ended)
    assert ending.action is None and f"the job is {state}" in ending.why


def test_a_babysitter_that_did_not_finish_the_run_does_nothing_to_the_job() -> None:
    """A fenced leader: another node leads the run, and ends its job."""
    fenced = [entry("run_started", pid=7), entry("launch")]
    assert decide(fenced, [], RUNNING).action is None


def test_a_session_is_the_entries_its_own_process_wrote() -> None:
    entries = [entry("run_started", pid=5), entry("run_finished", exit_code=143),
               entry("run_started", pid=7), entry("launch"), entry("run_started", pid=9)]
    assert session(entries, 7) == entries[2:]
    assert session(entries, 8) == []


def test_outside_slurm_the_final_checkpoint_waits_what_the_config_says(tmp_path: Path) -> None:
    (tmp_path / "t.py").write_text("")
    config = tmp_path / "c.yaml"
    config.write_text(f"launch: {{script: {tmp_path / 't.py'}}}\nrun_dir: {tmp_path / 'r'}\n")
    assert slurm_job.sigterm_grace(plan_mod.from_file(config))(120.0) == 120.0
    assert slurm_job.end(plan_mod.from_file(config), print) is None


def test_under_slurm_a_job_being_cancelled_leaves_killwait_less_the_stop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``scancel``: SIGKILL ``KillWait`` s after the SIGTERM; the wait leaves the stop
    (``launch.stop_grace_s``) and the record (3 s) inside it. Slurm's warning ahead of the time
    limit (the job still running) leaves the configured wait."""
    (tmp_path / "t.py").write_text("")
    config = tmp_path / "c.yaml"
    config.write_text(f"launch: {{script: {tmp_path / 't.py'}, stop-grace-s: 10}}\n"
                      f"run_dir: {tmp_path / 'r'}\n")
    step = SlurmStep(job_id="42", nodes=1, tasks=1, node_id=0, nodelist="n0")
    plan = plan_mod.from_file(config, slurm=step)
    said = {"show job": SHOWN.replace("JobState=RUNNING", "JobState=CANCELLED"),
            "show config": "Configuration data as of now\nKillWait                = 30 sec\n"}

    def scontrol(*args: str) -> tuple[bool, str]:
        return True, said[" ".join(args[1:3])]

    monkeypatch.setattr(slurm_job, "_scontrol", scontrol)
    grace = slurm_job.sigterm_grace(plan)
    assert grace(120.0) == 30 - 10 - 3 and grace(5.0) == 5.0
    said["show job"] = SHOWN
    assert grace(120.0) == 120.0


def test_a_requeue_comes_before_its_hosts_to_leave_out_and_a_refused_one_cancels(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Slurm changes ``ExcNodeList`` only while a job is pending ("Job is no longer pending
    execution" for a running one, real slurmctld's answer): requeue first, and the update tried
    again when it fails. A requeue refused while a lost node holds the job ends the job
    instead."""
    calls: list[str] = []
    refused: set[str] = set()

    def scontrol(*args: str) -> tuple[bool, str]:
        calls.append(" ".join(args))
        return args[1] not in refused, "refused"

    monkeypatch.setattr(slurm_job, "_scontrol", scontrol)
    monkeypatch.setattr(slurm_job, "UPDATE_PAUSE_S", 0.0)
    requeue = Ending("requeue", "75", ("n3",))
    assert slurm_job.perform("42", requeue, RUNNING, lost=True) is None
    assert calls == ["scontrol requeue 42", "scontrol update JobId=42 ExcNodeList=n7,n3"]
    calls.clear()
    refused.add("update")
    assert slurm_job.perform("42", requeue, RUNNING, lost=True) == "refused"
    assert calls[0] == "scontrol requeue 42"  # requeued all the same
    # The requeue signals the job's processes, an scontrol among them: the update is retried.
    assert calls[1:] == ["scontrol update JobId=42 ExcNodeList=n7,n3"] * slurm_job.UPDATE_TRIES
    calls.clear()
    refused.add("requeue")
    assert slurm_job.perform("42", requeue, RUNNING, lost=True) == "refused; cancelled instead"
    assert calls == ["scontrol requeue 42", "scancel 42"]
    calls.clear()
    assert slurm_job.perform("42", requeue, RUNNING, lost=False) == "refused"
    assert calls == ["scontrol requeue 42"]


def test_a_slurm_command_outlives_the_sigterm_its_own_requeue_sends() -> None:
    """``scontrol requeue`` run inside the job is signalled with the rest of the job: a real
    process that gets its SIGTERM mid-way still finishes and says so (a CI run saw the requeue
    done but reported as "killed by SIGTERM")."""
    ok, out = slurm_job._scontrol("sh", "-c", "kill -TERM $$; echo requeued")
    assert (ok, out) == (True, "requeued")

