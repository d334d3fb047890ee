"""babysit's story where the team already looks: TensorBoard and Weights & Biases.

With ``tensorboard.enabled`` or ``wandb.enabled``, the supervisor writes, through each one's own
library, the same story (``writes``):

- per merged step, babysit's view under ``babysit/``: ``loss``, ``grad_norm``, ``step_time_s``,
  ``tokens_per_s``, ``mfu``, and ``interventions`` (the running count);
- per acted-on finding, an incident note: what was seen and what babysit did, at the step it
  was seen (TensorBoard: text under ``babysit/incidents``; W&B: a table of that name).

Each sink makes only its library's calls (``tensorboard_sink``, ``wandb_sink``) on a thread of
its own (``feed``): the loop hands it plain values and never waits on it. A sink that fails is
journaled once and dropped: a dashboard never costs the run. On a multi-node run only the leader
writes, since only it runs the loop.
"""

from babysit.supervisor.services.dashboards.feed import Dashboards
from babysit.supervisor.services.dashboards.tensorboard_sink import (
    TensorBoardConfig,
    TensorBoardSink,
)
from babysit.supervisor.services.dashboards.wandb_sink import WandbConfig, WandbSink
from babysit.supervisor.services.dashboards.writes import IncidentNote, Sink, StepValues

__all__ = ["Dashboards", "IncidentNote", "Sink", "StepValues", "TensorBoardConfig",
           "TensorBoardSink", "WandbConfig", "WandbSink"]
