"""The control loop on its own: ``Supervisor`` driven by members a test scripts, no processes.

The loop decides; its members (``run.members``) launch, stop and report. Here the members are a
script of what each tick gathers, so the loop's decisions (what it launches, stops, journals and
returns) are checked in milliseconds.
"""

from __future__ import annotations

import io
import json
import os
import signal
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from babysit.policies.rollback import Shelf
from babysit.policies.types import Finding, Incident, RankStep, Remedy, Severity, StepRecord
from babysit.supervisor.config import plan as plan_mod
from babysit.supervisor.contract.directive import Directive
from babysit.supervisor.contract.protocol import WorkerEvent
from babysit.supervisor.node import standby
from babysit.supervisor.node.aggregate import metrics_row
from babysit.supervisor.node.stacks import Diagnosis
from babysit.supervisor.run import loop as loop_mod
from babysit.supervisor.run.console import Console
from babysit.supervisor.run.loop import Supervisor
from babysit.supervisor.run.members import Gathered, JobEnd, Voice


class ScriptedMembers:
    """Members whose every tick gathers the next item of ``script`` (then nothing)."""

    scope = "all"

    def __init__(self, script: list[Gathered], launch_fields: dict[str, Any] | None = None) -> None:
        self.script = script
        self.launch_fields = launch_fields or {}
        self.launches: list[tuple[int, Directive]] = []
        self.kept: list[bool] = []
        """Each launch's ``keep_nodes``: only a rerun keeps the previous attempt's nodes."""
        self.stops: list[str] = []
        self.tick: Callable[[], int] = lambda: 0
        """The loop's tick now (``LoopTicks``); ``at`` says in which tick each launch, stop
        and gather came."""
        self.at: list[tuple[str, int]] = []
        self.closed: int | None = None
        self.up = False

    def open(self) -> None:
        pass

    def ready(self, voice: Voice) -> None:
        pass

    def launch(self, attempt: int, directive: Directive, now: float,
               keep_nodes: bool = False) -> dict[str, Any]:
        self.launches.append((attempt, directive))
        self.kept.append(keep_nodes)
        self.at.append((f"launch {attempt}", self.tick()))
        self.up = True
        return {"pid": 4242, "command": ["torchrun", "train.py"], **self.launch_fields}

    def stop(self, reason: str, *, replacing: bool = False) -> int | None:
        self.stops.append(reason)
        self.at.append(("stop, replacing" if replacing else "stop", self.tick()))
        self.up = False
        return -15

    def request(self, **fields: Any) -> None:
        pass

    def keep_last_step(self, fault: str) -> None:
        return None  # the run keeps no last step of its own

    def gather(self, now: float, watching: bool) -> Gathered:
        self.at.append(("gather" if watching else "drain", self.tick()))
        return self.script.pop(0) if self.script and watching else Gathered()

    def diagnosis(self, finding: Finding) -> Diagnosis | None:
        return None

    def tails(self, attempt: int) -> dict[int, str]:
        return {}

    def locate(self, finding: Finding) -> Finding:
        return finding

    def hear(self, entry: Mapping[str, Any]) -> None:
        pass

    def shelf(self, finding: Finding, catalog: Shelf) -> Shelf | None:
        return catalog

    def shape_remedy(self, remedy: Remedy) -> Remedy:
        return remedy

    def prepare(self, remedy: Remedy | None, attempt: int) -> list[tuple[str, dict[str, Any]]]:
        return []

    def pids(self) -> list[int]:
        return [4242] if self.up else []

    def live_nodes(self) -> list[int]:
        return [0]

    def rank_pids(self) -> tuple[int, ...]:
        return ()

    def running(self) -> bool:
        return self.up

    def output(self) -> Iterator[str]:
        return iter(())

    def close(self, code: int | None) -> list[tuple[str, dict[str, Any]]]:
        first = self.closed is None
        self.closed = code
        # What a real node says when a warm standby was still waiting (once: closing twice is
        # allowed and stops nothing more).
        return [("standby_stopped", {"for_attempt": 1, "reason": "the run ended"})] \
            if first else []


class LoopTicks:
    """Stands in for the loop module's ``time``: counts the loop's ticks (its sleeps)."""

    def __init__(self) -> None:
        self.ticks = 0

    def sleep(self, seconds: float) -> None:
        self.ticks += 1
        time.sleep(seconds)

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def steps(attempt: int, first: int, last: int, loss: float = 2.0) -> Gathered:
    """Healthy steps ``first..last`` of a 2-rank job, one report per rank."""
    out = Gathered(newest=last)
    for step in range(first, last + 1):
        ranks = tuple(RankStep(rank=r, step=step, time=float(step), cursor=step, loss=loss,
                               step_time=0.1) for r in (0, 1))
        record = StepRecord(step=step, time=float(step), ranks=ranks, world_size=2)
        out.steps.append((record, metrics_row(record, attempt)))
    return out


def hello(rank: int) -> WorkerEvent:
    return WorkerEvent(rank=rank, type="hello", time=0.0, data={"world_size": 2, "pid": 1})


@pytest.fixture
def plan(tmp_path: Path) -> plan_mod.RunPlan:
    config = tmp_path / "run.yaml"
    (tmp_path / "train.py").write_text("")  # never run: the members are scripted
    config.write_text(f"launch: {{script: train.py, nproc-per-node: 2}}\n"
                      f"run_dir: {tmp_path / 'run'}\n")
    return plan_mod.from_file(config)


def run(plan: plan_mod.RunPlan, members: ScriptedMembers,
        console: io.StringIO | None = None) -> tuple[int, list[dict[str, Any]]]:
    code = Supervisor(plan, Console(console or io.StringIO(), tty=False), members=members).run()
    lines = (plan.run_dir / "events.jsonl").read_text().splitlines()
    return code, [json.loads(line) for line in lines]


def test_a_clean_end_finishes_the_run_and_closes_the_members(plan: plan_mod.RunPlan) -> None:
    first = steps(0, 1, 5)
    first.events = [hello(0), hello(1)]
    members = ScriptedMembers([first, steps(0, 6, 10), Gathered(end=JobEnd(0))])

    code, journal = run(plan, members)

    assert code == 0 and members.closed == 0
    assert [a for a, _ in members.launches] == [0]
    assert journal[-1]["event"] == "run_finished" and journal[-1]["state"] == "succeeded"
    # What closing stopped is journaled once, before run_finished, the journal's last word.
    assert [e["event"] for e in journal[-3:]] == ["standby_stopped", "goodput", "run_finished"]
    rows = (plan.run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == list(range(1, 11))


def test_a_hang_a_member_names_is_relaunched_from_the_directive(
        plan: plan_mod.RunPlan, monkeypatch: pytest.MonkeyPatch) -> None:
    hang = Finding(incident=Incident.HANG, detector="hang", severity=Severity.CRITICAL,
                   step=5, onset_step=5, ranks=(1,), message="hang at step 5: rank 1 is stuck")
    stuck = steps(0, 1, 5)
    stuck.findings = [hang]
    members = ScriptedMembers([stuck, steps(1, 1, 3), Gathered(end=JobEnd(0))])
    ticks = LoopTicks()
    monkeypatch.setattr(loop_mod, "time", ticks)
    members.tick = lambda: ticks.ticks

    code, journal = run(plan, members)

    assert code == 0
    assert [a for a, _ in members.launches] == [0, 1]  # relaunched, once
    assert members.kept == [False, False]  # not a rerun: on whatever nodes are there
    # Stopped to be replaced, what the stopped ranks sent last taken in, and replaced, all in
    # the tick that found the hang: a hang has no backoff to wait.
    assert members.at[:5] == [("launch 0", 0), ("gather", 1), ("stop, replacing", 1),
                              ("drain", 1), ("launch 1", 1)]
    (finding,) = [e for e in journal if e["event"] == "finding"]
    assert finding["finding"]["ranks"] == [1] and finding["remedy"]["action"] == "relaunch"
    assert [e["attempt"] for e in journal if e["event"] == "launch"] == [0, 1]


@pytest.mark.parametrize("off, told", [
    ("the rendezvous endpoint is fixed (launch.rdzv_endpoint or master_port)", True),
    (standby.CONFIGURED_OFF, False),  # the user's own choice
])
def test_why_relaunches_start_cold_is_said_once(plan: plan_mod.RunPlan, off: str,
                                                 told: bool) -> None:
    hang = Finding(incident=Incident.HANG, detector="hang", severity=Severity.CRITICAL,
                   step=5, onset_step=5, ranks=(1,), message="hang at step 5: rank 1 is stuck")
    stuck = steps(0, 1, 5)
    stuck.findings = [hang]
    members = ScriptedMembers([stuck, steps(1, 1, 3), Gathered(end=JobEnd(0))],
                              {"standby": False, "standby_off": off})
    console = io.StringIO()

    code, journal = run(plan, members, console)

    assert code == 0
    assert [e["standby_off"] for e in journal if e["event"] == "launch"] == [off, off]
    assert console.getvalue().count(f"relaunches will start cold: {off}") == (1 if told else 0)


def test_a_user_code_crash_stops_the_run_with_its_exit_code(plan: plan_mod.RunPlan) -> None:
    tails = {0: "RuntimeError: Connection reset by peer",
             1: 'Traceback (most recent call last):\n  File "train.py", line 3\n'
                "ZeroDivisionError: division by zero"}
    members = ScriptedMembers([steps(0, 1, 3), Gathered(end=JobEnd(1, tails, root=0))])

    code, journal = run(plan, members)

    assert code == 1 and members.closed == 1
    (finding,) = [e for e in journal if e["event"] == "finding"]
    # The most specific verdict names the rank, not torchrun's first noticed exit.
    assert finding["finding"]["ranks"] == [1]
    assert finding["finding"]["evidence"]["class"] == "user_code"
    assert journal[-1]["state"] == "failed"


def test_the_crash_line_says_the_step_the_just_in_time_state_knew(
        plan: plan_mod.RunPlan) -> None:
    """The merged steps lag (the last reports of a fast loop not in when the workers exited):
    the steps judged end at 20, the keepers' just-in-time state, gathered as the ranks ended, is
    of step 23. The crash struck after step 23, and the console and the finding say so."""
    tails = {1: 'Traceback (most recent call last):\n  File "train.py", line 3\n'
                "ZeroDivisionError: division by zero"}
    kept = {"fault": "crash", "outcome": "saved", "checkpoint_step": 23, "writers": [0],
            "summary": "just-in-time state of step 23 written by rank 0 after the crash"}
    ending = Gathered(end=JobEnd(1, tails, root=1), entries=[("just_in_time", kept)])
    members = ScriptedMembers([steps(0, 1, 20), ending])
    console = io.StringIO()

    code, journal = run(plan, members, console)

    assert code == 1
    (finding,) = [e for e in journal if e["event"] == "finding"]
    assert finding["finding"]["step"] == 23
    [line] = [line for line in console.getvalue().splitlines() if "crash of rank 1" in line]
    assert "user_code crash of rank 1 at step 23: ZeroDivisionError" in line, line


class Preempted(ScriptedMembers):
    """Members that send the supervisor SIGTERM in their second tick, then save the final
    checkpoint the loop asks for (in a tick that only drains: the loop judges nothing then)."""

    def __init__(self, script: list[Gathered]) -> None:
        super().__init__(script)
        self.requests: list[dict[str, Any]] = []
        self.gathers = 0

    def request(self, **fields: Any) -> None:
        self.requests.append(fields)

    def gather(self, now: float, watching: bool) -> Gathered:
        self.gathers += 1
        if self.gathers == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # caught by the supervisor's handler
        if self.requests and not watching and self.up:
            self.requests.append({"answered": True})
            final = WorkerEvent(rank=0, type="checkpoint", time=0.0,
                                data={"step": 7, "final": True, "blocking_s": 0.1})
            return Gathered(events=[final]) if len(self.requests) == 2 else Gathered()
        return super().gather(now, watching)


def test_a_sigterm_waits_for_the_final_checkpoint_while_the_ticks_go_on(
        tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    (tmp_path / "train.py").write_text("")
    config.write_text(f"launch: {{script: train.py, nproc-per-node: 2}}\n"
                      f"checkpoints: {{every_steps: 5, final_grace_s: 30}}\n"
                      f"run_dir: {tmp_path / 'run'}\n")
    members = Preempted([steps(0, 1, 5), steps(0, 6, 6), steps(0, 7, 7)])

    code, journal = run(plan_mod.from_file(config), members)

    assert code == 128 + signal.SIGTERM
    assert "final_checkpoint" in members.requests[0]
    events = [e["event"] for e in journal]
    asked = events.index("final_checkpoint_requested")
    assert events.index("checkpoint_saved") > asked
    (final,) = [e for e in journal if e["event"] == "final_checkpoint"]
    assert final["saved"] is True and final["checkpoint_step"] == 7
    assert members.stops and journal[-1]["state"] == "stopped"
