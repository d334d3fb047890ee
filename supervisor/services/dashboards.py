"""babysit's story where the team already looks: TensorBoard.

With ``tensorboard.enabled``, the supervisor writes, through TensorBoard's own writer
(``torch.utils.tensorboard``, which needs the ``tensorboard`` package):

- per merged step, babysit's view under ``babysit/``: ``loss``, ``grad_norm``, ``step_time_s``,
  ``tokens_per_s``, ``mfu``, and ``interventions`` (the running count);
- per acted-on finding, a text entry under ``babysit/incidents``: what was seen and what babysit
  did, at the step it was seen.

Point ``tensorboard.dir`` at the script's own log folder and babysit's tags show beside the
user's (TensorBoard merges every event file of a folder). Writing happens on the supervisor's
loop thread; TensorBoard's writer queues and flushes on its own thread, so a step costs a few
microseconds here. A writer that fails is journaled once and dropped: a dashboard never costs
the run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from babysit.policies.types import Finding, JobStep, Remedy


class TensorBoardConfig(BaseModel):
    """The opt-in TensorBoard sink (``pip install tensorboard``)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)

    enabled: bool = False
    """Write babysit's metrics and incidents as TensorBoard events."""
    dir: str | None = None
    """Folder for the event file, relative to where babysit starts; default
    ``<run_dir>/tensorboard``. The script's own log folder puts babysit's tags beside its own."""


class TensorBoardSink:
    """Calling rules: ``open()`` once (imports TensorBoard; raises ``RuntimeError`` saying what
    to install when it is missing), then ``step()`` per merged step and ``incident()`` per
    acted-on finding, from one thread; ``close()`` once. The constructor does no I/O."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._writer: Any = None
        self._interventions = 0

    def open(self) -> TensorBoardSink:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise RuntimeError("tensorboard.enabled needs the tensorboard package: pip install "
                               "tensorboard (in the environment babysit runs in)") from None
        self.folder.mkdir(parents=True, exist_ok=True)
        self._writer = SummaryWriter(log_dir=str(self.folder), filename_suffix=".babysit")
        return self

    def step(self, record: JobStep) -> None:
        values = {"loss": record.loss, "grad_norm": record.grad_norm,
                  "step_time_s": record.step_time, "tokens_per_s": record.tokens_per_s,
                  "mfu": record.mfu}
        for name, value in values.items():
            if value is not None:
                self._writer.add_scalar(f"babysit/{name}", value, record.step,
                                        walltime=record.time)
        self._writer.add_scalar("babysit/interventions", self._interventions, record.step,
                                walltime=record.time)

    def incident(self, finding: Finding, remedy: Remedy, walltime: float) -> None:
        self._interventions += 1
        text = (f"**{finding.incident.value}** ({finding.severity.name.lower()}) at step "
                f"{finding.step}, onset {finding.onset_step}: {finding.message}  \n"
                f"babysit: **{remedy.action.value}**: {remedy.reason}")
        self._writer.add_text("babysit/incidents", text, finding.step, walltime=walltime)
        self._writer.flush()  # incidents are rare and worth seeing at once

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
