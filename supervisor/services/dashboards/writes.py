"""What babysit writes to a dashboard, decided once for every dashboard.

Pure values, built on the loop thread from what the loop already holds, handed to each sink's
thread (``feed``); a sink only turns them into its library's calls. Every name below is written
under the ``babysit/`` prefix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

from babysit.policies.types import Finding, JobStep, Remedy


@dataclass(frozen=True, slots=True)
class StepValues:
    """babysit's view of one merged step: ``values`` maps ``loss``, ``grad_norm``,
    ``step_time_s``, ``tokens_per_s``, ``mfu`` (those known at this step; never ``None``) and
    ``interventions`` (the running count of acted-on findings) to their values. ``walltime``:
    seconds since the epoch. ``step`` may go back: after a rollback the run repeats steps."""

    step: int
    walltime: float
    values: dict[str, float]


@dataclass(frozen=True, slots=True)
class IncidentNote:
    """One acted-on finding, at the step it was seen: what was seen and what babysit did."""

    COLUMNS: ClassVar[tuple[str, ...]] = ("step", "onset_step", "incident", "severity",
                                          "message", "action", "reason")

    step: int
    onset_step: int
    incident: str
    severity: str
    message: str
    action: str
    reason: str
    walltime: float

    def markdown(self) -> str:
        """The note as one short paragraph (TensorBoard's text tab renders markdown)."""
        return (f"**{self.incident}** ({self.severity}) at step {self.step}, onset "
                f"{self.onset_step}: {self.message}  \n"
                f"babysit: **{self.action}**: {self.reason}")

    def row(self) -> tuple[int | str, ...]:
        """The note as a table row, in the order of ``COLUMNS``."""
        return (self.step, self.onset_step, self.incident, self.severity, self.message,
                self.action, self.reason)


def step_values(record: JobStep, interventions: int) -> StepValues:
    values = {"loss": record.loss, "grad_norm": record.grad_norm,
              "step_time_s": record.step_time, "tokens_per_s": record.tokens_per_s,
              "mfu": record.mfu}
    known = {name: float(v) for name, v in values.items() if v is not None}
    return StepValues(record.step, record.time, {**known, "interventions": float(interventions)})


def incident_note(finding: Finding, remedy: Remedy, walltime: float) -> IncidentNote:
    return IncidentNote(step=finding.step, onset_step=finding.onset_step,
                        incident=finding.incident.value,
                        severity=finding.severity.name.lower(), message=finding.message,
                        action=remedy.action.value, reason=remedy.reason, walltime=walltime)


class Sink(Protocol):
    """A dashboard's library calls. Calling rules: ``open()`` once, then ``step()`` and
    ``incident()`` in the run's order, then ``close()`` once, all from one thread (the sink's
    feed); any of them may raise, and then the sink is dropped. The constructor does no I/O."""

    name: str
    """The journal's name for it: ``<name>_started``, ``<name>_failed``."""
    label: str
    """The console's name for it."""

    def open(self) -> dict[str, str | None]:
        """Start writing; return where the writing goes (journaled with ``<name>_started``).
        Raises ``RuntimeError`` saying what to install when the library is missing."""
        ...

    def step(self, values: StepValues) -> None: ...

    def incident(self, note: IncidentNote) -> None: ...

    def close(self) -> None: ...
