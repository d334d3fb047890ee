"""What a torchrun started ahead costs to start, against a plain import of torch's launcher.

    .venv/bin/python benchmarks/ahead_start.py [--repeats 10]

A relaunch that no warm standby serves takes a torchrun started ahead
(``supervisor/node/ahead.py``): an interpreter that imported ``torch.distributed.run`` while
the attempt before it ran, and waits for its order. That start is CPU taken from the running
job's node. This starts, alternately and ``--repeats`` times each:

    ahead    ``python -m babysit.supervisor.node.ahead``, its standard input closed at once
             (it imports torch's launcher, reads an empty line, and ends: the whole start)
    import   ``python -c "from torch.distributed import run"`` (the same import, Python's
             collector left on as it comes)

and prints each one's median CPU-seconds (user + system, from ``getrusage`` of the child) and
wall seconds, and their ratio. Run it on a quiet machine: it measures CPU, but the wall time
follows whatever else runs.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time

COMMANDS = {
    "ahead": [sys.executable, "-m", "babysit.supervisor.node.ahead"],
    "import": [sys.executable, "-c", "from torch.distributed import run"],
}


def _one(command: list[str]) -> tuple[float, float]:
    """(CPU-seconds, wall seconds) of one run of ``command`` with its stdin closed."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(command, stdin=subprocess.DEVNULL, check=True,
                   env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    for command in COMMANDS.values():  # caches warm, byte-code written: not measured
        _one(command)
    got: dict[str, list[tuple[float, float]]] = {name: [] for name in COMMANDS}
    for i in range(args.repeats):
        for name, command in COMMANDS.items():
            got[name].append(_one(command))
        print(f"  {i + 1}/{args.repeats}", file=sys.stderr, flush=True)
    medians = {name: (statistics.median(c for c, _ in runs), statistics.median(w for _, w in runs))
               for name, runs in got.items()}
    print(f"{'':8} {'CPU-s':>7} {'wall s':>7}   (medians of {args.repeats}, side by side)")
    for name, (cpu, wall) in medians.items():
        print(f"{name:8} {cpu:7.3f} {wall:7.3f}")
    print(f"ahead / import: CPU {medians['ahead'][0] / medians['import'][0]:.2f}, "
          f"wall {medians['ahead'][1] / medians['import'][1]:.2f}")


if __name__ == "__main__":
    main()
