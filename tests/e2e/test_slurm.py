"""babysit under a real Slurm cluster (``tests/slurm.py``: slurmctld, one slurmd per node in
its own network namespace, munge), started once for the module. The job script is
docs/multinode.md's, submitted with ``sbatch`` as written and watched with ``squeue`` and
``scontrol``; Slurm's own signals, requeue and cancel, and a node whose slurmd dies, for real.

The module's four jobs and the run by hand start at once, side by side on eight nodes (they
spend most of their time waiting: Slurm's time-limit warning comes at its controller's next
30-second check, a requeued job waits for its credential's expiry); what happens to each is
scripted in the background (``when``), and the tests then read what each left. One rank per
node keeps them short: 2 ranks on 2 nodes, against 1 on one node (a run split into two
one-node jobs) differ in their final evaluation. Each trains ``tests/workers/tiny_train.py``,
whose ``--pace-file`` holds a run at a slow pace until what is waited for has happened, then
lets it go at full speed, and whose ``--hold-at`` holds the time-limited run short of its end
until Slurm's warning has come, however late: the pace changes no number."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests import slurm
from tests.conftest import (
    FAST_POLICY,
    ROOT,
    WORKERS,
    babysit_env,
    final_eval,
    read_jsonl,
    run_babysit,
)
from tests.test_recipes import elastic_step, slurm_script

pytestmark = pytest.mark.e2e

NO_SLURM = slurm.available()
STEPS = 240
"""Long enough that the slow pace (0.3 s a step) is still training when what a job waits for
comes, short at full speed."""
HOLD_AT = 220
"""The time-limited job's ranks wait before this step until Slurm's warning has come (its
``final_checkpoint_requested``): slurmctld's check may come later than its 240 steps at the
slow pace take, on a busy machine or after the job waited in the queue."""
DOOMED_STEPS = 60
"""The job that loses a node: killed at step 15, the rest at full speed on the other node."""
SLOW, FAST = "0.3", "0.01"
KILL_WAIT_S = 30
"""Slurm's default ``KillWait``: after a SIGTERM that ends the job, its SIGKILL."""

_SHOWN: list[Path] = []
"""Folders whose logs and journals a failure prints."""
_CLUSTER: list[slurm.Cluster] = []


def failure_context() -> str:
    """What a failed test here prints (``conftest.pytest_runtest_makereport``)."""
    parts = [c.logs() for c in _CLUSTER]
    for folder in _SHOWN:
        for path in sorted(folder.rglob("*.out")) + sorted(folder.rglob("events.jsonl")):
            lines = path.read_text(errors="replace").splitlines()[-25:]
            parts.append(f"--- {path}\n" + "\n".join(line[:300] for line in lines))
    return "\n".join(parts)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[slurm.Cluster]:
    if NO_SLURM is not None:
        pytest.skip(NO_SLURM)
    with slurm.Cluster(tmp_path_factory.mktemp("slurm") / "cluster", nodes=8) as made:
        _CLUSTER.append(made)
        yield made
        _CLUSTER.clear()


def write_config(folder: Path, pace: str = FAST, steps: int = STEPS, nodes: str = "",
                 hold: bool = False) -> Path:
    """``folder/train.yaml``: tiny_train, one rank a node, no run directory (Slurm's job id
    names it), paced by ``folder/pace``; ``nodes``: more of the nodes section; ``hold``: the
    ranks wait before step ``HOLD_AT`` until ``folder/go`` exists (``Job.go``).

    A grad-norm spike is only alerted, never skipped in the rank: the in-process guard's window
    starts empty on every attempt, so a resumed run would skip (or keep) optimizer steps an
    uninterrupted one does not, and the final evaluations the tests compare would differ for
    that alone (a grad norm at 4x the median of the 22 steps after a resume at step 110, not of
    the 132 before it)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pace").write_text(pace)
    config = folder / "train.yaml"
    args = ["--steps", str(steps), "--step-sleep", FAST, "--pace-file", str(folder / "pace"),
            "--eval-every", "10"]
    if hold:
        args += ["--hold-at", str(HOLD_AT), "--hold-until", str(folder / "go")]
    config.write_text(
        f"launch:\n  script: {WORKERS / 'tiny_train.py'}\n  nproc-per-node: 1\n"
        f"  teardown-idle-s: 8\n  args: {json.dumps(args)}\n"
        f"checkpoints: {{every_steps: 5, probation_steps: 5, async_save: false}}\n"
        f"policy: {{name: {FAST_POLICY}, overrides: {{incidents: {{grad_spike: "
        f"{{ladder: [alert]}}}}}}}}\n"
        f"nodes: {{heartbeat_s: 0.5, lost_after_s: 3, settle_s: 2, join_timeout_s: 120{nodes}}}\n")
    _SHOWN.append(folder)
    return config


@dataclass
class Job:
    """A job the module submitted, and what it left."""

    folder: Path
    id: str = ""
    errors: list[str] = field(default_factory=list)
    """What went wrong in its scripted events (``when``)."""

    @property
    def run_dir(self) -> Path:
        return self.folder / "runs" / f"train-{self.id}"

    def journal(self, node: int = 0) -> list[dict[str, Any]]:
        path = self.run_dir / ("events.jsonl" if node == 0 else f"nodes/{node}/events.jsonl")
        return read_jsonl(path) if path.exists() else []

    def events(self, event: str, node: int = 0) -> list[dict[str, Any]]:
        return [e for e in self.journal(node) if e["event"] == event]

    def step(self) -> int:
        path = self.run_dir / "metrics.jsonl"
        return max((r["step"] for r in read_jsonl(path)), default=0) if path.exists() else 0

    def pace(self, pace: str) -> None:
        (self.folder / "pace").write_text(pace)

    def go(self) -> None:
        """Let ranks held before ``HOLD_AT`` go on (``write_config``'s ``hold``)."""
        (self.folder / "go").touch()

    def when(self, check: Callable[[], object], then: Callable[[], None],
             timeout: float = 600) -> None:
        """Do ``then`` once ``check`` holds, in the background; a failure is kept in
        ``errors`` for the job's test to show."""
        def watch() -> None:
            deadline = time.monotonic() + timeout
            try:
                while not check():
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"waited {timeout:g} s")
                    time.sleep(0.3)
                then()
            except Exception as exc:  # shown by the test that reads the job
                self.errors.append(f"{then.__name__}: {type(exc).__name__}: {exc}")

        threading.Thread(target=watch, daemon=True).start()


def submit(cluster: slurm.Cluster, job: Job, *options: str, step: str | None = None) -> None:
    """docs/multinode.md's job script, written to the job's folder as it stands there (its
    step replaced by ``step``, another line of the docs), submitted on 2 nodes with
    ``options``, with babysit on the PATH as a user's environment would have it."""
    script = slurm_script()
    if step is not None:
        [line] = [x for x in script.splitlines() if x.startswith("srun")]
        script = script.replace(line, step)
    path = job.folder / "job.sh"
    path.write_text(script)
    env = babysit_env()
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.pop("BABYSIT_SECRET", None)  # the script makes its own
    env = cluster.env(**{k: v for k, v in env.items() if not k.startswith("SLURM")})
    job.id = cluster.sbatch(path, "--nodes=2", "--output=slurm-%j.out", *options, env=env)


def left_running(job: Job) -> list[psutil.Process]:
    """The job's processes still alive, on any node (every node is this machine): started in
    its folder (its srun, babysitters, torchruns, ranks), or for its run directory."""
    found = []
    for p in psutil.process_iter(["environ", "cwd"]):
        env = p.info["environ"] or {}
        if p.info["cwd"] == str(job.folder) or \
                env.get("BABYSIT_RUN_DIR", "").startswith(str(job.run_dir)):
            found.append(p)
    return found


class ByHand:
    """The same config under ``babysit run`` on two namespaced nodes by hand (the cluster's
    last two nodes, outside Slurm: no job here kills them): every option given,
    uninterrupted."""

    def __init__(self, cluster: slurm.Cluster, folder: Path) -> None:
        self.folder = folder
        config = write_config(folder)
        env = {**babysit_env(), "BABYSIT_SECRET": "a secret for the run by hand"}
        nodes = range(len(cluster.names))[-2:]
        self.procs = []
        for rank, node in enumerate(nodes):
            with open(folder / f"node{rank}.out", "w") as log:
                self.procs.append(subprocess.Popen(
                    [*cluster.net.prefix(node), sys.executable, "-m", "babysit", "run",
                     "--nnodes", "2", "--node-rank", str(rank), "--leader",
                     f"{cluster.names[nodes[0]]}:29401", "--run-dir", str(folder / "run"),
                     str(config)], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))

    def final_eval(self) -> float:
        codes = [proc.wait(timeout=600) for proc in self.procs]
        assert codes == [0, 0], failure_context()
        return final_eval(read_jsonl(self.folder / "run" / "events.jsonl"), STEPS)


@dataclass
class Started:
    """What the module starts at once."""

    doomed: Job
    stranded: Job
    timed: Job
    cancelled: Job
    by_hand: ByHand
    lost: dict[str, int] = field(default_factory=dict)
    """The node each job that lost one lost (until it is returned), by the job's name."""


@pytest.fixture(scope="module")
def started(cluster: slurm.Cluster, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[Started]:
    """The docs' job script four times, each on 2 of the 8 nodes, and the run by hand (on the
    last two nodes' namespaces, outside Slurm, which the jobs that lose a node exclude):

    - ``doomed``: the docs' elastic step, on n0 and n1 (``--nodelist``); at step 15 the node of
      its node rank 1 loses its slurmd and every process on it to SIGKILL (a machine gone),
      then full speed;
    - ``stranded``: the docs' step as it is (a fixed node count), with
      ``nodes.rejoin_timeout_s: 5``; its node rank 1's node dies the same way at step 15, is
      not back within 5 s: the run ends with exit 75 and its job is requeued without that
      node. The requeued job waits until every node it had has ended it, the dead one too:
      its administrator returns it (Slurm would mark it down after ``SlurmdTimeout``, 300 s);
      then it resumes at full speed on two other nodes;
    - ``timed``: a 2-minute limit and its warning 60 s ahead (``--time=2 --signal=TERM@60``,
      on sbatch's command line): slurmctld looks at the time limits every 30 s from its start,
      and its first look at least 30 s after the job started sends the warning (about a minute
      after the cluster started, later on a busy machine). Its ranks wait before step
      ``HOLD_AT`` until the final checkpoint is asked for, whenever that is; once it is in, the
      run goes at full speed, and once the job is requeued it is given 5 minutes (an
      administrator's ``scontrol update TimeLimit=5``), so that the requeued job finishes
      before another warning;
    - ``cancelled``: ``scancel`` at step 10."""
    made = Started(*(Job(tmp_path_factory.mktemp(name))
                     for name in ("doomed", "stranded", "timed", "cancel")),
                   ByHand(cluster, tmp_path_factory.mktemp("by_hand")))
    doomed, stranded, timed, cancelled = made.doomed, made.stranded, made.timed, made.cancelled
    write_config(doomed.folder, pace=SLOW, steps=DOOMED_STEPS)
    write_config(stranded.folder, pace=SLOW, steps=DOOMED_STEPS, nodes=", rejoin_timeout_s: 5")
    write_config(timed.folder, pace=SLOW, hold=True)
    write_config(cancelled.folder, pace=SLOW)
    submit(cluster, doomed, f"--nodelist={','.join(cluster.names[0:2])}", step=elastic_step())
    submit(cluster, stranded, f"--exclude={','.join(cluster.names[-2:])}")
    submit(cluster, timed, "--time=2", "--signal=TERM@60")
    submit(cluster, cancelled)

    def kill_node_1(job: Job, name: str) -> Callable[[], None]:
        def kill_node_1() -> None:
            host = job.events("launch")[0]["hosts"]["1"]
            made.lost[name] = cluster.names.index(host)
            assert cluster.kill_node(made.lost[name])
            job.pace(FAST)
        return kill_node_1

    def return_its_node() -> None:
        cluster.return_node(made.lost.pop("stranded"))

    def full_speed() -> None:
        timed.pace(FAST)

    def give_time() -> None:
        done = cluster.run("scontrol", "update", f"JobId={timed.id}", "TimeLimit=5")
        assert done.returncode == 0, done.stderr

    def cancel() -> None:
        done = cluster.run("scancel", cancelled.id)
        assert done.returncode == 0, done.stderr

    doomed.when(lambda: doomed.step() >= 15, kill_node_1(doomed, "doomed"))
    stranded.when(lambda: stranded.step() >= 15, kill_node_1(stranded, "stranded"))
    stranded.when(lambda: stranded.events("slurm_job"), return_its_node)
    timed.when(lambda: timed.events("final_checkpoint_requested"), timed.go)
    timed.when(lambda: timed.events("final_checkpoint"), full_speed)
    timed.when(lambda: timed.events("slurm_job"), give_time)
    cancelled.when(lambda: cancelled.step() >= 10, cancel)
    yield made
    for node in made.lost.values():
        cluster.return_node(node)


def test_scancel_stops_every_nodes_ranks_within_slurms_grace_and_the_run_says_so(
        cluster: slurm.Cluster, started: Started) -> None:
    """``scancel``: SIGTERM to every process of the job, SIGKILL ``KillWait`` s later. babysit
    waits for the final checkpoint no longer than that leaves, stops every node's ranks itself
    and journals the end before Slurm's SIGKILL; the cancelled job is not requeued."""
    job = started.cancelled
    cluster.until("the job to end", lambda: job.events("slurm_job") and job.id not in
                  " ".join(cluster.queued()), timeout=600)
    assert not job.errors, job.errors
    # babysit's own end, journaled: a babysitter SIGKILLed by Slurm writes nothing more.
    [finished] = job.events("run_finished")
    assert finished["state"] == "stopped" and finished["exit_code"] == 143, finished
    [asked] = job.events("final_checkpoint_requested")
    assert asked["grace_s"] <= KILL_WAIT_S - 15 - 3, asked  # KillWait - stop_grace_s - 3
    [saved] = job.events("final_checkpoint")
    assert saved["saved"], saved
    assert (job.run_dir / "checkpoints" / f"step_{saved['checkpoint_step']:08d}" /
            "manifest.json").exists()
    for node in (0, 1):
        assert job.events("workers_stopped", node=node), node
    assert job.events("sigterm", node=1)  # the follower waited for the leader
    [ending] = job.events("slurm_job")
    assert ending["action"] is None and "Slurm ends it" in ending["why"], ending
    assert cluster.job(job.id).get("JobState") in (None, "CANCELLED")
    assert not left_running(job)


def test_a_node_whose_slurmd_dies_is_left_behind_and_the_job_ends_with_the_run(
        cluster: slurm.Cluster, started: Started) -> None:
    """The docs' elastic step (``--nnodes 1:$SLURM_NNODES``, after the config file). The node
    of node rank 1 loses its slurmd and every process on it mid-run: the run goes on on the
    other node and succeeds. That node's srun task never exits, so srun would wait for it
    until Slurm marks the node down (``SlurmdTimeout``, 300 s), the job holding both nodes:
    the leader cancels the job instead, and the live node is free as soon as the run is over.
    Nothing of the job is left on any node."""
    job = started.doomed
    cluster.until("the run and its job's end", lambda: job.events("slurm_job") or job.errors,
                  timeout=600)
    assert not job.errors, job.errors
    [finished] = job.events("run_finished")
    assert finished["state"] == "succeeded" and finished["step"] == DOOMED_STEPS, finished
    assert [e["nodes"] for e in job.events("launch")] == [[0, 1], [0]]
    hosts = job.events("launch")[0]["hosts"]
    [ending] = job.events("slurm_job")
    assert ending["action"] == "cancel" and ending["error"] is None, ending
    assert f"node 1 ({hosts['1']}) was lost" in ending["why"], ending
    # Long before Slurm would notice the dead node (SlurmdTimeout: 300 s), the job is no
    # longer running and the live node is free; only the dead one shows it completing.
    cluster.until("the job to leave RUNNING",
                  lambda: cluster.job(job.id).get("JobState") != "RUNNING", timeout=60)
    cluster.until(f"{hosts['0']} free", lambda: cluster.state(hosts["0"]) == "idle",
                  timeout=60)
    # The run's processes are gone with it (srun in the job's batch script goes at Slurm's
    # KillWait: it waits for the dead node's task until then, holding nothing; the module's
    # last test sees it gone); nothing runs on the dead node.
    assert not [p for p in left_running(job) if p.name() != "srun"]
    assert not cluster.net.pids(started.lost["doomed"])
    shown = run_babysit("status", str(job.run_dir), cwd=job.folder).stdout
    assert f"slurm       job {job.id}: cancelled (" in shown, shown
    cluster.return_node(started.lost.pop("doomed"))  # its administrator brings it back


def test_a_lost_node_that_does_not_come_back_requeues_the_job_without_it(
        cluster: slurm.Cluster, started: Started) -> None:
    """The docs' step as it is (a fixed node count). Node rank 1's node dies mid-run and is not
    back within ``nodes.rejoin_timeout_s``: the run ends with 75, a cause outside the job; the
    leader requeues the job and puts the lost node into its ``ExcNodeList``; the requeued job
    (same id, same run directory) runs on two other nodes once the dead one is dealt with,
    resumes from the newest state saved (node 0's ranks keep the last completed step) with what
    the run had decided, and finishes."""
    job = started.stranded
    cluster.until("the requeued run to finish", lambda: job.errors or any(
        e["state"] == "succeeded" for e in job.events("run_finished")), timeout=600)
    assert not job.errors, job.errors
    first, then = job.events("run_finished")
    assert first["exit_code"] == 75 and first["state"] == "failed", first
    lost = job.events("launch")[0]["hosts"]["1"]
    requeued = job.events("slurm_job")[0]
    assert requeued["action"] == "requeue" and requeued["exclude"] == [lost], requeued
    assert requeued["error"] is None, requeued
    assert lost in cluster.hostnames(cluster.job(job.id)["ExcNodeList"])
    assert int(cluster.job(job.id)["Restarts"]) == 1
    resumed = job.events("launch")[-1]
    assert lost not in resumed["hosts"].values() and len(resumed["hosts"]) == 2, resumed
    # The newest step saved before the run ended: a periodic checkpoint, or the state of the
    # last completed step that node 0's ranks wrote once node 1 was lost (just-in-time).
    # (before the requeued run's launch: a save may be journaled as the first run ends; and
    # a periodic save at the very step node 1 was lost may reach the disk but not the
    # journal, its rank's report dropped with the attempt: the just-in-time entry then says
    # that step "is saved already", outcome "nothing")
    saved = [e["checkpoint_step"] for e in job.events("checkpoint_saved")
             if e["time"] < resumed["time"]]
    saved += [e["checkpoint_step"] for e in job.events("just_in_time")
              if e["outcome"] in ("saved", "nothing") and e["time"] < resumed["time"]]
    assert resumed["directive"]["resume"]["step"] == max(saved), resumed
    assert then["state"] == "succeeded" and then["step"] == DOOMED_STEPS, then
    assert job.events("supervisor_takeover")  # the run goes on, its record kept


@pytest.fixture(scope="module")
def timed_out(cluster: slurm.Cluster, started: Started) -> Job:
    """The time-limit job, once babysit said the run is over and the job ended."""
    job = started.timed
    cluster.until("the run to succeed", lambda: job.errors or any(
        e["state"] == "succeeded" for e in job.events("run_finished")), timeout=600)
    assert not job.errors, job.errors
    cluster.until("the job to end", lambda: job.id not in " ".join(cluster.queued()),
                  timeout=120)
    return job


@pytest.fixture(scope="module")
def by_hand(started: Started) -> float:
    """The final evaluation of the run by hand."""
    return started.by_hand.final_eval()


def test_the_docs_job_script_trains_as_one_run_on_both_nodes(
        timed_out: Job, by_hand: float) -> None:
    """``srun babysit run train.yaml`` on 2 nodes: each babysitter took its node count, node
    rank, the leader's address and the run directory from the step, and the two trained one
    2-rank run, whose final evaluation is the same config's run by hand on two nodes (with
    every option given), bit for bit: not two one-node runs into one folder. The job was
    requeued on the way (the next test): every session, both nodes."""
    job = timed_out
    launches = job.events("launch")
    assert launches and all(e["nodes"] == [0, 1] for e in launches), launches
    assert {r["n_ranks"] for r in read_jsonl(job.run_dir / "metrics.jsonl")} == {2}
    took = launches[0]["slurm"]
    assert took["job_id"] == job.id and took["node"] == launches[0]["hosts"]["0"], took
    assert set(took["took"]) == {"launch.nnodes", "launch.node_rank", "nodes.leader",
                                 "run_dir"}, took
    port = 20000 + int(job.id)
    assert took["took"]["nodes.leader"].startswith(f"{took['node']}:{port} "), took
    follower = job.events("launch", node=1)[0]["slurm"]
    assert follower["node"] == launches[0]["hosts"]["1"], follower
    assert follower["took"]["launch.node_rank"].startswith("1 "), follower
    assert final_eval(job.journal(), STEPS) == by_hand


def test_at_the_time_limits_warning_the_final_checkpoint_is_saved_and_the_job_requeued(
        cluster: slurm.Cluster, timed_out: Job, by_hand: float) -> None:
    """Slurm's SIGTERM reaches every process of the step, the ranks' too: they ignore it
    (babysit started them so) and train on until the leader asks for the final checkpoint,
    within the grace; the leader sees the job still running (the time limit's warning, not a
    cancel) and requeues it; the requeued job (same id, same run directory) resumes from that
    checkpoint and finishes, its final evaluation the uninterrupted run's."""
    job = timed_out
    asked, *_ = job.events("final_checkpoint_requested")
    saved, *_ = job.events("final_checkpoint")
    assert saved["saved"] and saved["checkpoint_step"] >= asked["newest_step"], saved
    first, *later = job.events("run_finished")
    assert first["state"] == "stopped" and first["exit_code"] == 143, first
    requeued, *_ = job.events("slurm_job")
    assert requeued["action"] == "requeue" and requeued["error"] is None, requeued
    # The next session resumed from that checkpoint, on both nodes, and the run finished
    # (a session slower than the next warning is requeued again, as the first was).
    starts = job.events("run_started")
    assert len(starts) == len(later) + 1 >= 2
    resumed = next(e for e in job.events("launch") if e["time"] > starts[1]["time"])
    assert resumed["directive"]["resume"]["step"] == saved["checkpoint_step"], resumed
    assert later[-1]["state"] == "succeeded" and later[-1]["step"] == STEPS
    assert int(cluster.job(job.id)["Restarts"]) == len(later)
    assert cluster.job(job.id)["JobState"] == "COMPLETED"
    assert final_eval(job.journal(), STEPS) == by_hand


def test_nothing_of_any_job_is_left_on_any_node(cluster: slurm.Cluster, started: Started
                                                ) -> None:
    """Once every job ended: no process of any of them on any node (every node is this
    machine), the srun that waited for the dead node's task included (Slurm kills it
    ``KillWait`` s after the cancel), and the controller holds no job."""
    jobs = (started.doomed, started.stranded, started.timed, started.cancelled)
    cluster.until("every job's processes gone",
                  lambda: not [p for job in jobs for p in left_running(job)],
                  timeout=KILL_WAIT_S + 60)
    cluster.until("no job held", lambda: not [
        line for line in cluster.queued() if line.split()[0] in {j.id for j in jobs}],
        timeout=60)
