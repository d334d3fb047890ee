"""A SIGTERM's final checkpoint (``run.preemption.Preemption``): when it is asked for, what ends
the wait, and what is said when none comes. The loop's side is in test_loop.py."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

from babysit.checkpoints import Catalog
from babysit.supervisor.config.schema import CheckpointConfig
from babysit.supervisor.node.last_step import Outcome
from babysit.supervisor.run.preemption import Preemption


class Said:
    """What a ``Preemption`` journals, logs, warns and asks of the ranks."""

    def __init__(self) -> None:
        self.entries: list[tuple[str, dict[str, Any]]] = []
        self.warnings: list[str] = []
        self.requests: list[dict[str, Any]] = []
        self.lines: list[str] = []

    def preemption(self, tmp_path: Path, grace: Callable[[float], float] | None = None,
                   keep: Callable[[str], Outcome | None] | None = None,
                   **config: Any) -> Preemption:
        extra: dict[str, Any] = {"grace": grace} if grace else {}
        if keep is not None:
            extra["keep"] = keep
        return Preemption(CheckpointConfig(**config), Catalog(tmp_path / "ckpt"),
                          journal=lambda event, **f: self.entries.append((event, f)),
                          log=self.lines.append, warn=self.warnings.append,
                          request=lambda **f: self.requests.append(f),
                          newest_step=lambda: 42, **extra)


def saved(step: int, final: bool = True) -> dict[str, Any]:
    return {"event": "checkpoint_saved", "checkpoint_step": step,
            "data": {"step": step, "final": final}}


def test_a_sigterm_while_training_waits_for_the_final_checkpoint(tmp_path: Path) -> None:
    said = Said()
    p = said.preemption(tmp_path, every_steps=100, final_grace_s=30)

    assert p.signal(signal.SIGTERM, now=0.0, running=True) is None
    assert p.waiting
    (request,) = said.requests
    assert set(request) == {"final_checkpoint"}
    assert said.entries == [("final_checkpoint_requested", {"grace_s": 30, "newest_step": 42})]
    assert p.tick(1.0, running=True) is None
    p.hear(saved(45, final=False))  # a cadence save is not the one asked for
    assert p.tick(2.0, running=True) is None
    p.hear(saved(47))
    assert p.tick(3.0, running=True) == signal.SIGTERM
    assert not p.waiting
    assert said.entries[-1] == ("final_checkpoint", {"saved": True, "checkpoint_step": 47,
                                                     "just_in_time": False})
    assert said.warnings == []


def test_a_wait_that_runs_out_says_what_the_next_run_resumes_from(tmp_path: Path) -> None:
    said = Said()
    p = said.preemption(tmp_path, every_steps=100, final_grace_s=30)
    p.signal(signal.SIGTERM, now=0.0, running=True)
    # A second signal during the wait is remembered, and ends the run when the wait is over.
    assert p.signal(signal.SIGINT, now=1.0, running=True) is None

    assert p.tick(29.9, running=True) is None
    assert p.tick(30.0, running=True) == signal.SIGINT
    assert [e for e, _ in said.entries] == ["final_checkpoint_requested", "final_checkpoint",
                                           "final_checkpoint_missing"]
    missing = said.entries[-1][1]
    assert missing["checkpoint_step"] is None and "final_grace_s = 30 s" in missing["reason"]
    (warning,) = said.warnings
    assert "no final checkpoint" in warning and "starts from scratch" in warning


def test_workers_that_exit_first_end_the_wait(tmp_path: Path) -> None:
    said = Said()
    p = said.preemption(tmp_path, every_steps=100, final_grace_s=30)
    p.signal(signal.SIGTERM, now=0.0, running=True)

    assert p.tick(1.0, running=False) == signal.SIGTERM
    assert said.entries[-1][1]["reason"] == "the workers exited first"


def test_no_wait_when_there_can_be_no_checkpoint_or_nothing_runs(tmp_path: Path) -> None:
    said = Said()
    off = said.preemption(tmp_path, every_steps=0, final_grace_s=30)
    assert off.signal(signal.SIGTERM, now=0.0, running=True) == signal.SIGTERM
    assert not off.waiting and said.requests == []
    (warning,) = said.warnings
    assert "checkpoints.every_steps is 0" in warning

    said = Said()
    p = said.preemption(tmp_path, every_steps=100, final_grace_s=30)
    assert p.signal(signal.SIGINT, now=0.0, running=True) == signal.SIGINT  # a person's stop
    assert p.signal(signal.SIGTERM, now=0.0, running=False) == signal.SIGTERM  # not training
    assert said.entries == [] and said.warnings == []


def test_the_wait_is_what_the_scheduler_leaves_of_final_grace_s(tmp_path: Path) -> None:
    """Under Slurm a ``scancel`` SIGKILLs the job ``KillWait`` s after its SIGTERM: the wait
    is cut to fit (``slurm_job.sigterm_grace``), and said so; one that leaves nothing stops at
    once, saying why."""
    said = Said()
    p = said.preemption(tmp_path, grace=lambda grace_s: min(grace_s, 12.0), every_steps=100,
                        final_grace_s=120)
    assert p.signal(signal.SIGTERM, now=0.0, running=True) is None
    assert said.entries == [("final_checkpoint_requested", {"grace_s": 12.0, "newest_step": 42})]
    assert p.tick(11.9, running=True) is None
    assert p.tick(12.0, running=True) == signal.SIGTERM
    assert "none arrived within 12 s (checkpoints.final_grace_s = 120 s)" in \
        said.entries[-1][1]["reason"]

    said = Said()
    none = said.preemption(tmp_path, grace=lambda grace_s: 0.0, every_steps=100,
                           final_grace_s=120)
    assert none.signal(signal.SIGTERM, now=0.0, running=True) == signal.SIGTERM
    assert said.requests == [] and "the scheduler kills the job" in said.warnings[0]


def test_a_final_checkpoint_that_never_comes_is_stood_in_for_by_the_live_ranks_state(
        tmp_path: Path) -> None:
    """A rank stuck where no step boundary comes (a collective, its loader, SIGSTOP): the wait
    runs out while the workers still run, and the live ranks' just-in-time state of the last
    completed step is the final checkpoint. None when the scheduler cut the wait (its SIGKILL
    leaves no time), nor after workers that exited first."""
    asked: list[str] = []

    def keep(fault: str) -> Outcome:
        asked.append(fault)
        return Outcome({"fault": fault, "outcome": "saved", "checkpoint_step": 44, "writers": [0],
                        "streams_lost": [], "seconds": 0.05})

    said = Said()
    p = said.preemption(tmp_path, keep=keep, every_steps=100, final_grace_s=30)
    p.signal(signal.SIGTERM, now=0.0, running=True)
    assert p.tick(30.0, running=True) == signal.SIGTERM
    assert asked == ["preemption"]
    assert [e for e, _ in said.entries] == ["final_checkpoint_requested", "just_in_time",
                                           "final_checkpoint"]
    assert said.entries[1][1]["summary"] == \
        "just-in-time state of step 44 written by rank 0 after the preemption in 0.05 s"
    assert said.entries[-1][1] == {"saved": True, "checkpoint_step": 44, "just_in_time": True}
    assert said.warnings == []
    assert "the just-in-time state of step 44 stands in for it" in said.lines[-1]

    said = Said()  # none kept: the warning as ever, after the keep's own entry
    p = said.preemption(tmp_path, keep=lambda fault: Outcome(
        {"fault": fault, "outcome": "none", "why": "rank 1's shard has no live holder",
         "step": 44}), every_steps=100, final_grace_s=30)
    p.signal(signal.SIGTERM, now=0.0, running=True)
    p.tick(30.0, running=True)
    assert [e for e, _ in said.entries][1:] == ["just_in_time", "final_checkpoint",
                                               "final_checkpoint_missing"]
    assert len(said.warnings) == 1

    asked.clear()
    for grace, running in ((lambda grace_s: 12.0, True), (None, False)):
        said = Said()
        p = said.preemption(tmp_path, grace=grace, keep=keep, every_steps=100,
                            final_grace_s=30)
        p.signal(signal.SIGTERM, now=0.0, running=True)
        assert p.tick(30.0, running=running) == signal.SIGTERM
        assert "just_in_time" not in [e for e, _ in said.entries]
    assert asked == []
