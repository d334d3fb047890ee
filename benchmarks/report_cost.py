"""What one ``run.step()`` report costs the training loop, beside an empty loop, in one run.

    .venv/bin/python benchmarks/report_cost.py [--calls 200000]

A real intake (the supervisor's socket code) drains the reports in a separate process on the
supervisor's 0.1 s tick, so the numbers include the real ``send`` syscall. Each call is timed on
its own with ``perf_counter_ns``; the "empty" row is the same timing around nothing, so the
difference is the report's own cost. Prints median and p99 nanoseconds per call.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from babysit.supervisor.contract import protocol
from babysit.supervisor.node.intake import Intake
from babysit.supervisor.rank.api import attach

TOKEN = os.urandom(protocol.TOKEN_BYTES)


def drain(path: str, ready: mp.synchronize.Event, stop: mp.synchronize.Event,
          counts: mp.sharedctypes.Synchronized) -> None:  # type: ignore[name-defined]
    # Drains on a 0.1 s tick like the supervisor's loop: nobody waits on the socket.
    intake = Intake(Path(path), TOKEN).open()
    ready.set()
    while not stop.is_set():
        time.sleep(0.1)
        counts.value += len(intake.drain())
    counts.value += len(intake.drain())
    intake.close()


def start_drainer() -> tuple[str, Any, Any, mp.Process]:
    """A real intake in a temporary folder, drained by its own process (as the supervisor
    would): its socket path, the event that stops it, its count of received reports, and the
    process. Set the event and join the process when done."""
    sock = os.path.join(tempfile.mkdtemp(prefix="babysit-bench-"), "telemetry.sock")
    ready, stop = mp.Event(), mp.Event()
    received = mp.Value("q", 0)
    drainer = mp.Process(target=drain, args=(sock, ready, stop, received))
    drainer.start()
    ready.wait(10)
    return sock, stop, received, drainer


def timed(fn: Callable[[], object], calls: int) -> list[int]:
    clock = time.perf_counter_ns
    samples = [0] * calls
    for i in range(calls):
        t0 = clock()
        fn()
        samples[i] = clock() - t0
    return samples


def paced(fn: Callable[[], object], calls: int, interval_ns: int) -> list[int]:
    """Like ``timed`` but one call per ``interval_ns``, so the intake keeps up and every report
    takes the delivered path (a real loop reports once per step, far slower than this)."""
    clock = time.perf_counter_ns
    samples = [0] * calls
    next_at = clock()
    for i in range(calls):
        while clock() < next_at:
            pass
        t0 = clock()
        fn()
        samples[i] = clock() - t0
        next_at = t0 + interval_ns
    return samples


def summary(samples: list[int]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered), ordered[int(0.99 * (len(ordered) - 1))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200_000)
    args = parser.parse_args()

    sock, stop, received, drainer = start_drainer()

    os.environ.pop(protocol.ENV_SOCKET, None)
    noop = attach()
    os.environ[protocol.ENV_SOCKET] = sock
    os.environ[protocol.ENV_TOKEN] = TOKEN.hex()
    active = attach()

    rows: list[tuple[str, Callable[[], object]]] = [
        ("empty loop (timer only)", lambda: None),
        ("step() without babysit (no-op)", lambda: noop.step(loss=2.5, grad_norm=0.9, lr=3e-4)),
        ("step() loss only", lambda: active.step(loss=2.5)),
        ("step() loss, grad_norm, lr, tokens", lambda: active.step(
            loss=2.5, grad_norm=0.9, lr=3e-4, tokens=4096)),
    ]
    try:
        import torch

        loss_t = torch.tensor(2.5)
        rows.append(("step() with a CPU tensor loss", lambda: active.step(loss=loss_t)))
        # The forward clock attach(model=...) puts on the model: two hooks per forward, and
        # step() taking the time.
        x = torch.ones(4, 16)
        plain, timed_model = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
        with_model = attach(model=timed_model)
        rows += [("forward of a Linear(16, 16)", lambda: plain(x)),
                 ("  same, timed by attach(model=)", lambda: timed_model(x)),
                 ("  same + step() loss only", lambda: (timed_model(x),
                                                        with_model.step(loss=2.5)))]
    except ImportError:
        pass

    # Interleave rounds so machine noise hits every row alike; report medians over all calls.
    results: dict[str, list[int]] = {name: [] for name, _ in rows}
    rounds = 5
    for _ in range(rounds):
        for name, fn in rows:
            results[name] += timed(fn, args.calls // rounds)

    dropped_before, received_before = active.dropped, received.value
    full = ("step() loss, grad_norm, lr, tokens", lambda: active.step(
        loss=2.5, grad_norm=0.9, lr=3e-4, tokens=4096))
    paced_name = "  same, paced at 2k reports/s"
    results[paced_name] = []
    for _ in range(rounds):
        results[paced_name] += paced(full[1], args.calls // (40 * rounds), 500_000)
    rows.append((paced_name, full[1]))
    time.sleep(0.5)
    paced_dropped = active.dropped - dropped_before

    stop.set()
    drainer.join(10)
    base_median, _ = summary(results[rows[0][0]])
    print(f"{'call':40s} {'median ns':>10s} {'p99 ns':>10s} {'median - empty':>15s}")
    for name, _ in rows:
        median, p99 = summary(results[name])
        print(f"{name:40s} {median:10.0f} {p99:10.0f} {median - base_median:15.0f}")
    print(f"\nunpaced rows: {args.calls} back-to-back calls each; the intake took "
          f"{received_before} and the workers dropped {dropped_before} (queue full, by design "
          f"never waiting). Paced row: {paced_dropped} dropped.")


if __name__ == "__main__":
    main()
