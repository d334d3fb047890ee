"""One node's judgement of its own ranks, in a multi-node run.

Each node's babysitter (the leader's too, for its own node) keeps every one of its ranks'
reports of a step for about a tick, exactly as a single-node run does, and does two things with
the step:

- runs the detectors that need each rank's value (``policies.replay`` scope ``node``: non-finite
  values, stragglers, rank departure) and the hang timers over its own ranks, and names what it
  finds with the node and host: only this node can dump its ranks' stacks or read their logs;
- summarises the step into a ``StepSummary`` (mergeable, a few KiB whatever the ranks) for the
  leader, which merges the nodes' summaries and watches the job's global signals on them.

So the raw per-rank stream never leaves the node. A straggler is judged against the peers on
its own node (7 peers on an 8-GPU node); a whole node that is slow shows up in the job's
throughput, not as a named rank.
"""

from __future__ import annotations

import dataclasses
import socket

from babysit.policies.types import Finding, RankStep, StepRecord
from babysit.supervisor.config import slurm
from babysit.supervisor.config.plan import RunPlan
from babysit.supervisor.contract.directive import Directive
from babysit.supervisor.contract.protocol import WorkerEvent
from babysit.supervisor.node.aggregate import StepAggregator
from babysit.supervisor.node.sketch import StepSummary
from babysit.supervisor.run.watch import Watch


def node_name() -> str:
    """This machine's name, as findings, alerts and ``exclude_hosts`` show it: in a Slurm
    job the node's Slurm name (what ``ExcNodeList`` and ``sbatch --exclude`` take), else its
    host name."""
    return slurm.node_name() or socket.gethostname()


def located(finding: Finding, node: int, host: str) -> Finding:
    """The finding, saying which node and host its ranks are on (once)."""
    where = f"node {node}, host {host}"
    if where in finding.message:
        return finding
    return dataclasses.replace(finding, message=f"{finding.message} [{where}]",
                               evidence={**finding.evidence, "node": node, "host": host})


class NodeView:
    """Per-rank detectors and hang timers over one node's ranks; summaries for the leader."""

    def __init__(self, watch: Watch, node: int, host: str, local_ranks: int | None = None
                 ) -> None:
        """``local_ranks``: this node's ranks when the config fixes them; else counted from
        the hellos (a step completes once every local rank reported it)."""
        self.watch = watch
        self.local_ranks = local_ranks
        self.node = node
        self.host = host
        self.world_size = 0
        """The whole job's ranks, from the hellos (a summary is sized for the world)."""
        self._records = StepAggregator(1)
        self._local: set[int] = set()

    @classmethod
    def from_plan(cls, plan: RunPlan, node: int) -> NodeView:
        nproc = plan.config.launch.nproc_per_node
        return cls(Watch.from_plan(plan, scope="node"), node, node_name(),
                   nproc if isinstance(nproc, int) else None)

    def new_attempt(self, now: float, directive: Directive) -> None:
        self.watch.new_attempt(now, directive)
        self._records.reset()
        self._records.world_size = self.local_ranks or 1
        self._local = set()

    def observe_event(self, event: WorkerEvent, now: float) -> None:
        self.watch.observe_event(event, now)
        if event.type == "hello":
            self._local.add(event.rank)
            self._records.world_size = max(len(self._local), self.local_ranks or 0)
            world = event.data.get("world_size")
            if isinstance(world, int) and world > 0:
                self.world_size = world

    def observe_rank(self, sample: RankStep, now: float
                     ) -> tuple[list[StepSummary], list[Finding]]:
        """One rank's report: the node's completed steps as summaries, and what the per-rank
        detectors saw in them."""
        self.watch.observe_rank(sample, now)
        return self._judge(self._records.add(sample))

    def flush(self) -> tuple[list[StepSummary], list[Finding]]:
        """The steps still open (the attempt ended)."""
        return self._judge(self._records.flush())

    def check(self, now: float) -> list[Finding]:
        """Hang timers over this node's ranks."""
        return [self.name(f) for f in self.watch.check(now)]

    def looming(self, now: float) -> bool:
        """Half-way to a hang suspicion on this node (its stacks are read ahead)."""
        return self.watch.hang_looming(now)

    def defer_hang(self, finding: Finding, now: float) -> None:
        """The suspected hang's ranks were found working: keep watching."""
        self.watch.defer_hang(finding, now)

    def name(self, finding: Finding) -> Finding:
        return located(finding, self.node, self.host)

    def _judge(self, records: list[StepRecord]) -> tuple[list[StepSummary], list[Finding]]:
        summaries: list[StepSummary] = []
        findings: list[Finding] = []
        for record in records:
            world = max(self.world_size, 1 + max((r.rank for r in record.ranks), default=0))
            summaries.append(StepSummary.of(record.step, world, record.ranks))
            findings.extend(self.name(f) for f in self.watch.observe_record(record))
        return summaries, findings
