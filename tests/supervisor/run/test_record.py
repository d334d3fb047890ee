"""The run's record (``run.record.Record``): what one tick gathered, journaled and written in a
fixed order, and the journal's listeners."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from babysit.checkpoints import Catalog
from babysit.policies import decide as sm
from babysit.policies.loader import load_policy
from babysit.policies.types import RankStep, StepRecord
from babysit.supervisor.contract.protocol import WorkerEvent
from babysit.supervisor.node.aggregate import metrics_row
from babysit.supervisor.run.journal import Journal
from babysit.supervisor.run.members import Gathered
from babysit.supervisor.run.record import Record
from babysit.supervisor.run.recovery import Recovery
from babysit.supervisor.run.watch import Watch


def event(rank: int, kind: str, **data: Any) -> WorkerEvent:
    return WorkerEvent(rank=rank, type=kind, time=0.0, data=data)


def test_a_tick_is_recorded_in_order_and_the_listeners_hear_it(tmp_path: Path) -> None:
    warnings: list[str] = []
    machine = sm.Machine(attempt=3)
    recovery = Recovery(Catalog(tmp_path / "c"), probation_steps=5, keep=3)
    record = Record(tmp_path, Watch(load_policy("default")), recovery, 1,
                    where=lambda: machine, warn=warnings.append)
    heard: list[str] = []
    record.journal.listen(lambda e: heard.append(e["event"]), ("checkpoint_saved",))
    stepped: list[int] = []
    record.steps.listen(lambda r, row: stepped.append(r.step))
    record.open()
    got = Gathered(entries=[("hang_cleared", {"ranks": [0]})], warnings=["slow disk"],
                   events=[event(0, "hello", world_size=2), event(0, "checkpoint", step=2),
                           event(0, "checkpoint_failed", step=3, error="disk full")],
                   newest=3)
    for s in (1, 2):
        rank = RankStep(rank=0, step=s, time=float(s), cursor=s, loss=2.0)
        rec = StepRecord(step=s, time=float(s), ranks=(rank,), world_size=1)
        got.steps.append((rec, metrics_row(rec, 3)))

    items = record.take(got, judging=True)
    record.close()

    assert items == [sm.Progress(2, first=1)]  # two steps in the tick: the first of them said
    assert record.world == 2 and record.newest_step == 3
    journal = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in journal] == ["hang_cleared", "worker_hello", "checkpoint_saved",
                                            "checkpoint_failed"]
    assert {e["attempt"] for e in journal} == {3}
    # The job's step is that of the newest row written; the checkpoint's is its own field.
    assert [e.get("step") for e in journal] == [None, 2, 2, 2]
    assert journal[3]["rank"] == 0  # rank 0 says a save failed (rank.saving)
    assert journal[2]["checkpoint_step"] == 2 and journal[3]["checkpoint_step"] == 3
    assert heard == ["checkpoint_saved"]
    assert warnings == ["slow disk", "checkpoint at step 3 failed to save; training goes on "
                                     "from the last good one: disk full"]
    rows = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == stepped == [1, 2]


def test_a_listener_may_journal_and_hears_only_its_events(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "events.jsonl").open()
    order: list[str] = []

    def follow_up(entry: dict[str, Any]) -> None:
        order.append(entry["event"])
        journal.write("checkpoint_verdict", 2.0, 0)

    journal.listen(follow_up, ("checkpoint_saved",))
    journal.listen(lambda e: order.append(f"all:{e['event']}"))
    journal.write("checkpoint_saved", 1.0, 0)
    journal.close()

    # The follow-up is written (and heard) before the later listener hears its cause.
    assert order == ["checkpoint_saved", "all:checkpoint_verdict", "all:checkpoint_saved"]
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    assert [json.loads(line)["event"] for line in lines] == ["checkpoint_saved",
                                                              "checkpoint_verdict"]


def test_a_reruns_stream_is_read_before_its_steps_are_judged(tmp_path: Path) -> None:
    """The rerun's first tick brings its stream report and all its steps at once: the report
    says another global batch than the first pass's, so the rerun is undecided (journaled,
    warned, the data's finding first) before its steps could call the spike transient."""
    from babysit.policies import rerun
    from babysit.supervisor.contract.directive import Resume
    from tests.policies.test_rerun import SHELF, spike
    from tests.policies.test_rerun import record as job_step

    watch = Watch(load_policy("default"))
    watch.observe_stream({"cursor": 0, "samples": 0, "global_batch": 8})
    for s in range(1, 111):
        watch.observe_record(job_step(s, (2.0, 14.0 if s >= 100 else 2.0)))
    directive, _ = watch.launch(1, watch.judge(spike(), 0.0, SHELF),
                                Resume(path="/ckpt/40", step=40, cursor=80, samples=640))
    watch.new_attempt(0.0, directive)
    warnings: list[str] = []
    machine = sm.Machine(attempt=1)
    record = Record(tmp_path, watch, Recovery(Catalog(tmp_path / "c"), 5, 3), 2,
                    where=lambda: machine, warn=warnings.append)
    record.open()
    got = Gathered(events=[event(0, "stream", cursor=80, samples=640, global_batch=4)],
                   newest=110)
    for s in range(41, 111):  # the rerun, clean: alone it would say "transient"
        rec = job_step(s, (2.0, 2.0))
        got.steps.append((rec, metrics_row(rec, 1)))
    items = record.take(got, judging=True)
    record.close()
    assert isinstance(items[0], type(spike())) and rerun.taken_as_data(items[0])
    journal = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["verdict"] for e in journal if e["event"] == "rerun"] == ["undecided"]
    assert [e["event"] for e in journal][:2] == ["worker_stream", "rerun"]
    assert any("cannot tell whose it is" in w for w in warnings)
