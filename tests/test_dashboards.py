"""The TensorBoard sink, read back with TensorBoard's own reader."""

from __future__ import annotations

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
from babysit.supervisor.services.dashboards import TensorBoardSink

event_accumulator = pytest.importorskip(
    "tensorboard.backend.event_processing.event_accumulator",
    reason="needs the tensorboard extra: pip install -e '.[tensorboard]'")


def _record(step: int, loss: float) -> StepRecord:
    ranks = tuple(RankStep(rank=r, step=step, time=1000.0 + step, loss=loss, grad_norm=0.5,
                           tokens=100.0, step_time=0.25) for r in range(2))
    return StepRecord(step=step, time=1000.0 + step, ranks=ranks, world_size=2)


def test_metrics_and_incidents_are_in_the_event_file(tmp_path: Path) -> None:
    sink = TensorBoardSink(tmp_path / "tb").open()
    for step in range(1, 6):
        sink.step(_record(step, 2.0 - 0.1 * step))
    finding = Finding(Incident.LOSS_SPIKE, "loss_spike", Severity.CRITICAL, step=5,
                      onset_step=3, message="loss 40 at step 5 is 20x its baseline 2")
    sink.incident(finding, Remedy(Action.ROLLBACK, finding, "ladder rung 1/4: rollback"),
                  walltime=1005.5)
    sink.step(_record(6, 1.4))
    sink.close()

    events = event_accumulator.EventAccumulator(
        str(tmp_path / "tb"), size_guidance={event_accumulator.TENSORS: 0})
    events.Reload()
    tags = events.Tags()
    assert {"babysit/loss", "babysit/grad_norm", "babysit/step_time_s", "babysit/tokens_per_s",
            "babysit/interventions"} <= set(tags["scalars"])
    losses = [(e.step, round(e.value, 4)) for e in events.Scalars("babysit/loss")]
    assert losses == [(s, round(2.0 - 0.1 * s, 4)) for s in range(1, 6)] + [(6, 1.4)]
    assert events.Scalars("babysit/tokens_per_s")[0].value == 800.0  # 200 tokens in 0.25 s
    assert [e.value for e in events.Scalars("babysit/interventions")][-1] == 1
    (text,) = events.Tensors("babysit/incidents/text_summary")
    body = text.tensor_proto.string_val[0].decode()
    assert text.step == 5 and "loss_spike" in body and "rollback" in body and "onset 3" in body
