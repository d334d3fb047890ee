"""What the run's one history of states costs: the store's bookkeeping per save and per step,
and the time to choose a state with many on record.

    .venv/bin/python benchmarks/lineage_store.py [--states 1000] [--repeats 10]

On a real checkpoint folder in a temporary directory (states committed by the real commit
path, one small file each, so that the figures are the bookkeeping's, not the bytes'), with
``--states`` states spread over timelines that a rollback forked every 50 steps (those a
rollback abandoned stay on record, fenced), it prints the medians of ``--repeats`` runs, side
by side:

    choose      ``Catalog.choose_for_rollback(None, allow_pending=True)``: list every state,
                read the lineage, judge each live or fenced, verify the one chosen (CRC-32)
    choose (no lineage)  the same folder with ``lineage.json`` removed: what the choice cost
                before lineage was kept (every state live)
    per save (rank)      what a rank's save adds: the current timeline read from the folder
                when the directive names none (``lineage.current``); with a directive, nothing
    per save (supervisor)  ``Catalog.retain`` after a commit: the retention pass that now also
                sweeps fenced states first
    per step    nothing: the lineage is read at a save, a launch and a choice, never per step;
                a memory copy's agreement is one small all_gather per copy (docs/recovery.md)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from babysit.checkpoints import Catalog, lineage, step_dir
from babysit.checkpoints.layout import rank_state_name
from babysit.checkpoints.save import commit, hash_part


def build(root: Path, states: int) -> None:
    """``states`` committed states, one every 2 steps; every 100 steps trained a rollback goes
    back 50 and the new timeline saves at the other parity, so the abandoned states stay on
    record (fenced) beside the live ones."""
    history = lineage.begin(root, None, 0, 0)
    step, made, parity, fork_at = 0, 0, 0, 100
    while made < states:
        step += 1
        if step == fork_at:  # the rollback: back 50 steps; the next one 100 steps on
            history = lineage.begin(root, history.current, step - 51, made)
            step, parity, fork_at = step - 50, 1 - parity, fork_at + 100
        if step % 2 != parity:
            continue
        path = step_dir(root, step)
        if path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True)
        (path / rank_state_name(0)).write_bytes(os.urandom(64))
        commit(path, [hash_part(path, 0)], {"step": step, "cursor": step, "lr_scale": 1.0,
                                            "world_size": 1, "timeline": history.current})
        made += 1


def timed(fn, repeats: int) -> float:
    runs = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - started)
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--states", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="babysit-lineage-bench-") as tmp:
        root = Path(tmp) / "ckpt"
        build(root, args.states)
        catalog = Catalog(root)
        listed = catalog.checkpoints()
        fenced = sum(c.fenced for c in listed)
        choose = timed(lambda: catalog.choose_for_rollback(None, allow_pending=True),
                       args.repeats)
        current = timed(lambda: lineage.current(root), args.repeats * 10)
        history = lineage.read(root)
        saved = (root / "lineage.json").read_bytes()
        (root / "lineage.json").unlink()
        bare = timed(lambda: catalog.choose_for_rollback(None, allow_pending=True), args.repeats)
        (root / "lineage.json").write_bytes(saved)
        retain = timed(lambda: catalog.retain(10_000), args.repeats)  # deletes nothing live
        print(f"{len(listed)} states on record ({fenced} fenced), "
              f"{len(history.timelines)} timelines; medians of {args.repeats}")
        print(f"  choose                 {choose * 1e3:8.1f} ms")
        print(f"  choose (no lineage)    {bare * 1e3:8.1f} ms   ratio {choose / bare:.2f}")
        print(f"  per save (rank)        {current * 1e6:8.1f} us   (lineage.current; none "
              "with a directive)")
        print(f"  per save (supervisor)  {retain * 1e3:8.1f} ms   (retention, after the fenced "
              "states are gone)")
        print("  per step                    0      (nothing is read or written per step)")


if __name__ == "__main__":
    main()
