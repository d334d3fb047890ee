"""The leader's reach into the other nodes for a just-in-time save of the last completed step.

A multi-node run's just-in-time save is the single node's (``node.just_in_time.save``) with one
more ``Part``, the other nodes: the leader asks every node of the attempt that still answers
what its ranks hold (``KeepAsk``), chooses the writers from all the views, has every node write
its writers' parts and copy its ranks' marks into the shared checkpoint folder (``KeepWrite``),
waits for every node's answer (its files, the marks included, hashed there), commits, and
releases every node's ranks (``KeepRelease``). A node that is lost, or does not answer in time,
gives no views: its ranks count as absent, and a shard only they held means no just-in-time
state; one lost between the views and the writes fails its writers, and its ranks' marks are
not there (their streams are lost, said so).

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
from babysit.supervisor.node.last_step import Gathered, Keepers, Written

TICK_S = 0.02
"""How often the leader looks for the nodes' answers while it waits for them."""


class OtherNodes:
    """A ``node.just_in_time.Part`` over the cluster's wire: the attempt's other nodes."""

    def __init__(self, cluster: Cluster, rank_node: Mapping[int, int],
                 hand_on: Callable[[int, Heard], None]) -> None:
        """``rank_node``: each rank's node (from the hellos); ``hand_on``: what to do with a
        message that is not an answer (the leader's own handling)."""
        self.cluster = cluster
        self.rank_node = dict(rank_node)
        self.hand_on = hand_on
        self.nodes = [n for n in cluster.attempt.nodes if n != cluster.me]
        self._attempt = -1
        self._writers: dict[int, list[int]] = {}
        self._asked: list[int] = []
        """The nodes told to write (those reachable then): each one's answer is waited for."""

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
        silent = {n: (f"on node {n}, which was lost" if n not in self._reachable() else
                      f"on node {n}, which did not answer in time")
                  for n in self.nodes if n not in got}
        out.missing({r: silent[n] for r, n in self.rank_node.items() if n in silent})
        return out

    def write(self, attempt: int, the_plan: just_in_time.Plan, dest: Path,
              deadline: float) -> None:
        self._writers = {n: [r for r in the_plan.writers if self.rank_node.get(r) == n]
                         for n in self.nodes}
        self._asked = self._reachable()
        self.cluster.tell(KeepWrite(attempt, the_plan.to_json(), str(dest),
                                    round(max(0.0, deadline - time.monotonic()), 3)))

    def written(self, deadline: float) -> Written:
        """Every node told to write answers, writers or not: a node copies its ranks' marks
        too, and the commit must not come before its copies are there."""
        got: dict[int, KeepWritten] = self._collect(KeepWritten, deadline, self._asked)
        out = Written()
        for node in self._asked:
            message = got.get(node)
            if message is None:
                out.failed.update({r: f"node {node} did not answer in time"
                                   for r in self._writers[node]})
                continue
            out.files += [FileEntry(str(f["name"]), int(f["size"]), int(f["crc32"]))
                          for f in message.files]
            out.failed.update(message.failed)
            for rank, form in message.formats.items():  # its files came above, hashed there
                out.answered(rank, {"ok": True, "files": [], "format": form})
        return out

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
        return KeepViews(attempt, [], {r: "on a node that keeps no just-in-time state"
                                       for r in ranks})
    got = keepers.gather(attempt, ranks, time.monotonic() + seconds)
    return KeepViews(attempt, [asdict(v) for v in got.views.values()], got.absent, got.marks)


def node_write(keepers: Keepers | None, message: KeepWrite,
               ranks: Mapping[int, int]) -> KeepWritten:
    """A follower's answer to ``KeepWrite``: its writers' files and the marks it copied, or why
    its writers failed."""
    the_plan = just_in_time.Plan.from_json(message.plan)
    if keepers is None:
        return KeepWritten(message.attempt, [], {r: "no keeper on this node"
                                                 for r in the_plan.writers if r in ranks})
    written = keepers.write(message.attempt, the_plan, Path(message.dest),
                            time.monotonic() + message.seconds, ranks.keys())
    return KeepWritten(message.attempt, [asdict(f) for f in written.files], written.failed,
                       {r: f.to_json() if f else {} for r, f in written.formats.items()})
