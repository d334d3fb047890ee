"""The Weights & Biases sink: babysit's writes as a W&B run of its own, through ``wandb``.

babysit's supervisor is not the script's process, so it logs to a run of its own (job type
``babysit``), in the script's project and group when ``wandb.project`` and ``wandb.group`` name
them: W&B shows runs of one group side by side. Per step, one ``log`` of every value under
``babysit/`` with ``babysit/step``, declared as their x-axis: W&B drops a ``log(step=...)`` that
goes back, and after a rollback babysit's steps do. Per incident, ``babysit/incidents``: a table
of every incident so far (W&B's tables are immutable, so each incident logs the grown one).

Offline (``wandb.mode: offline`` or ``WANDB_MODE=offline``) the run stays under
``<dir>/wandb/offline-run-*`` until ``wandb sync`` uploads it.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any, Literal

from babysit.policies.section import Section
from babysit.supervisor.services.dashboards.writes import IncidentNote, StepValues


class WandbConfig(Section):
    """The opt-in Weights & Biases sink (``pip install 'babysit[wandb]'``). Unset keys follow
    wandb's own rules (``WANDB_PROJECT``, ``WANDB_ENTITY``, ``WANDB_MODE``, ``wandb login``)."""

    enabled: bool = False
    """Log babysit's metrics and incidents to a W&B run of its own (job type ``babysit``)."""
    project: str | None = None
    """The W&B project; the script's own puts babysit's run beside the script's."""
    entity: str | None = None
    """The W&B user or team that owns the project."""
    group: str | None = None
    """The W&B group; the script's own shows babysit's run in the same group view."""
    name: str | None = None
    """The W&B run's display name; default: the babysit run's name."""
    mode: Literal["online", "offline", "disabled"] | None = None
    """``offline`` writes only local files (``wandb sync`` uploads them later); default:
    ``WANDB_MODE``, else online."""
    dir: str | None = None
    """Folder under which wandb makes its ``wandb/`` folder, relative to where babysit starts;
    default ``<run_dir>``."""


class WandbSink:
    """A ``writes.Sink``: its calling rules. ``open()`` can wait for the W&B server (up to
    wandb's ``init_timeout``, 90 s by default) and ``close()`` for the upload: call them off the
    loop thread (``feed`` does)."""

    name = "wandb"
    label = "W&B"

    def __init__(self, config: WandbConfig, run_name: str, folder: Path) -> None:
        self.config = config
        self.run_name = run_name
        self.folder = folder
        self._wandb: Any = None
        self._run: Any = None
        self._incidents: list[tuple[int | str, ...]] = []

    def open(self) -> dict[str, str | None]:
        try:
            import wandb
        except ImportError:
            raise RuntimeError("wandb.enabled needs the wandb package: pip install "
                               "'babysit[wandb]' (in the environment babysit runs in)") from None
        c = self.config
        self.folder.mkdir(parents=True, exist_ok=True)
        self._wandb = wandb
        self._run = wandb.init(
            # An id of its own: a WANDB_RUN_ID exported for the script must not make babysit
            # write into the script's run.
            id=f"babysit-{secrets.token_hex(4)}", project=c.project, entity=c.entity,
            group=c.group, name=c.name or self.run_name, job_type="babysit", mode=c.mode,
            dir=str(self.folder), config={"babysit_run": self.run_name},
            # The supervisor's console is babysit's: no capture, no banner, no system metrics.
            settings=wandb.Settings(console="off", silent=True, x_disable_stats=True))
        self._run.define_metric("babysit/step")
        self._run.define_metric("babysit/*", step_metric="babysit/step")
        return {"dir": self._run.settings.sync_dir,
                "url": None if self._run.offline else self._run.url}

    def step(self, values: StepValues) -> None:
        self._run.log({"babysit/step": values.step,
                       **{f"babysit/{name}": v for name, v in values.values.items()}})

    def incident(self, note: IncidentNote) -> None:
        self._incidents.append(note.row())
        table = self._wandb.Table(columns=list(note.COLUMNS),
                                  data=[list(row) for row in self._incidents])
        self._run.log({"babysit/step": note.step, "babysit/incidents": table})

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None
            # finish() returns before wandb's service has written the run's last records; its
            # teardown waits for them (and, online, for the upload).
            self._wandb.teardown()
