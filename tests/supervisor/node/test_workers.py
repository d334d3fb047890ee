"""What a node learns from its ranks' events (``node/workers.py``): here, whether each rank keeps
its last completed step (``just_in_time``), said in its hello or, by a framework's loop that
builds its optimizer after ``attach()``, in a ``keeps`` event once it did. The ranks saying it,
in real jobs: ``tests/e2e/test_integrations.py``, ``tests/e2e/test_stdout_mode.py``."""

from __future__ import annotations

from pathlib import Path

from babysit.supervisor.config import plan as plan_mod
from babysit.supervisor.contract.protocol import WorkerEvent
from babysit.supervisor.node.workers import NodeWorkers


def workers(tmp_path: Path) -> NodeWorkers:
    (tmp_path / "train.py").write_text("")
    plan = plan_mod.from_mapping({"launch": {"script": "train.py"},
                                  "checkpoints": {"every_steps": 20}}, "t", tmp_path, "t",
                                 run_dir=str(tmp_path / "run"))
    return NodeWorkers(plan, tmp_path / "run")


def event(rank: int, kind: str, **data: object) -> WorkerEvent:
    return WorkerEvent(rank=rank, type=kind, time=0.0, data=dict(data))


def test_a_rank_that_keeps_later_is_known_by_its_keeps_event(tmp_path: Path) -> None:
    node = workers(tmp_path)
    node.note(event(0, "hello", pid=100, keeps_later=True))
    node.note(event(1, "hello", pid=101, keeps_later=True))
    assert node.keeping == {} and node.standby_entries == []  # nothing known, nothing said

    node.note(event(0, "keeps", keeps=True))
    node.note(event(1, "keeps", keeps=True))

    assert node.keeping == {0: True, 1: True} and node.standby_entries == []


def test_a_framework_that_cannot_keep_it_says_why_once_in_the_journal(tmp_path: Path) -> None:
    node = workers(tmp_path)
    why = "DeepSpeed's state dicts gather across ranks (collectives)"
    for rank in (0, 1):
        node.note(event(rank, "hello", pid=100 + rank, keeps_later=True))
        node.note(event(rank, "keeps", keeps=False, keeps_not=why))

    assert node.keeping == {0: False, 1: False}
    [(kind, entry)] = node.standby_entries
    assert kind == "just_in_time_off" and entry["why"] == why and entry["rank"] == 0
