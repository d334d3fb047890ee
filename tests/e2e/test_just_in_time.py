"""A fault costs one step, on every path a user meets: the matrix.

(FSDP2 rows: where no live rank holds a shard, the newest memory copy does, every 5 steps:
``checkpoints/memory.py``.)

{one node, two nodes in network namespaces} x {hang, segfault, SIGSTOP, a lost node} x {DDP,
FSDP2}, each cell a real fault in a real run of ``tests/workers/tiny_train.py`` (dropout, Adam,
StepLR: a resume is exact only if the weights, the optimizer, the scheduler, every rank's random
streams and the data cursor all come back). The cells of one row share one run: its faults
strike one per attempt, so one run of a few dozen seconds proves four cells, and one clean run
per parallelism serves every row of it.

- **One node**, 2 ranks: rank 1 hangs before step 30, rank 0 dies of SIGSEGV before step 60,
  rank 1 is SIGSTOPped before step 90, rank 1 is SIGKILLed before step 120 (the OOM killer's
  way); FSDP2's last fault is a hang inside ``optimizer.step()`` instead (a half-updated shard).
- **Two nodes** in their own network namespaces, one rank each and a hot spare: the follower's
  rank hangs before step 30, the leader's own rank dies of SIGSEGV before step 60, the
  follower's rank is SIGSTOPped before step 90, then the follower's whole node is SIGKILLed
  past step 115 (its babysitter, its rank and its shared memory) and the spare takes its place.

A loader stuck on one batch is ``test_cause.py``'s (skipped from the step it struck in: nothing
else replayed); a node lost from a job that goes on on fewer nodes, resharded,
``test_multinode.py``'s.

Each cell asserts the step the relaunch resumed at: the interrupted one wherever a live rank
holds every shard of it (DDP always; FSDP2 when both ranks live), else the newest periodic
checkpoint, with the journal's reason naming the shard and why. Every step of every attempt
has the loss of the clean run, bit for bit, and so has the final evaluation, except where the
world's random streams could not all come back (a lost node's ranks, under DDP: said so in
``streams_lost``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import netns
from tests.conftest import (
    FAST_POLICY,
    babysat,
    journal,
    newest_checkpoint_before,
    read_jsonl,
    run_babysit,
)
from tests.e2e.test_multinode import Nodes
from tests.netns import Network

pytestmark = pytest.mark.e2e

STEPS = 150
EVERY = 25
ARGS = ("--steps", str(STEPS), "--eval-every", "50", "--step-sleep", "0.02")
MEMORY = 5
SAVES = (f"{{every_steps: {EVERY}, probation_steps: 5, async_save: true, "
         f"memory_every_steps: {MEMORY}}}")
OVERRIDES = "{incidents: {hang: {ladder: [relaunch, relaunch, relaunch, stop]}}}"
POLICY = f"{{name: {FAST_POLICY}, overrides: {OVERRIDES}}}"
"""Three hangs in a row relaunch: the rows' faults are the point, not the ladder's end."""
LOST_AFTER = 115
"""The step past which the follower's node is lost (after the third fault's resume at 89)."""
NO_NETNS = netns.available()
Losses = dict[int, tuple[float, float]]
Clean = tuple[Losses, dict[int, float]]


def losses(run_dir: Path) -> dict[tuple[int, int], tuple[float, float]]:
    """(attempt, step) -> the lowest and highest rank's loss (with 2 ranks: both ranks'; the
    one form a single node's rows and the leader's merged ones share)."""
    return {(m["attempt"], m["step"]): (m["loss_min"], m["loss_max"])
            for m in read_jsonl(run_dir / "metrics.jsonl")}


def evals(events: list[dict[str, Any]]) -> dict[int, float]:
    """Rank 0's held-out loss by step (the last attempt's, where several reported one)."""
    return {e["data"]["step"]: e["data"]["values"]["eval_loss"]
            for e in events if e["event"] == "worker_scalars" and e["rank"] == 0}


def _clean(tmp: Path, *extra: str) -> Clean:
    result, run_dir = babysat(tmp, "clean", *ARGS, *extra, checkpoints=SAVES,
                              launch_extra="  warm_standby: false\n")  # it never relaunches
    assert result.returncode == 0, result.stdout + result.stderr
    return ({s: loss for (_, s), loss in losses(run_dir).items()},
            evals(read_jsonl(run_dir / "events.jsonl")))


@pytest.fixture(scope="module")
def clean_ddp(tmp_path_factory: pytest.TempPathFactory) -> Clean:
    return _clean(tmp_path_factory.mktemp("clean_ddp"), "--ddp")


@pytest.fixture(scope="module")
def clean_fsdp(tmp_path_factory: pytest.TempPathFactory) -> Clean:
    return _clean(tmp_path_factory.mktemp("clean_fsdp"), "--fsdp")


def _resumes(events: list[dict[str, Any]]) -> dict[int, int]:
    """Attempt -> the step it resumed from (each relaunch's)."""
    return {e["attempt"]: e["directive"]["resume"]["step"] for e in events
            if e["event"] == "launch" and e["directive"]["resume"] is not None}


def _exact(run_dir: Path, events: list[dict[str, Any]], clean: Clean,
           until: tuple[int, int] | None = None) -> None:
    """Every step of every attempt (up to ``until``, (attempt, step), where given) has the
    clean run's losses, bit for bit; without ``until`` the final evaluation too."""
    clean_losses, clean_evals = clean
    for (attempt, step), loss in sorted(losses(run_dir).items()):
        if until is None or (attempt, step) < until:
            assert loss == clean_losses[step], (attempt, step, loss, clean_losses[step])
    if until is None:
        assert evals(events)[STEPS] == clean_evals[STEPS]


# -- one node -------------------------------------------------------------------------------------

ONE_NODE = ("--at", "0:1:30:hang", "--at", "1:0:60:SIGSEGV", "--at", "2:1:90:SIGSTOP")


def test_one_node_ddp_a_hang_a_segfault_a_stopped_and_a_killed_rank_each_cost_one_step(
        tmp_path: Path, clean_ddp: Clean) -> None:
    result, run_dir = babysat(tmp_path, "ddp", *ARGS, "--ddp", *ONE_NODE,
                              "--at", "3:1:120:SIGKILL", checkpoints=SAVES, policy=POLICY)
    assert result.returncode == 0, result.stdout + result.stderr
    events = read_jsonl(run_dir / "events.jsonl")
    saved = [(e["fault"], e["outcome"], e["checkpoint_step"], e["writers"], e["marks"])
             for e in journal(run_dir, "just_in_time")]
    assert saved == [("hang", "saved", 29, [0], [1]), ("crash", "saved", 59, [1], [0]),
                     ("hang", "saved", 89, [0], [1]), ("crash", "saved", 119, [0], [1])]
    assert _resumes(events) == {1: 29, 2: 59, 3: 89, 4: 119}
    _exact(run_dir, events, clean_ddp)
    # Each relaunch says what it spared, on the console, in the journal and in `status`.
    resumes = [e for e in journal(run_dir, "resume") if e.get("from")]
    assert [e["just_in_time"]["lost_steps"] for e in resumes] == [1, 1, 1, 1]
    # The newest periodic checkpoint then: the save before each fault, or (an asynchronous save
    # still in flight at the fault, on a loaded machine) the one before it.
    periodic = [newest_checkpoint_before(events, e) for e in resumes]
    assert all(p is not None and 0 < e["checkpoint_step"] - p < 2 * EVERY
               for e, p in zip(resumes, periodic, strict=True)), periodic
    assert resumes[2]["summary"] == (
        "resumed from the just-in-time state of step 89, written by rank 0 after the hang "
        f"(1 step lost; the newest checkpoint was of step {periodic[2]})")
    assert "babysit: just-in-time state of step 59 written by rank 1 after the crash" \
        in result.stdout
    assert "babysit: resumed from the just-in-time state of step 119" in result.stdout
    status = run_babysit("status", str(run_dir), cwd=tmp_path, timeout=60)
    assert "resume step 119 (just-in-time state)" in status.stdout, status.stdout
    # Trusted like any checkpoint, no more: each resume was checked and took, and the ranks
    # that held on at their end (at gloo's error, at torchrun's SIGTERM) said so.
    checks = journal(run_dir, "resume_check")
    assert len(checks) >= 8 and all(e["data"]["took"] for e in checks)
    assert journal(run_dir, "worker_holding")


def test_one_node_fsdp2_keeps_the_step_while_every_shard_lives_and_says_why_when_not(
        tmp_path: Path, clean_fsdp: Clean) -> None:
    result, run_dir = babysat(tmp_path, "fsdp", *ARGS, "--fsdp", *ONE_NODE,
                              "--at", "3:1:120:optimizer-hang", checkpoints=SAVES,
                              policy=POLICY)
    assert result.returncode == 0, result.stdout + result.stderr
    events = read_jsonl(run_dir / "events.jsonl")
    hang, crash, stopped, half = journal(run_dir, "just_in_time")
    assert (hang["outcome"], hang["checkpoint_step"], hang["writers"]) == ("saved", 29, [0, 1])
    assert (crash["outcome"], stopped["outcome"], half["outcome"]) == ("none",) * 3
    assert "shard 0 of the sharded state has no live holder (rank 0 is dead)" in crash["why"]
    assert "shard 1 of the sharded state has no live holder (rank 1 is stopped (SIGSTOP)" \
        in stopped["why"]
    assert "inside optimizer.step()" in half["why"]
    # No live rank held the step: the newest memory copy did (every 5 steps), each rank's
    # shard in the node's shared memory.
    assert _resumes(events) == {1: 29, 2: 55, 3: 85, 4: 115}
    origins = [e["origin"] for e in journal(run_dir, "resume") if e.get("from")]
    assert origins == ["just_in_time", "memory", "memory", "memory"]
    assert "no just-in-time state after the hang: shard 1" in result.stdout
    _exact(run_dir, events, clean_fsdp)


# -- two nodes ------------------------------------------------------------------------------------

@pytest.fixture
def net3() -> Iterator[Network]:
    """Two nodes and a spare, each in its own network namespace."""
    if NO_NETNS is not None:
        pytest.skip(NO_NETNS)
    with netns.network(3) as made:
        yield made


def _two_nodes(tmp_path: Path, net: Network, *args: str) -> tuple[Nodes, int]:
    """The two-node row: faults on the follower's rank and the leader's own, then the
    follower's node lost past ``LOST_AFTER`` and the spare in its place. Returns the run and
    the step the follower's node was lost at."""
    run = Nodes(tmp_path, *ARGS[2:], *args, nnodes="2", steps=STEPS, net=net, nproc=1,
                nodes=", spares: 1", checkpoints=SAVES, overrides=OVERRIDES)
    run.start(0, TINY_TRAIN_AT="1:60:SIGSEGV")
    run.start(1, TINY_TRAIN_AT="0:30:hang,2:90:SIGSTOP")
    run.until("the first step", lambda: _step(run) >= 1)
    run.start(2)  # the spare joins the running attempt and waits
    run.until(f"attempt 3 past step {LOST_AFTER}",
              lambda: _attempt(run) == 3 and _step(run) > LOST_AFTER, timeout=180)
    lost_at = _step(run)
    net.kill(1)  # the follower's host dies: babysitter, rank and its memory
    codes = run.wait(240)
    assert codes[0] == 0 and codes[2] == 0, run.logs()
    return run, lost_at


def _step(run: Nodes) -> int:
    with contextlib.suppress(FileNotFoundError, ValueError):
        rows = read_jsonl(run.run_dir / "metrics.jsonl")
        return rows[-1]["step"] if rows else 0
    return 0


def _attempt(run: Nodes) -> int:
    launches = run.events("launch")
    return launches[-1]["attempt"] if launches else -1


def _ranks(run: Nodes) -> dict[int, int]:
    """Node -> its rank in the first attempt (one rank a node)."""
    return {e["data"]["node"]: e["rank"] for e in run.events("worker_hello")
            if e["attempt"] == 0}


def test_two_nodes_ddp_every_fault_of_either_node_costs_one_step(
        tmp_path: Path, net3: Network, clean_ddp: Clean) -> None:
    run, lost_at = _two_nodes(tmp_path, net3, "--ddp")
    leader, follower = _ranks(run)[0], _ranks(run)[1]
    saved = [(e["fault"], e["outcome"], e["checkpoint_step"], e["writers"])
             for e in run.events("just_in_time")]
    assert saved[:3] == [("hang", "saved", 29, [leader]), ("crash", "saved", 59, [follower]),
                         ("hang", "saved", 89, [leader])], saved
    # The leader hears of the loss first from its own rank (gloo's connection reset: a
    # crash), or from the node's babysitter's connection: either way before anything stops.
    fault, outcome, step, writers = saved[3]
    assert fault in ("crash", "loss of a node") and (outcome, writers) == ("saved", [leader])
    assert step >= lost_at
    # The lost node's rank's streams died with its memory: said, and resumed without them.
    assert run.events("just_in_time")[3]["streams_lost"] == [follower]
    assert _resumes(run.journal()) == {1: 29, 2: 59, 3: 89, 4: step}
    last = run.events("launch")[-1]
    assert last["attempt"] == 4 and last["nodes"] == [0, 2]  # the spare in the lost node's place
    _exact(run.run_dir, run.journal(), clean_ddp, until=(4, 0))
    assert run.events("run_finished")[-1]["state"] == "succeeded"


def test_two_nodes_fsdp2_keeps_the_step_while_every_shard_lives_and_says_why_when_not(
        tmp_path: Path, net3: Network, clean_fsdp: Clean) -> None:
    run, lost_at = _two_nodes(tmp_path, net3, "--fsdp")
    leader, follower = _ranks(run)[0], _ranks(run)[1]
    hang, crash, stopped, lost = run.events("just_in_time")
    assert (hang["outcome"], hang["checkpoint_step"], hang["writers"]) == ("saved", 29, [0, 1])
    assert (crash["outcome"], stopped["outcome"], lost["outcome"]) == ("none",) * 3
    assert f"rank {leader} is dead" in crash["why"]
    assert f"rank {follower} is stopped (SIGSTOP)" in stopped["why"]
    assert f"rank {follower} is on node 1, which was lost" in lost["why"]
    # No live rank held the step: the newest memory copy did, the lost node's shard from the
    # replica its peer (node 0) kept in its own shared memory.
    newest = lost_at // MEMORY * MEMORY
    resumed = _resumes(run.journal())
    assert {a: resumed[a] for a in (1, 2, 3)} == {1: 29, 2: 55, 3: 85}
    assert newest - 2 * MEMORY <= resumed[4] <= lost["checkpoint_step"]
    # (A periodic save is made in place of the copy at its steps: a node lost just after one
    # resumes from that step on disk, the same state.)
    assert [e["origin"] for e in run.events("resume") if e.get("from")] == \
        ["just_in_time", "memory", "memory", "periodic" if resumed[4] % EVERY == 0 else "memory"]
    # Every rank's streams were in the periodic checkpoints: the run ends bit-exact.
    _exact(run.run_dir, run.journal(), clean_fsdp)
