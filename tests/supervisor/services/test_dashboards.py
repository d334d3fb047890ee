"""The dashboards: TensorBoard read back with TensorBoard's own reader, W&B (offline) read back
from the records wandb's own service wrote, and the feed that keeps either from costing the run."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import pytest

from babysit.policies.types import (
    Action,
    Finding,
    Incident,
    RankStep,
    Remedy,
    Severity,
    StepRecord,
)
from babysit.supervisor.services.dashboards import (
    Dashboards,
    IncidentNote,
    StepValues,
    TensorBoardSink,
    WandbConfig,
    WandbSink,
)


def _record(step: int, loss: float) -> StepRecord:
    ranks = tuple(RankStep(rank=r, step=step, time=1000.0 + step, loss=loss, grad_norm=0.5,
                           tokens=100.0, step_time=0.25) for r in range(2))
    return StepRecord(step=step, time=1000.0 + step, ranks=ranks, world_size=2)


def _spike() -> tuple[Finding, Remedy]:
    finding = Finding(Incident.LOSS_SPIKE, "loss_spike", Severity.CRITICAL, step=5,
                      onset_step=3, message="loss 40 at step 5 is 20x its baseline 2")
    return finding, Remedy(Action.ROLLBACK, finding, "ladder rung 1/4: rollback")


def _story(dashboards: Dashboards) -> None:
    """Steps 1-5, a rollback at 5, then the run repeats steps 3-6 after it."""
    for step in range(1, 6):
        dashboards.step(_record(step, 2.0 - 0.1 * step))
    dashboards.incident(*_spike(), walltime=1005.5)
    for step in range(3, 7):
        dashboards.step(_record(step, 1.5 - 0.01 * step))


def _stopped(dashboards: Dashboards) -> None:
    lines = dashboards.stop()
    assert not any("dropped" in line or "still closing" in line for line in lines), lines


def test_metrics_and_incidents_are_in_the_event_file(tmp_path: Path) -> None:
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator",
        reason="needs the tensorboard extra: pip install -e '.[tensorboard]'")
    dashboards = Dashboards([TensorBoardSink(tmp_path / "tb")])
    dashboards.start()
    _story(dashboards)
    _stopped(dashboards)

    events = event_accumulator.EventAccumulator(
        str(tmp_path / "tb"), size_guidance={event_accumulator.TENSORS: 0})
    events.Reload()
    tags = events.Tags()
    assert {"babysit/loss", "babysit/grad_norm", "babysit/step_time_s", "babysit/tokens_per_s",
            "babysit/interventions"} <= set(tags["scalars"])
    losses = [(e.step, round(e.value, 4)) for e in events.Scalars("babysit/loss")]
    assert losses == [(s, round(2.0 - 0.1 * s, 4)) for s in range(1, 6)] + \
        [(s, round(1.5 - 0.01 * s, 4)) for s in range(3, 7)]
    assert events.Scalars("babysit/tokens_per_s")[0].value == 800.0  # 200 tokens in 0.25 s
    assert [e.value for e in events.Scalars("babysit/interventions")][-1] == 1
    (text,) = events.Tensors("babysit/incidents/text_summary")
    body = text.tensor_proto.string_val[0].decode()
    assert text.step == 5 and "loss_spike" in body and "rollback" in body and "onset 3" in body


def test_metrics_and_incidents_are_in_the_offline_wandb_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb", reason="needs the wandb extra: pip install -e '.[wandb]'")
    from tests.wandb_records import history, own_dirs, records, run_file

    for key, value in own_dirs(tmp_path, {}).items():
        monkeypatch.setenv(key, value)
    sink = WandbSink(WandbConfig(enabled=True, mode="offline", project="p", group="g"),
                     "spiky", tmp_path)
    dashboards = Dashboards([sink])
    dashboards.start()
    _story(dashboards)
    started = _drained(dashboards, 1)["wandb_started"]
    assert started["url"] is None  # offline
    _stopped(dashboards)

    # Closed means complete: wandb's own last record is in the file once stop() returns.
    assert [r.WhichOneof("record_type") for r in records(run_file(tmp_path))][-1] == "exit"
    rows = history(run_file(tmp_path))
    # Every step is there, the repeated ones too: babysit/step is the x-axis, not W&B's _step.
    losses = [(r["babysit/step"], round(r["babysit/loss"], 4)) for r in rows
              if "babysit/loss" in r]
    assert losses == [(s, round(2.0 - 0.1 * s, 4)) for s in range(1, 6)] + \
        [(s, round(1.5 - 0.01 * s, 4)) for s in range(3, 7)]
    assert rows[0]["babysit/tokens_per_s"] == 800.0
    assert [r["babysit/interventions"] for r in rows if "babysit/loss" in r][-1] == 1
    (logged,) = [r for r in rows if "babysit/incidents" in r]
    assert logged["babysit/step"] == 5 and logged["babysit/incidents"]["_type"] == "table-file"
    table = json.loads(Path(started["dir"], "files",
                            logged["babysit/incidents"]["path"]).read_text())
    assert table["columns"] == list(IncidentNote.COLUMNS)
    assert table["data"] == [[5, 3, "loss_spike", "critical",
                              "loss 40 at step 5 is 20x its baseline 2", "rollback",
                              "ladder rung 1/4: rollback"]]


class _Hung:
    """A library that never answers (W&B's init waiting on an unreachable server)."""

    name, label = "hung", "Hung"

    def __init__(self) -> None:
        self.release = threading.Event()

    def open(self) -> dict[str, str | None]:
        self.release.wait()
        return {"dir": None}

    def step(self, values: StepValues) -> None: ...

    def incident(self, note: IncidentNote) -> None: ...

    def close(self) -> None: ...


def test_a_hung_or_failing_dashboard_never_costs_the_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch.utils.tensorboard")
    (tmp_path / "taken").write_text("a file where the folder should go")
    hung = _Hung()
    monkeypatch.setattr("babysit.supervisor.services.dashboards.feed.CAPACITY", 3)
    monkeypatch.setattr("babysit.supervisor.services.dashboards.feed.CLOSE_WAIT_S", 0.2)
    dashboards = Dashboards([TensorBoardSink(tmp_path / "taken" / "tb"), hung])
    dashboards.start()
    entries = _drained(dashboards, 1)
    assert "NotADirectoryError" in entries["tensorboard_failed"]["error"]
    began = time.monotonic()
    for step in range(1, 6):
        dashboards.step(_record(step, 2.0))
    dashboards.incident(*_spike(), walltime=1005.5)
    assert time.monotonic() - began < 0.5  # the loop never waited
    assert "fell 3 writes behind" in _drained(dashboards, 1)["hung_failed"]["error"]
    assert dashboards.stop() == ["babysit: Hung still closing after 0.2 s; left behind"]
    hung.release.set()


def _drained(dashboards: Dashboards, count: int) -> dict[str, dict]:
    deadline, drained = time.monotonic() + 10, []
    while len(drained) < count and time.monotonic() < deadline:
        drained += dashboards.drain()
        time.sleep(0.01)
    return {event: fields for (event, fields), _ in drained}


def test_a_missing_library_says_which_extra_to_install(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb now raises ImportError
    dashboards = Dashboards([WandbSink(WandbConfig(enabled=True), "r", tmp_path)])
    dashboards.start()
    failed = _drained(dashboards, 1)["wandb_failed"]
    assert "pip install 'babysit[wandb]'" in failed["error"]
    assert dashboards.stop() == []
    assert Dashboards([WandbSink(WandbConfig(), "r", tmp_path)]).stop() == []  # never started
