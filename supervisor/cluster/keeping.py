"""The leader's reach into the other nodes for a just-in-time save of the last completed step.

A multi-node run's just-in-time save is the single node's (``node.just_in_time.save``) with the
other nodes as its ``Remote``: the leader asks every node of the attempt that still answers
what its ranks hold (``KeepAsk``), chooses the writers from all the views, has each node's
writers write into the shared checkpoint folder (``KeepWrite``), commits, and releases every
node's ranks (``KeepRelease``). A node that is lost, or does not answer in time, gives no
views: its ranks count as absent, and a shard only they held means no just-in-time state.

While the leader waits for the answers, everything else the nodes say is handed on
(``hand_on``) to be judged as usual: a crash's exits, a lost node.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path

from babysit.checkpoints import just_in_time
from babysit.checkpoints.manifest import FileEntry
from babysit.supervisor.cluster.membership import Cluster, Heard
from babysit.supervisor.cluster.messages import (
    KeepAsk,
    KeepRelease,
    KeepViews,
    KeepWrite,
    KeepWritten,
)
from babysit.supervisor.node.just_in_time import Gathered, Keepers

TICK_S = 0.02
"""How often the leader looks for the nodes' answers while it waits for them."""


class OtherNodes:
    """``node.just_in_time.Remote`` over the cluster's wire: the attempt's other nodes."""

    def __init__(self, cluster: Cluster, rank_node: Mapping[int, int],
                 hand_on: Callable[[int, Heard], None]) -> None:
        """``rank_node``: each rank's node (from the hellos); ``hand_on``: what to do with a
        message that is not an answer (the leader's own handling)."""
        self.cluster = cluster
        self.rank_node = dict(rank_node)
        self.hand_on = hand_on
        self.nodes = [n for n in cluster.attempt.nodes if n != cluster.me]
        self._attempt = -1

    def _reachable(self) -> list[int]:
        peers = self.cluster.attempt.peers
        return [n for n in self.nodes if n in peers and not peers[n].closed]

    def ask(self, attempt: int, deadline: float) -> None:
        self._attempt = attempt
        self.cluster.tell(KeepAsk(attempt, round(max(0.0, deadline - time.monotonic()), 3)))

    def answers(self, deadline: float) -> Gathered:
        out = Gathered()
        got: dict[int, KeepViews] = self._collect(KeepViews, deadline)
        for message in got.values():
            out.add(Gathered({int(v["rank"]): just_in_time.RankView.from_json(v)
                              for v in message.views}, dict(message.absent),
                             dict(message.marks)))
        silent = {n: ("its node was lost" if n not in self._reachable() else
                      "its node did not answer in time") for n in self.nodes if n not in got}
        out.missing({r: silent[n] for r, n in self.rank_node.items() if n in silent})
        return out

    def write(self, attempt: int, the_plan: just_in_time.Plan, dest: Path,
              deadline: float) -> None:
        self._writers = {n: [r for r in the_plan.writers if self.rank_node.get(r) == n]
                         for n in self.nodes}
        self.cluster.tell(KeepWrite(attempt, the_plan.to_json(), str(dest),
                                    round(max(0.0, deadline - time.monotonic()), 3)))

    def written(self, deadline: float) -> tuple[list[FileEntry], dict[int, str]]:
        writing = [n for n in self.nodes if self._writers.get(n)]
        got: dict[int, KeepWritten] = self._collect(KeepWritten, deadline, writing)
        files: list[FileEntry] = []
        failed: dict[int, str] = {}
        for node in writing:
            message = got.get(node)
            if message is None:
                failed.update({r: f"node {node} did not answer in time"
                               for r in self._writers[node]})
                continue
            files += [FileEntry(str(f["name"]), int(f["size"]), int(f["crc32"]))
                      for f in message.files]
            failed.update(message.failed)
        return files, failed

    def release(self, attempt: int) -> None:
        if self._attempt == attempt:
            self.cluster.tell(KeepRelease(attempt))

    def _collect(self, kind: type, deadline: float,
                 nodes: list[int] | None = None) -> dict:  # type: ignore[type-arg]
        """The answers of ``kind`` to the request of this attempt from ``nodes`` (default: all
        the others), until every reachable one answered or ``deadline``."""
        want = set(self.nodes if nodes is None else nodes)
        got: dict = {}  # type: ignore[type-arg]
        while True:
            for node, message in self.cluster.receive():
                if isinstance(message, kind) and getattr(message, "attempt", None) == \
                        self._attempt:
                    got[node] = message
                else:
                    self.hand_on(node, message)
            waiting = want & set(self._reachable()) - set(got)
            if not waiting or time.monotonic() >= deadline:
                return got
            time.sleep(TICK_S)


def node_answer(keepers: Keepers | None, attempt: int, ranks: Mapping[int, int],
                seconds: float) -> KeepViews:
    """A follower's answer to ``KeepAsk``: what its ranks hold."""
    if keepers is None:
        return KeepViews(attempt, [], {r: "babysit keeps no just-in-time state here"
                                       for r in ranks})
    got = keepers.gather(attempt, ranks, time.monotonic() + seconds)
    return KeepViews(attempt, [asdict(v) for v in got.views.values()], got.absent, got.marks)


def node_write(keepers: Keepers | None, message: KeepWrite,
               ranks: Mapping[int, int]) -> KeepWritten:
    """A follower's answer to ``KeepWrite``: its writers' files, or why they failed."""
    the_plan = just_in_time.Plan.from_json(message.plan)
    if keepers is None:
        return KeepWritten(message.attempt, [], {r: "no keeper on this node"
                                                 for r in the_plan.writers if r in ranks})
    files, failed = keepers.write(message.attempt, the_plan, Path(message.dest),
                                  time.monotonic() + message.seconds, ranks.keys())
    return KeepWritten(message.attempt, [asdict(f) for f in files], failed)
