"""One node's babysitter in a multi-node run, whichever role it plays, and when it changes.

::

    node rank 0, at the start    claims the first term (or the next), and leads; unless another
                                 node leads a live term already (this node was the leader that
                                 was lost, coming back): then it follows that one
    any other node               follows the leader of the term in force
    a follower whose leader      stops its ranks; rejoins if the leader lives (this node was cut
    is lost                      off); claims the next term if the leader is gone, and the
                                 winner leads from here: the same loop a leader runs, taking
                                 over the run's record from the shared run directory

Who leads, and how a deposed leader is fenced: ``cluster.leadership``.
"""

from __future__ import annotations

import dataclasses
import time

from babysit.supervisor.cluster import leadership
from babysit.supervisor.cluster.follower import Follower
from babysit.supervisor.cluster.leader import ClusterMembers
from babysit.supervisor.cluster.leadership import Lease, LeaseWatch, Term
from babysit.supervisor.cluster.node_view import node_name
from babysit.supervisor.config.plan import RunPlan
from babysit.supervisor.node import ahead
from babysit.supervisor.run import journal, slurm_job
from babysit.supervisor.run.console import Console
from babysit.supervisor.run.loop import Supervisor

POLL_S = 0.2


def run_node(plan: RunPlan, console: Console, early: ahead.Early | None = None) -> int:
    """Run this node's babysitter to the end of the run; returns its exit code. ``early``:
    the first attempt's torchrun started ahead, for whichever role launches first. The
    babysitter that leads the run to its end ends its Slurm job with it (``slurm_job``)."""
    secret = plan.secret()
    plan.shared_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    lease = Lease(plan.shared_dir, plan.node_rank, node_name(), plan.config.nodes.heartbeat_s)
    lease.start()
    try:
        term = _first_term(plan) if plan.node_rank == 0 else None
        expect: list[int] | None = None
        if term is None or term.node != plan.node_rank:
            following = Follower(plan.following(), console, secret, early).run()
            if isinstance(following, int):
                return following
            term, expect = following, survivors(plan, following)
        leading = for_term(plan, term)
        code = Supervisor(leading, console,
                          members=ClusterMembers(leading, secret, term, lease, expect,
                                                 early)).run()
    finally:
        lease.leave()
    slurm_job.end(leading, console.log)  # after the lease says this node left
    return code


def _first_term(plan: RunPlan) -> Term:
    """Node 0 at the start: a new term of its own, or the live term another node leads."""
    nodes = plan.config.nodes
    while True:
        current = leadership.newest(plan.shared_dir)
        if current is not None and current.node != plan.node_rank and leadership.wait_alive(
                LeaseWatch(plan.shared_dir, current.node, nodes.lost_after_s), POLL_S,
                lambda: False):
            return current
        won = leadership.claim(plan.shared_dir, current.epoch + 1 if current else 0,
                               plan.node_rank, node_name(), plan.leader_address)
        if won is not None:
            return won
        time.sleep(POLL_S)  # another claimed it meanwhile: look again


def for_term(plan: RunPlan, term: Term) -> RunPlan:
    """The plan this node leads ``term`` with: listening at the term's address and, when it
    took over from another node, hosting the rendezvous itself (the configured endpoint is on
    the lost leader's host)."""
    config = plan.config
    if term.address == plan.leader_address and plan.run_dir == plan.shared_dir:
        return plan
    launch = config.launch
    if launch.rendezvous == "c10d":
        launch = launch.model_copy(update={"rdzv_endpoint": None})
    nodes = config.nodes.model_copy(update={"leader": term.address})
    return dataclasses.replace(plan, run_dir=plan.shared_dir, config=config.model_copy(
        update={"launch": launch, "nodes": nodes}))


def survivors(plan: RunPlan, term: Term) -> list[int]:
    """The nodes the lost leader had, but for it and this node: its last attempt's, its spares
    and those that joined since, less those it lost or evicted since. The new leader waits for
    them (briefly) before its first relaunch."""
    events = list(journal.read(plan.shared_dir / "events.jsonl"))
    last = next((i for i in range(len(events) - 1, -1, -1) if events[i].get("event") == "launch"
                 and isinstance(events[i].get("nodes"), list)), None)
    if last is None:
        return []
    launch = events[last]
    spares = launch.get("spares")
    had = {int(n) for n in [*launch["nodes"], *(spares if isinstance(spares, dict) else {})]}
    for e in events[last + 1:]:
        if isinstance(e.get("node"), int):
            if e.get("event") == "node_joined":
                had.add(e["node"])
            elif e.get("event") in ("node_lost", "node_evicted"):
                had.discard(e["node"])
    lost = leadership.read(plan.shared_dir, term.epoch - 1)
    return sorted(n for n in had if n != term.node and (lost is None or n != lost.node))
