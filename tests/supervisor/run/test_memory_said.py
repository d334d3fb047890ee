"""What a person is told of the memory copies (``run/record.py``, ``run/console.py``,
``babysit status``): copies that are off said once a run, not at every relaunch; the first copy
that failed said on the console, the later ones counted, and shown by ``babysit status``."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from babysit.checkpoints import Catalog
from babysit.policies import decide as sm
from babysit.policies.loader import load_policy
from babysit.supervisor.commands.status import status_main
from babysit.supervisor.contract.protocol import WorkerEvent
from babysit.supervisor.run.console import Console
from babysit.supervisor.run.members import Gathered
from babysit.supervisor.run.record import Record
from babysit.supervisor.run.recovery import Recovery
from babysit.supervisor.run.watch import Watch

FULL = "OSError: [Errno 28] No space left on device: '/dev/shm/babysit-x-n0/memory/step_20'"


def _record(run_dir: Path) -> tuple[Record, list[sm.Machine], io.StringIO]:
    """A run's record with its console listening, as the loop wires it; the machine it reads
    its attempt from (``machine[0]``)."""
    machine = [sm.Machine(attempt=0)]
    record = Record(run_dir, Watch(load_policy("default")),
                    Recovery(Catalog(run_dir / "c"), probation_steps=5, keep=3), 2,
                    where=lambda: machine[0], warn=lambda title: None)
    out = io.StringIO()
    console = Console(out, tty=False)
    record.journal.listen(console.hear, Console.HEARS)
    record.open()
    record.write("run_started", name="t", run_dir=str(run_dir), source="test", pid=1,
                 resumed_journal=False)
    return record, machine, out


def _events(*events: tuple[int, str, dict[str, Any]]) -> Gathered:
    return Gathered(events=[WorkerEvent(rank=r, type=kind, time=0.0, data=data)
                            for r, kind, data in events])


def test_the_first_failed_copy_is_said_the_later_ones_counted_and_status_shows_them(
        tmp_path: Path) -> None:
    record, machine, out = _record(tmp_path)
    record.take(_events((0, "memory_copy_plan", {"every": 10, "auto": False,
                                                 "node_bytes": {"0": 3000}, "copies": 3})),
                judging=False)
    record.take(_events((1, "memory_copy_failed", {"step": 20, "error": FULL}),
                        (0, "memory_copy_failed", {"step": 20, "error": FULL})), judging=False)
    machine[0] = sm.Machine(attempt=1)  # a relaunch: its failures counted, not said
    record.take(_events((1, "memory_copy_failed", {"step": 30, "error": "OSError: EIO"})),
                judging=False)
    record.close()

    said = [line for line in out.getvalue().splitlines() if "failed" in line]
    assert said == [f"babysit: rank 1's memory copy of step 20 failed: {FULL}. Training goes on "
                    "without it; later failures are counted in `babysit status`, not said "
                    "here. /dev/shm is full: give the node a larger one (docker run "
                    "--shm-size), or set checkpoints.memory_every_steps: 0."]
    status = io.StringIO()
    assert status_main(str(tmp_path), False, status) == 0
    assert (f"3 failed (the first, rank 1's of step 20: {FULL})") in status.getvalue()


def test_copies_that_are_off_are_said_once_a_run(tmp_path: Path) -> None:
    record, machine, out = _record(tmp_path)
    why = "the copies need about 1.2 GiB on node 0 (...), more than the {} free in /dev/shm"
    for attempt in range(3):  # each attempt's rank 0 says it at its first copy, its figures
        machine[0] = sm.Machine(attempt=attempt)  # a little different
        record.take(_events((0, "memory_copy_off", {"why": why.format(f"{attempt} MiB")})),
                    judging=False)
    record.close()
    assert out.getvalue().count("babysit: no memory copies:") == 1
    assert f"babysit: no memory copies: {why.format('0 MiB')}" in out.getvalue()
    why = why.format("2 MiB")  # status: the newest attempt's
    status = io.StringIO()
    assert status_main(str(tmp_path), False, status) == 0
    assert f"no copies: {why}" in status.getvalue()
