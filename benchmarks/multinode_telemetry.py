"""Multi-node telemetry: one StepSummary per node per step beside every rank's raw report.

    .venv/bin/python benchmarks/multinode_telemetry.py [--nodes 8 32] [--ranks-per-node 8]
        [--rate 2] [--seconds 10] [--senders 4] [--tick 0.1]

A multi-node run has one babysitter per node; the followers send the leader their steps over
the authenticated TCP channel (``supervisor.cluster.wire``). Two designs, side by side, on the
same simulated steps:

- ``summary`` (what babysit does): each node folds its ranks' ``RankStep`` into a
  ``StepSummary`` and sends ``{"attempt", "type": "summary", "summary": to_dict()}`` (through
  ``journal.json_safe``, as ``follower._send`` does); the leader runs ``StepSummary.from_dict``
  and ``NodeMerger(nodes).add(node, summary)``, one frame per node per step.
- ``raw``: each node forwards every rank's report, ``dataclasses.asdict(RankStep)``, one frame
  per rank per step; the leader rebuilds ``RankStep`` and merges with
  ``SummaryAggregator(world, keep_raw=0)`` (same emission rule as the single-node intake).

Either way the leader writes ``to_row(0)`` for every merged step, as ``leading._job_step`` does.
Simulated ranks: step time 0.5 s with lognormal jitter (sigma 0.05) and a per-step common
factor, one slow rank at 1.4x, data wait around 10 ms, a falling loss with per-rank noise, one
grad norm per step with noise (they agree under data parallelism), lr with warmup, 4,096 tokens
and 4 samples per rank.

How it runs. The leader is this process: a real ``Listener`` on loopback, its ``Peer`` reader
threads (receive, HMAC check, ``json.loads``) and a loop that wakes every ``--tick`` seconds
(``babysit.supervisor.run.loop.TICK_S``), drains every peer and merges. The followers are real
``wire.connect`` peers in ``--senders`` forked processes (each hosting a group of nodes), not
threads here: the reader threads are part of the leader's cost, so the leader's CPU is
``time.process_time()`` of the whole process, and sender threads in it would both add their
``json.dumps`` and HMAC to that figure and take the GIL from the leader (inflating latency).
Messages are built before the run, so a sender only encodes and sends; each sends step i at
``start + i / --rate + offset[i]``, the offset drawn uniformly in ``[0, --tick)`` from a fixed
seed: the same for both designs, and it keeps the steps from locking onto one phase of the
leader's tick (0.5 s is a multiple of 0.1 s). Measured, per node count and design:

- wire: frames and JSON body bytes per step (``json.dumps`` as ``Peer.send`` encodes it; each
  frame adds a 36-byte header: length and HMAC tag);
- leader CPU: ``process_time`` (all leader threads) and ``thread_time`` of the loop thread alone,
  from the first scheduled send to the last merged step, per second of that wall time;
- latency: from a step's last send (the latest of all senders, ``time.monotonic``, which is one
  clock across processes) to the merged step coming out of the leader's merge; median and p99
  over the steps. It includes up to one ``--tick`` of the loop's sleep, as in babysit, so
  "wake to merge" also gives the median time from the start of the drain that merged a step
  to its merge: the leader's own delay, whatever the phase;
- node cost: in this process, before the wire runs, the time one node takes to build and encode
  a step's message(s): ``StepSummary.add`` x ranks + ``to_dict`` + ``json_safe`` +
  ``json.dumps`` (summary) or ``asdict`` + ``json_safe`` + ``json.dumps`` per rank (raw),
  microseconds, median. The HMAC and socket write of ``Peer.send`` are not in it.

Correctness: every merged step's ``to_row(0)`` must equal the row of one ``StepSummary`` built
in-process from all ranks' reports of that step (same keys; ints and lists exact; floats within
1e-9 relative: only the order of float sums differs); "rows ok" counts the steps that do.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing as mp
import os
import platform
import secrets
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Protocol

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from babysit.policies.types import RankStep
from babysit.supervisor.cluster import wire
from babysit.supervisor.cluster.merge import NodeMerger
from babysit.supervisor.node.sketch import StepSummary, SummaryAggregator
from babysit.supervisor.run.journal import json_safe
from babysit.supervisor.run.loop import TICK_S

SECRET = secrets.token_bytes(32)
ATTEMPT = 0
MODES = ("summary", "raw")
ENCODE_NODES = 8  # nodes whose messages the node-cost pass times, every step, three times
JOIN_TIMEOUT_S = 30.0
GRACE_S = 10.0  # how long the leader waits past the last scheduled send

Message = dict[str, Any]
Plan = list[list[list[Message]]]  # plan[node][step index]: the frames that node sends that step


@dataclass
class Workload:
    """Every rank's report of every step: ``steps[i]`` is step i + 1, in rank order; node n
    holds ranks ``n * per_node`` to ``(n + 1) * per_node - 1``."""

    nodes: int
    per_node: int
    steps: list[list[RankStep]]

    @property
    def world(self) -> int:
        return self.nodes * self.per_node

    def node_reports(self, node: int, index: int) -> list[RankStep]:
        return self.steps[index][node * self.per_node:(node + 1) * self.per_node]


def simulate(nodes: int, per_node: int, steps: int, seed: int = 0) -> Workload:
    rng = np.random.default_rng(seed)
    world = nodes * per_node
    slow_rank = world // 3
    t0 = 1.7e9
    out: list[list[RankStep]] = []
    for step in range(1, steps + 1):
        shared = float(np.exp(0.02 * rng.standard_normal()))
        times = 0.5 * shared * np.exp(0.05 * rng.standard_normal(world))
        times[slow_rank] *= 1.4
        waits = 0.01 * np.exp(0.3 * rng.standard_normal(world))
        losses = 2.0 + 3.0 / step ** 0.5 + 0.02 * rng.standard_normal(world)
        grad = float(1.0 + 0.1 * rng.standard_normal())
        lr = 3e-4 * min(1.0, step / 100)
        clock = t0 + 0.5 * step + 1e-3 * rng.random(world)
        out.append([RankStep(
            rank=r, step=step, time=float(clock[r]), cursor=step, loss=float(losses[r]),
            grad_norm=grad, lr=lr, tokens=4096.0, samples=4.0, step_time=float(times[r]),
            data_wait=float(waits[r])) for r in range(world)])
    return Workload(nodes, per_node, out)


# -- the node's side: what a follower sends ------------------------------------------------------

def summary_message(step: int, world: int, reports: list[RankStep]) -> Message:
    """One node's step as ``follower._report`` sends it (``node._judge`` builds the summary)."""
    summary = StepSummary.of(step, world, reports)
    message: Message = json_safe({"attempt": ATTEMPT, "type": "summary",
                                  "summary": summary.to_dict()})
    return message


def raw_message(report: RankStep) -> Message:
    """One rank's report, forwarded as is."""
    message: Message = json_safe({"attempt": ATTEMPT, "type": "rank",
                                  "report": dataclasses.asdict(report)})
    return message


def frames(work: Workload, mode: str, node: int, index: int) -> list[Message]:
    reports = work.node_reports(node, index)
    if mode == "summary":
        return [summary_message(index + 1, work.world, reports)]
    return [raw_message(r) for r in reports]


def encode(message: Message) -> bytes:
    """The body ``Peer.send`` frames."""
    return json.dumps(message, separators=(",", ":")).encode()


def plan(work: Workload, mode: str) -> Plan:
    return [[frames(work, mode, node, i) for i in range(len(work.steps))]
            for node in range(work.nodes)]


def node_cost_us(work: Workload, mode: str) -> float:
    """Median microseconds for one node to build and encode one step's frames."""
    samples: list[int] = []
    for _ in range(3):
        for index in range(len(work.steps)):
            for node in range(min(work.nodes, ENCODE_NODES)):
                reports = work.node_reports(node, index)
                start = time.perf_counter_ns()
                if mode == "summary":
                    encode(summary_message(index + 1, work.world, reports))
                else:
                    for r in reports:
                        encode(raw_message(r))
                samples.append(time.perf_counter_ns() - start)
    return float(np.median(samples)) / 1e3


def send_group(nodes: list[int], steps_plan: Plan, rate: float, offsets: list[float],
               conn: Connection) -> None:
    """A sender process: connect ``nodes`` to the leader, send every step on the pace, report
    when each step's last frame was sent (``time.monotonic``), close when told."""
    address: str = conn.recv()
    peers = {n: wire.connect(address, SECRET, {"node_rank": n}) for n in nodes}
    conn.send("joined")
    start: float = conn.recv()
    sent_at: list[float] = []
    for index in range(len(steps_plan[nodes[0]])):
        time.sleep(max(0.0, start + index / rate + offsets[index] - time.monotonic()))
        for n in nodes:
            for message in steps_plan[n][index]:
                if not peers[n].send(message):
                    raise RuntimeError(f"node {n}: the leader closed the connection")
        sent_at.append(time.monotonic())
    conn.send(sent_at)
    conn.recv()  # the leader has everything: closing now loses nothing
    for peer in peers.values():
        peer.close()


# -- the leader's side ---------------------------------------------------------------------------

class Merge(Protocol):
    def take(self, node: int, message: Message) -> list[StepSummary]: ...


class SummaryMerge:
    """What ``leading._node_message`` does with a ``summary`` message."""

    def __init__(self, nodes: int) -> None:
        self.merger = NodeMerger(range(nodes))

    def take(self, node: int, message: Message) -> list[StepSummary]:
        if message.get("type") != "summary" or message.get("attempt") != ATTEMPT:
            return []
        return self.merger.add(node, StepSummary.from_dict(message["summary"]))


class RawMerge:
    """The alternative: every rank's report to the leader, summarised there."""

    def __init__(self, world: int) -> None:
        self.aggregator = SummaryAggregator(world, keep_raw=0)

    def take(self, node: int, message: Message) -> list[StepSummary]:
        if message.get("type") != "rank" or message.get("attempt") != ATTEMPT:
            return []
        return self.aggregator.add(RankStep(**message["report"]))


@dataclass
class Result:
    nodes: int
    world: int
    mode: str
    frames_per_step: float
    body_kib_per_step: float
    cpu_per_s: float
    loop_cpu_per_s: float
    p50_ms: float
    p99_ms: float
    wake_ms: float
    node_us: float
    rows_ok: int
    steps: int


def wire_pass(work: Workload, mode: str, rate: float, senders: int,
              tick: float) -> tuple[float, float, list[float], list[float],
                                    dict[int, dict[str, Any]]]:
    """One live run. Returns leader CPU s/s (process, loop thread), latencies and wake to merge
    delays (s) and the merged rows."""
    steps_plan = plan(work, mode)
    steps = len(work.steps)
    offsets = [float(x) for x in np.random.default_rng(1).uniform(0.0, tick, steps)]
    groups = [g for g in (list(range(work.nodes))[i::senders] for i in range(senders)) if g]
    ctx = mp.get_context("fork")
    # Fork before the listener's threads exist; the address follows over the pipe.
    children = []
    for group in groups:
        ours, theirs = ctx.Pipe()
        child = ctx.Process(target=send_group, args=(group, steps_plan, rate, offsets, theirs),
                            daemon=True)
        child.start()
        children.append((child, ours))
    merge: Merge = SummaryMerge(work.nodes) if mode == "summary" else RawMerge(work.world)
    listener = wire.Listener("127.0.0.1", 0, SECRET).open()
    try:
        for _, conn in children:
            conn.send(listener.address)
        for _, conn in children:
            if not conn.poll(JOIN_TIMEOUT_S) or conn.recv() != "joined":
                raise RuntimeError("a sender group did not join within "
                                   f"{JOIN_TIMEOUT_S:g} s; rejected: {dict(listener.rejected)}")
        peers: dict[int, wire.Peer] = {}
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while len(peers) < work.nodes and time.monotonic() < deadline:
            peers.update((int(p.info["node_rank"]), p) for p in listener.accept())
            time.sleep(0.01)
        if len(peers) < work.nodes:
            raise RuntimeError(f"{len(peers)} of {work.nodes} nodes joined")
        order = sorted(peers.items())

        start = time.monotonic() + 0.3
        for _, conn in children:
            conn.send(start)
        emitted: dict[int, float] = {}
        woke: dict[int, float] = {}
        rows: dict[int, dict[str, Any]] = {}
        time.sleep(max(0.0, start - time.monotonic()))
        cpu0, loop0, wall0 = time.process_time(), time.thread_time(), time.monotonic()
        stop = start + steps / rate + GRACE_S
        while len(emitted) < steps and time.monotonic() < stop:
            time.sleep(tick)  # the loop's tick: nobody waits on a socket
            wake = time.monotonic()
            for node, peer in order:
                for message in peer.receive():
                    for summary in merge.take(node, message):
                        emitted[summary.step] = time.monotonic()
                        woke[summary.step] = wake
                        rows[summary.step] = summary.to_row(ATTEMPT)
        cpu, loop = time.process_time() - cpu0, time.thread_time() - loop0
        wall = time.monotonic() - wall0

        last_sent = [0.0] * steps
        for _, conn in children:
            for index, at in enumerate(conn.recv()):
                last_sent[index] = max(last_sent[index], at)
        for _, conn in children:
            conn.send("close")
    finally:
        listener.close()
        for child, _ in children:
            child.join(timeout=5.0)
            if child.is_alive():
                child.terminate()
    if len(emitted) < steps:
        raise RuntimeError(f"{mode}, {work.nodes} nodes: {len(emitted)} of {steps} steps merged "
                           f"within {GRACE_S:g} s of the last send")
    lags = [emitted[i + 1] - last_sent[i] for i in range(steps)]
    delays = [emitted[s] - woke[s] for s in emitted]
    return cpu / wall, loop / wall, lags, delays, rows


# -- correctness ---------------------------------------------------------------------------------

def same_row(got: dict[str, Any], want: dict[str, Any]) -> bool:
    if got.keys() != want.keys():
        return False
    for key, value in want.items():
        other = got[key]
        if isinstance(value, float) and isinstance(other, float):
            if not math.isclose(other, value, rel_tol=1e-9, abs_tol=1e-12):
                return False
        elif other != value or type(other) is not type(value):
            return False
    return True


def rows_ok(work: Workload, rows: dict[int, dict[str, Any]]) -> int:
    good = 0
    for index, reports in enumerate(work.steps):
        reference = StepSummary.of(index + 1, work.world, reports)
        row = rows.get(index + 1)
        good += row is not None and row["n_ranks"] == work.world \
            and same_row(row, reference.to_row(ATTEMPT))
    return good


# -- report --------------------------------------------------------------------------------------

HEADER = ("| nodes | ranks | design | frames/step | body KiB/step | leader CPU s/s "
          "| of which loop thread | latency p50 ms | p99 ms | wake to merge ms "
          "| node encode us (median) | rows ok |")


def table_lines(results: list[Result]) -> Iterator[str]:
    yield HEADER
    yield "|" + "---|" * (HEADER.count(" | ") + 1)
    for r in results:
        yield (f"| {r.nodes} | {r.world:,} | {r.mode} | {r.frames_per_step:,.0f} "
               f"| {r.body_kib_per_step:,.1f} | {r.cpu_per_s:.4f} | {r.loop_cpu_per_s:.4f} "
               f"| {r.p50_ms:.1f} | {r.p99_ms:.1f} | {r.wake_ms:.2f} | {r.node_us:,.0f} "
               f"| {r.rows_ok}/{r.steps} |")


def ratio_lines(results: list[Result]) -> Iterator[str]:
    by = {(r.nodes, r.mode): r for r in results}
    for nodes in sorted({r.nodes for r in results}):
        s, w = by[(nodes, "summary")], by[(nodes, "raw")]
        yield (f"- {nodes} nodes, raw / summary: {w.body_kib_per_step / s.body_kib_per_step:.2f}x "
               f"the bytes, {w.frames_per_step / s.frames_per_step:.0f}x the frames, "
               f"{w.cpu_per_s / s.cpu_per_s:.2f}x the leader CPU, "
               f"{w.node_us / s.node_us:.2f}x the node encode time")


def machine() -> str:
    return (f"{platform.machine()}, {os.cpu_count()} cores "
            f"({platform.processor() or platform.platform()}), Python {platform.python_version()}")


def command(args: argparse.Namespace) -> str:
    return (".venv/bin/python benchmarks/multinode_telemetry.py "
            f"--nodes {' '.join(str(n) for n in args.nodes)} "
            f"--ranks-per-node {args.ranks_per_node} --rate {args.rate:g} "
            f"--seconds {args.seconds:g} --senders {args.senders} --tick {args.tick:g}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[8, 32],
                        help="node counts to run (e.g. 8 32 128)")
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--rate", type=float, default=2.0, help="steps per second")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each live run")
    parser.add_argument("--senders", type=int, default=4,
                        help="sender processes; the nodes are dealt among them")
    parser.add_argument("--tick", type=float, default=TICK_S,
                        help="the leader loop's sleep between drains (seconds)")
    parser.add_argument("--markdown", type=Path, help="also write the table to this file")
    args = parser.parse_args(argv)
    if min(args.nodes) < 1 or args.ranks_per_node < 1 or args.rate <= 0 or args.senders < 1:
        parser.error("--nodes, --ranks-per-node, --senders must be at least 1 and --rate "
                     "positive")
    steps = max(1, round(args.seconds * args.rate))

    started = time.monotonic()
    results: list[Result] = []
    for nodes in args.nodes:
        work = simulate(nodes, args.ranks_per_node, steps)
        for mode in MODES:
            sizes = [len(encode(m)) for node in range(nodes) for i in range(steps)
                     for m in frames(work, mode, node, i)]
            node_us = node_cost_us(work, mode)
            cpu, loop, lags, delays, rows = wire_pass(work, mode, args.rate,
                                              min(args.senders, nodes), args.tick)
            ms = np.asarray(lags) * 1e3
            result = Result(
                nodes=nodes, world=work.world, mode=mode, frames_per_step=len(sizes) / steps,
                body_kib_per_step=sum(sizes) / steps / 1024, cpu_per_s=cpu, loop_cpu_per_s=loop,
                p50_ms=float(np.median(ms)), p99_ms=float(np.percentile(ms, 99)),
                wake_ms=float(np.median(delays)) * 1e3,
                node_us=node_us, rows_ok=rows_ok(work, rows), steps=steps)
            results.append(result)
            print(f"  {nodes:>4} nodes  {mode:<7}  {result.body_kib_per_step:8.1f} KiB/step  "
                  f"cpu {cpu:.4f} s/s  p50 {result.p50_ms:.1f} ms  "
                  f"rows ok {result.rows_ok}/{steps}", flush=True)

    lines = [*table_lines(results), "", *ratio_lines(results), "",
             f"{steps} steps at {args.rate:g} steps/s, {args.ranks_per_node} ranks per node, "
             f"leader tick {args.tick:g} s, senders in {args.senders} processes "
             "(p99 of so few steps is close to the max).",
             f"Machine: {machine()}. Wall time {time.monotonic() - started:.0f} s.",
             f"Command: {command(args)}"]
    print()
    print("\n".join(lines))
    if args.markdown:
        args.markdown.write_text("\n".join(lines) + "\n")
    failed = [r for r in results if r.rows_ok != r.steps]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
