"""Incident folders: layout, numbering across calls, and a summary a person can read."""

from __future__ import annotations

import json
from pathlib import Path

from babysit.policies.types import Action, Finding, Incident, Remedy, Severity
from babysit.supervisor.node.incident import incident_name, next_number, write_incident
from babysit.supervisor.node.stacks import (
    Diagnosis,
    Frame,
    StackDump,
    StackVerdict,
    ThreadStack,
    odd_one_out,
)

RAW0 = """Process 11: python -u train.py
Python v3.11.7 (/usr/bin/python3.11)

Thread 11 (idle): "MainThread"
    all_reduce (torch/distributed/distributed_c10d.py:3252)
    main (train.py:51)
"""


def stacks() -> dict[int, StackDump]:
    waiting = ThreadStack(11, "MainThread", "idle", (
        Frame("all_reduce", "torch/distributed/distributed_c10d.py", 3252),
        Frame("main", "train.py", 51)))
    stuck = ThreadStack(12, "MainThread", "idle", (Frame("main", "train.py", 45),))
    return {0: StackDump(0, 11, raw=RAW0, threads=(waiting,)),
            1: StackDump(1, 12, raw="Thread 12 ...\n", threads=(stuck,)),
            2: StackDump(2, 13, error="Permission Denied", hint="run as the same user")}


def finding(incident: Incident, step: int, message: str = "") -> Finding:
    return Finding(incident, incident.value, Severity.CRITICAL, step, step,
                   message or f"{incident.value} at step {step}")


def test_layout_and_contents(tmp_path: Path) -> None:
    dumps = stacks()
    verdict = odd_one_out(dumps)
    hang = finding(Incident.HANG, 5, "no rank made progress for 95 s (limit 60 s)")
    remedy = Remedy(Action.RELAUNCH, hang, "a hang: relaunch from the last good checkpoint")
    folder = write_incident(tmp_path, 0, hang, remedy, Diagnosis(dumps, verdict),
                            {0: "step 4\n", 1: "rank 1: injected hang\n"})
    assert folder == tmp_path / "incidents" / "0001-hang-step5"
    assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()) == [
        "logs/rank0.tail.txt", "logs/rank1.tail.txt", "stacks/rank0.txt", "stacks/rank1.txt",
        "stacks/rank2.txt", "summary.json", "summary.txt"]
    assert (folder / "stacks" / "rank0.txt").read_text() == RAW0
    assert "Permission Denied" in (folder / "stacks" / "rank2.txt").read_text()
    assert (folder / "logs" / "rank1.tail.txt").read_text() == "rank 1: injected hang\n"

    record = json.loads((folder / "summary.json").read_text())
    assert (record["incident"], record["kind"], record["step"]) == ("0001-hang-step5", "hang", 5)
    assert record["summary"]["attempt"] == 0
    assert record["summary"]["finding"]["message"] == hang.message
    assert record["summary"]["remedy"]["action"] == "relaunch"
    assert record["verdict"]["suspects"] == [1] and record["verdict"]["waiting"] == [0]
    assert record["stacks"]["2"]["error"] == "Permission Denied"
    assert record["stacks"]["0"]["main_thread"][0].startswith("all_reduce (")

    text = (folder / "summary.txt").read_text()
    assert text.startswith("incident 0001-hang-step5: hang at step 5\n")
    assert "what happened: no rank made progress for 95 s" in text
    assert "which rank:    rank 1\n" in text and "outside any collective" in text
    assert "rank 1  [suspect]\n    main (train.py:45)" in text
    assert "rank 0  [waiting in a collective]" in text
    assert "rank 2: no stack: Permission Denied; run as the same user" in text
    assert "what babysit did: relaunch: a hang: relaunch from the last good checkpoint" in text
    assert "attempt: 0" in text


def test_numbering_continues_across_calls(tmp_path: Path) -> None:
    first = write_incident(tmp_path, 0, finding(Incident.HANG, 5), "relaunch", None, {})
    second = write_incident(tmp_path, 1, finding(Incident.CRASH, 9, "rank 0 exited 1"),
                            "reported to the leader", None, {0: "Traceback ...\n"})
    (tmp_path / "incidents" / "notes").mkdir()  # a stray folder does not break the count
    third = write_incident(tmp_path, 2, finding(Incident.LOSS_SPIKE, 120), "rollback", None, {})
    assert [first.name, second.name, third.name] == [
        "0001-hang-step5", "0002-crash-step9", "0003-loss_spike-step120"]
    # No stacks and no verdict: only what exists is written, and the summary says so.
    assert not (first / "stacks").exists() and not (first / "logs").exists()
    assert (second / "logs" / "rank0.tail.txt").exists()
    text = (second / "summary.txt").read_text()
    assert "what happened: rank 0 exited 1" in text and "which rank" not in text
    assert "what babysit did: reported to the leader" in text


def test_pure_naming_helpers() -> None:
    assert incident_name(7, "hang", 0) == "0007-hang-step0"
    assert incident_name(12345, "../etc", 1) == "12345-etc-step1"
    assert incident_name(3, "Loss Spike!", 120) == "0003-loss_spike-step120"
    assert next_number([]) == 1
    assert next_number(["0002-hang-step3", "0010-crash", "README", "x-1"]) == 11


def test_a_verdict_without_suspects_reads_plainly(tmp_path: Path) -> None:
    verdict = StackVerdict((), "all ranks are in the same place: main (train.py:45); no rank "
                          "stands out", {0: ["main (train.py:45)"]}, (), "same")
    folder = write_incident(tmp_path, 0, finding(Incident.HANG, 3), "relaunch",
                            Diagnosis({}, verdict), {})
    text = (folder / "summary.txt").read_text()
    assert "which rank:    none stands out" in text and "all ranks are in the same place" in text
