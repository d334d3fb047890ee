"""Where the test suite's CPU goes: each test's wall time and the CPU of the processes it ran.

    rm -rf /tmp/babysit-suite-cpu
    .venv/bin/python -m pytest -p benchmarks.suite_cpu -q -n 2 --dist loadfile \
        --no-loadscope-reorder
    .venv/bin/python benchmarks/suite_cpu.py [--top 30] [FOLDER]

(``python -m pytest``, not ``pytest``: the checkout's folder must be on the path for ``-p``.)

The suite is bound by its CPU, nearly all of it the interpreters its tests start (each rank's
``import torch``, each torchrun's), so its wall time follows what its files spend, not how long
they wait. As a pytest plugin (``-p benchmarks.suite_cpu``, any ``-n``) this writes one JSON
line per test into ``FOLDER/<xdist worker>.jsonl`` (``BABYSIT_SUITE_CPU``, default
``/tmp/babysit-suite-cpu``, emptied first by whoever starts a measurement): its wall seconds,
the CPU-seconds of the test's own process (``self``) and of every child process it waited for,
with their waited-for children (``children``, from ``getrusage(RUSAGE_CHILDREN)``: babysitters,
torchruns, ranks; not what a daemon started, such as the Slurm cluster's ranks). Run as a
script it prints the files by CPU, most first, and the totals, the table of
``docs/measured.md#ci``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

FOLDER = Path(os.environ.get("BABYSIT_SUITE_CPU", "/tmp/babysit-suite-cpu"))


def _cpu() -> tuple[float, float]:
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    own = resource.getrusage(resource.RUSAGE_SELF)
    return children.ru_utime + children.ru_stime, own.ru_utime + own.ru_stime


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[Any]:
    start, (children, own) = time.monotonic(), _cpu()
    try:
        return (yield)
    finally:
        children_after, own_after = _cpu()
        FOLDER.mkdir(parents=True, exist_ok=True)
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(FOLDER / f"{worker}.jsonl", "a") as out:
            out.write(json.dumps({"test": item.nodeid, "wall": time.monotonic() - start,
                                  "children": children_after - children,
                                  "self": own_after - own}) + "\n")


def by_file(rows: list[dict[str, Any]]) -> list[tuple[str, float, float, int]]:
    """(file, wall seconds, CPU-seconds, tests) per test file, the most CPU first."""
    files: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0.0])
    for row in rows:
        totals = files[row["test"].split("::", 1)[0]]
        totals[0] += row["wall"]
        totals[1] += row["children"] + row["self"]
        totals[2] += 1
    return sorted(((name, wall, cpu, int(n)) for name, (wall, cpu, n) in files.items()),
                  key=lambda f: -f[2])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", nargs="?", type=Path, default=FOLDER)
    parser.add_argument("--top", type=int, default=30, help="files to list (default 30)")
    args = parser.parse_args(argv)
    rows = [json.loads(line) for path in sorted(args.folder.glob("*.jsonl"))
            for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        print(f"no measurements in {args.folder}: run pytest with -p benchmarks.suite_cpu "
              f"first (BABYSIT_SUITE_CPU names the folder)", file=sys.stderr)
        return 1
    files = by_file(rows)
    print(f"{'wall s':>8} {'CPU s':>8} {'tests':>6}  file")
    for name, wall, cpu, n in files[:args.top]:
        print(f"{wall:8.1f} {cpu:8.1f} {n:6d}  {name}")
    wall, cpu = sum(f[1] for f in files), sum(f[2] for f in files)
    print(f"{len(rows)} tests in {len(files)} files: {wall:.0f} s of test time, {cpu:.0f} "
          f"CPU-seconds in their processes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
