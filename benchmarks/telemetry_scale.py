"""The telemetry plane at 1,024 to 8,192 ranks: sketch summaries beside gather-everything.

    .venv/bin/python benchmarks/telemetry_scale.py [--ranks 1024 2048 4096 8192] [--steps 30]

Simulated ranks report one step per simulated second: step time 0.5 s with lognormal jitter
(sigma 0.05) and a per-step common factor, one slow rank at 1.4x, data wait around 10 ms, a
falling loss with per-rank noise. Every report is packed with ``protocol.encode_step``, the
worker's wire format. Two supervisor-side approaches consume the same reports:

- ``naive``: gather everything: ``StepAggregator`` holds every ``RankStep`` of the steps in flight,
  ``metrics_row`` writes per-rank lists (as it did at every world size before it switched to
  quantiles above ``PER_RANK_LIMIT`` ranks), and the last ``--history`` rows are kept.
- ``sketch``: ``SummaryAggregator`` holds one ``StepSummary`` per step in flight (mergeable stats
  and a quantile sketch per signal), ``StepSummary.to_row`` writes quantiles and the ranks of the
  extremes, the last ``--history`` rows are kept, plus the raw ring (last 4 steps, packed).

Both serialise each row with ``json.dumps`` as the loop does (nothing is written to disk).
Three measurements per approach and world size:

- CPU: a separate consumer process runs the real ``Intake`` on a real SEQPACKET socket and
  drains it on the loop's 0.1 s tick; the producer sends every simulated rank's reports over
  64 real connections (rank r on connection r % 64, so each rank's reports stay in order), as
  fast as the sockets take them. ``time.process_time()`` of the consumer over the whole stream,
  divided by the simulated seconds, is the supervisor's CPU seconds per second of training:
  below 1 means one core keeps up at 1 step/s. The live check at the end sends at the real
  1 step/s and reports the same figure plus the lag from a step's last report to its row.
- Memory: in-process, ``tracemalloc`` peak while every report is decoded with
  ``protocol.decode`` and fed to the approach, step after step (the encoded reports are
  allocated before tracing starts, so they do not count).
- Row size: bytes of the last step's ``metrics.jsonl`` line (the file grows by that each step).
- Accuracy: each step's p50 and p99 step time from the sketch against the exact values
  (``numpy.percentile``, linear interpolation), the largest relative error over the steps.
  The naive approach keeps every value, so its error is 0 by construction.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import socket
import sys
import tempfile
import time
import tracemalloc
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Protocol

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from babysit.policies.types import RankStep
from babysit.supervisor.contract import protocol
from babysit.supervisor.node.aggregate import StepAggregator, metrics_row
from babysit.supervisor.node.intake import Intake, connect
from babysit.supervisor.node.sketch import SummaryAggregator

UNLIMITED = 1 << 30

TOKEN = os.urandom(protocol.TOKEN_BYTES)
TICK_S = 0.1  # babysit.supervisor.run.loop.TICK_S
CONNECTIONS = 64
KEEP_RAW = 4


@dataclass
class Run:
    """One world size's simulated reports: ``messages[s]`` holds step s's encoded reports."""

    ranks: int
    messages: list[list[bytes]]
    step_times: list[np.ndarray]


def simulate(ranks: int, steps: int, seed: int = 0) -> Run:
    rng = np.random.default_rng(seed)
    slow_rank = ranks // 3
    messages, step_times = [], []
    t0 = 1.7e9
    for step in range(1, steps + 1):
        shared = float(np.exp(0.02 * rng.standard_normal()))
        times = 0.5 * shared * np.exp(0.05 * rng.standard_normal(ranks))
        times[slow_rank] *= 1.4
        waits = 0.01 * np.exp(0.3 * rng.standard_normal(ranks))
        losses = 2.0 + 3.0 / step ** 0.5 + 0.02 * rng.standard_normal(ranks)
        grad = float(1.0 + 0.1 * rng.standard_normal())
        out = []
        for r in range(ranks):
            sample = RankStep(
                rank=r, step=step, time=t0 + step + float(times[r]) * 1e-3, cursor=step,
                loss=float(losses[r]), grad_norm=grad, lr=3e-4, tokens=4096.0, samples=4.0,
                step_time=float(times[r]), data_wait=float(waits[r]))
            out.append(protocol.encode_step(TOKEN, sample))
        messages.append(out)
        step_times.append(times)
    return Run(ranks, messages, step_times)


class Approach(Protocol):
    name: str

    def feed(self, sample: RankStep) -> None: ...

    def finish(self) -> None: ...

    def rows_written(self) -> int: ...


class Naive:
    """Gather everything: StepAggregator + metrics_row with per-rank lists at any world size
    (what babysit did before rows switched to quantiles above ``PER_RANK_LIMIT`` ranks)."""

    name = "naive"

    def __init__(self, world: int, history: int) -> None:
        self.agg = StepAggregator(world)
        self.history: deque[dict[str, Any]] = deque(maxlen=history)
        self.rows = 0
        self.row_bytes = 0
        self.emitted_at: dict[int, float] = {}

    def feed(self, sample: RankStep) -> None:
        for record in self.agg.add(sample):
            self._row(record.step, metrics_row(record, attempt=0, per_rank_limit=UNLIMITED))

    def finish(self) -> None:
        for record in self.agg.flush():
            self._row(record.step, metrics_row(record, attempt=0, per_rank_limit=UNLIMITED))

    def _row(self, step: int, row: dict[str, Any]) -> None:
        self.row_bytes = len(json.dumps(row, separators=(",", ":")))
        self.history.append(row)
        self.rows += 1
        self.emitted_at[step] = time.monotonic()

    def rows_written(self) -> int:
        return self.rows


class Sketch(Naive):
    """Mergeable summaries: SummaryAggregator + StepSummary.to_row + a raw ring of 4 steps."""

    name = "sketch"

    def __init__(self, world: int, history: int) -> None:
        super().__init__(world, history)
        self.summaries = SummaryAggregator(world, keep_raw=KEEP_RAW)
        self.quantiles: dict[int, tuple[float, float]] = {}

    def feed(self, sample: RankStep) -> None:
        for summary in self.summaries.add(sample):
            self._summary_row(summary.step, summary.to_row(attempt=0))

    def finish(self) -> None:
        for summary in self.summaries.flush():
            self._summary_row(summary.step, summary.to_row(attempt=0))

    def _summary_row(self, step: int, row: dict[str, Any]) -> None:
        self.quantiles[step] = (row["step_time_p50"], row["step_time_p99"])
        self._row(step, row)


def make(name: str, world: int, history: int) -> Naive:
    return Sketch(world, history) if name == "sketch" else Naive(world, history)


# -- CPU: real intake in a consumer process ------------------------------------------------------

def consume(path: str, name: str, world: int, history: int, expected: int,
            ready: Any, reply: Connection) -> None:
    approach = make(name, world, history)
    intake = Intake(Path(path), TOKEN).open()
    ready.set()
    received = 0
    cpu0, wall0 = time.process_time(), time.monotonic()
    while received < expected:
        time.sleep(TICK_S)  # the loop's tick: nobody waits on the socket
        for message in intake.drain():
            if isinstance(message, RankStep):
                approach.feed(message)
                received += 1
    approach.finish()
    cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
    reply.send({"cpu_s": cpu, "wall_s": wall, "rows": approach.rows_written(),
                "rejected": sum(intake.rejected.values()), "emitted_at": approach.emitted_at})
    intake.close()


def produce(path: str, run: Run, rate: float | None) -> dict[int, float]:
    """Send every report over ``CONNECTIONS`` real connections; blocking sends, so a full buffer
    waits for the consumer (a real rank would drop instead). Returns when each step was sent."""
    conns: list[socket.socket] = []
    for _ in range(CONNECTIONS):
        sock = connect(path)
        sock.setblocking(True)
        conns.append(sock)
    sent_at: dict[int, float] = {}
    start = time.monotonic()
    for index, step_messages in enumerate(run.messages):
        if rate is not None:
            time.sleep(max(0.0, start + index / rate - time.monotonic()))
        for rank, message in enumerate(step_messages):
            conns[rank % CONNECTIONS].send(message)
        sent_at[index + 1] = time.monotonic()
    for sock in conns:
        sock.close()
    return sent_at


def cpu_pass(run: Run, name: str, history: int, rate: float | None) -> dict[str, Any]:
    ctx = mp.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="babysit-scale-") as tmp:
        path = os.path.join(tmp, "telemetry.sock")
        ready = ctx.Event()
        theirs, ours = ctx.Pipe(duplex=False)
        expected = sum(len(m) for m in run.messages)
        child = ctx.Process(target=consume, args=(path, name, run.ranks, history, expected,
                                                  ready, ours))
        child.start()
        if not ready.wait(30):
            raise RuntimeError("the consumer did not open the intake within 30 s")
        sent_at = produce(path, run, rate)
        result: dict[str, Any] = theirs.recv()
        child.join()
    steps = len(run.messages)
    if result["rows"] != steps or result["rejected"]:
        raise RuntimeError(f"{name}: {result['rows']} rows for {steps} steps, "
                           f"{result['rejected']} rejected")
    lags = [result["emitted_at"][s] - sent_at[s] for s in sent_at]
    return {"cpu_per_s": result["cpu_s"] / steps, "wall_per_s": result["wall_s"] / steps,
            "median_lag_s": float(np.median(lags)), "max_lag_s": max(lags)}


# -- memory and accuracy: in process -------------------------------------------------------------

def memory_pass(run: Run, name: str, history: int) -> tuple[float, float, Naive]:
    approach = make(name, run.ranks, history)
    decode = protocol.decode
    tracemalloc.start()
    for step_messages in run.messages:
        for message in step_messages:
            sample = decode(TOKEN, message)
            assert isinstance(sample, RankStep)
            approach.feed(sample)
    approach.finish()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    ring = approach.summaries.ring.nbytes if isinstance(approach, Sketch) else 0
    return peak / 2**20, ring / 2**20, approach


def errors(run: Run, approach: Naive) -> tuple[float, float]:
    if not isinstance(approach, Sketch):
        return 0.0, 0.0
    worst = [0.0, 0.0]
    for step, times in enumerate(run.step_times, start=1):
        want = np.percentile(times, [50, 99])
        got = approach.quantiles[step]
        for i in range(2):
            worst[i] = max(worst[i], abs(got[i] - want[i]) / want[i])
    return 100 * worst[0], 100 * worst[1]


# -- report --------------------------------------------------------------------------------------

HEADER = ("| ranks | approach | CPU s per simulated s | peak MiB | of which raw ring MiB "
          "| peak without ring MiB | row KiB | p50 err % | p99 err % |")


def table_lines(rows: list[dict[str, Any]]) -> Iterator[str]:
    yield HEADER
    yield "|" + "---|" * HEADER.count(" | ") + "---|"
    for r in rows:
        yield (f"| {r['ranks']:,} | {r['approach']} | {r['cpu_per_s']:.3f} | {r['peak_mib']:.1f} "
               f"| {r['ring_mib']:.1f} | {r['peak_mib'] - r['ring_mib']:.2f} "
               f"| {r['row_kib']:.1f} "
               f"| {r['p50_err']:.3f} | {r['p99_err']:.3f} |")


def machine() -> str:
    return (f"{platform.machine()}, {os.cpu_count()} cores "
            f"({platform.processor() or platform.platform()}), Python {platform.python_version()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--steps", type=int, default=30, help="simulated seconds (1 step/s)")
    parser.add_argument("--history", type=int, default=30, help="rows each approach keeps")
    parser.add_argument("--live-steps", type=int, default=10,
                        help="steps of the real-time check at the largest world (0: skip)")
    parser.add_argument("--markdown", type=Path, help="also write the tables to this file")
    args = parser.parse_args(argv)

    started = time.monotonic()
    rows: list[dict[str, Any]] = []
    for ranks in args.ranks:
        run = simulate(ranks, args.steps)
        for name in ("naive", "sketch"):
            cpu = cpu_pass(run, name, args.history, rate=None)
            peak, ring, approach = memory_pass(run, name, args.history)
            p50, p99 = errors(run, approach)
            rows.append({"ranks": ranks, "approach": name, "cpu_per_s": cpu["cpu_per_s"],
                         "peak_mib": peak, "ring_mib": ring,
                         "row_kib": approach.row_bytes / 1024, "p50_err": p50, "p99_err": p99})
            print(f"  {ranks:>5} ranks  {name:<6}  cpu {cpu['cpu_per_s']:.3f} s/s  "
                  f"peak {peak:.1f} MiB  p50 {p50:.3f}%  p99 {p99:.3f}%", flush=True)

    live: list[str] = []
    if args.live_steps > 0:
        world = max(args.ranks)
        run = simulate(world, args.live_steps, seed=1)
        live.append(f"Live, {world:,} ranks at 1 step/s for {args.live_steps} s:")
        for name in ("naive", "sketch"):
            result = cpu_pass(run, name, args.history, rate=1.0)
            live.append(f"- {name}: {result['cpu_per_s']:.3f} CPU s per s; a step's row comes "
                        f"{result['median_lag_s']:.2f} s (median; max {result['max_lag_s']:.2f} s) "
                        "after its last report was sent")

    lines = [*table_lines(rows), "", *([*live, ""] if live else []),
             f"Machine: {machine()}. Wall time {time.monotonic() - started:.0f} s."]
    print()
    print("\n".join(lines))
    if args.markdown:
        args.markdown.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
