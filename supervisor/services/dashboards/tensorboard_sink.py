"""The TensorBoard sink: babysit's writes as TensorBoard events, through TensorBoard's own
writer (``torch.utils.tensorboard``, which needs the ``tensorboard`` package).

Per step, one scalar per value under ``babysit/``, at babysit's step (a rollback's repeated
steps overlap the first pass, as TensorBoard draws any restarted run); per incident, a text
entry under ``babysit/incidents``. Point ``tensorboard.dir`` at the script's own log folder and
babysit's tags show beside the script's (TensorBoard merges every event file of a folder).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from babysit.policies.section import Section
from babysit.supervisor.services.dashboards.writes import IncidentNote, StepValues


class TensorBoardConfig(Section):
    """The opt-in TensorBoard sink (``pip install 'babysit[tensorboard]'``)."""

    enabled: bool = False
    """Write babysit's metrics and incidents as TensorBoard events."""
    dir: str | None = None
    """Folder for the event file, relative to where babysit starts; default
    ``<run_dir>/tensorboard``. The script's own log folder puts babysit's tags beside its own."""


class TensorBoardSink:
    """A ``writes.Sink``: its calling rules."""

    name = "tensorboard"
    label = "TensorBoard"

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._writer: Any = None

    def open(self) -> dict[str, str | None]:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise RuntimeError("tensorboard.enabled needs the tensorboard package: pip install "
                               "'babysit[tensorboard]' (in the environment babysit runs "
                               "in)") from None
        self.folder.mkdir(parents=True, exist_ok=True)
        self._writer = SummaryWriter(log_dir=str(self.folder), filename_suffix=".babysit")
        return {"dir": str(self.folder)}

    def step(self, values: StepValues) -> None:
        for name, value in values.values.items():
            self._writer.add_scalar(f"babysit/{name}", value, values.step,
                                    walltime=values.walltime)

    def incident(self, note: IncidentNote) -> None:
        self._writer.add_text("babysit/incidents", note.markdown(), note.step,
                              walltime=note.walltime)
        self._writer.flush()  # incidents are rare and worth seeing at once

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
