"""The control loop's brain: a pure state machine, ``decide(machine, event) -> (machine, actions)``.

States (one run, many attempts)::

    STARTING ──Progress──> RUNNING
       │ │                   │ │
       │ └──Remedied(relaunch|rollback)──> INTERVENING ──WorkersStopped──> RELAUNCHING
       │                     │                                                │
       └──Exited(crash, policy says relaunch|rollback)────────────────────────┤
                                                                              │
    STARTING <──────────────────────────BackoffElapsed────────────────────────┘

    Exited(0) -> SUCCEEDED     Remedied(stop) or Exited(crash, policy says stop) -> FAILED
    StopRequested (SIGINT/SIGTERM to babysit) from any live state -> STOPPED

- STARTING: an attempt's workers were launched; no step reported yet.
- RUNNING: steps are arriving; detectors judge them.
- INTERVENING: babysit is stopping the workers to apply a remedy (their exit is expected).
- RELAUNCHING: the workers are gone; waiting out the backoff before the next attempt.
- SUCCEEDED / FAILED / STOPPED: terminal; babysit exits 0 / 1 / 128+signal.

Nothing here touches a process, a file or a clock: the loop performs the returned actions and
feeds their outcomes back as events, so every transition is tested without sleeping.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from babysit.policies.types import Action, Remedy, Severity


class State(str, enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    INTERVENING = "intervening"
    RELAUNCHING = "relaunching"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"

    @property
    def terminal(self) -> bool:
        return self in (State.SUCCEEDED, State.FAILED, State.STOPPED)


# -- events: what happened ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Progress:
    """Steps were reported: ``step`` the newest, ``first`` the oldest of them (the same when
    one came; the attempt's first step, when it is starting)."""

    step: int
    first: int | None = None


@dataclass(frozen=True, slots=True)
class Exited:
    """The workers ended on their own. ``remedy`` is the policy's answer for a non-zero code."""

    code: int
    remedy: Remedy | None = None


@dataclass(frozen=True, slots=True)
class Remedied:
    """The policy's answer to a detector's finding while the workers run."""

    remedy: Remedy


@dataclass(frozen=True, slots=True)
class WorkersStopped:
    """The stop babysit asked for is complete."""


@dataclass(frozen=True, slots=True)
class BackoffElapsed:
    """The wait before a relaunch is over."""


@dataclass(frozen=True, slots=True)
class StopRequested:
    """babysit itself got SIGINT or SIGTERM."""

    signal: int


Event = Progress | Exited | Remedied | WorkersStopped | BackoffElapsed | StopRequested


# -- actions: what the loop must do -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Launch:
    """Start attempt ``attempt``; ``remedy`` (if any) shapes its resume directive."""

    attempt: int
    remedy: Remedy | None


@dataclass(frozen=True, slots=True)
class StopWorkers:
    reason: str


@dataclass(frozen=True, slots=True)
class Wait:
    """Feed ``BackoffElapsed`` after ``seconds``."""

    seconds: float


@dataclass(frozen=True, slots=True)
class Notify:
    """Tell a human."""

    severity: Severity
    title: str
    remedy: Remedy | None = None


@dataclass(frozen=True, slots=True)
class Finish:
    """Leave the loop and exit with ``code``."""

    code: int


ActionT = Launch | StopWorkers | Wait | Notify | Finish


@dataclass(frozen=True, slots=True)
class Machine:
    """The whole state ``decide()`` needs. ``pending`` is the remedy being applied."""

    state: State = State.STARTING
    attempt: int = 0
    step: int = 0
    pending: Remedy | None = None
    reason: str = "launched"


Outcome = tuple[Machine, list[ActionT]]


def _to(m: Machine, state: State, reason: str, **changes: object) -> Machine:
    return dataclasses.replace(m, state=state, reason=reason, **changes)  # type: ignore[arg-type]


# -- transitions --------------------------------------------------------------------------------


def _progress(m: Machine, e: Progress) -> Outcome:
    if m.state is State.STARTING:
        first = e.step if e.first is None else e.first
        return _to(m, State.RUNNING, f"first step {first}", step=e.step), []
    return dataclasses.replace(m, step=e.step), []


def _exited(m: Machine, e: Exited) -> Outcome:
    if e.code == 0:
        return _to(m, State.SUCCEEDED, "workers finished"), [Finish(0)]
    remedy = e.remedy
    # A crash's rollback (a numerical crash, or one that follows the data) needs no stop: the
    # workers are gone already, and the relaunch carries the rollback in its directive.
    if remedy is None or remedy.action not in (Action.RELAUNCH, Action.ROLLBACK):
        reason = remedy.reason if remedy else f"workers exited with code {e.code}"
        return _to(m, State.FAILED, reason, pending=remedy), [
            Notify(Severity.CRITICAL, f"run failed: {reason}", remedy), Finish(1)]
    # The remedy's reason says what babysit does ("relaunch at once", "roll back past it"):
    # the title is that reason, not the action named twice.
    return _to(m, State.RELAUNCHING, f"crash (exit {e.code}): {remedy.reason}", pending=remedy), [
        Notify(remedy.finding.severity, remedy.reason, remedy),
        Wait(remedy.backoff_s)]


def _remedied(m: Machine, e: Remedied) -> Outcome:
    remedy = e.remedy
    if remedy.action in (Action.IGNORE, Action.SKIP_STEP):
        return m, []
    if remedy.action is Action.ALERT:
        return m, [Notify(remedy.finding.severity, remedy.finding.message, remedy)]
    if remedy.action is Action.STOP:
        return _to(m, State.FAILED, remedy.reason, pending=remedy), [
            StopWorkers(remedy.reason),
            Notify(Severity.CRITICAL, f"stopping, a human is needed: {remedy.reason}", remedy),
            Finish(1)]
    return _to(m, State.INTERVENING, remedy.reason, pending=remedy), [
        Notify(remedy.finding.severity, remedy.reason, remedy),
        StopWorkers(remedy.reason)]


def _stopped_for_remedy(m: Machine, e: WorkersStopped) -> Outcome:
    backoff = m.pending.backoff_s if m.pending else 0.0
    return _to(m, State.RELAUNCHING, "workers stopped"), [Wait(backoff)]


def _relaunch(m: Machine, e: BackoffElapsed) -> Outcome:
    attempt = m.attempt + 1
    launch = Launch(attempt, m.pending)
    return _to(m, State.STARTING, f"attempt {attempt}", attempt=attempt), [launch]


def _stop_requested(m: Machine, e: StopRequested) -> Outcome:
    actions: list[ActionT] = []
    if m.state is not State.RELAUNCHING:  # in RELAUNCHING no worker is left to stop
        actions.append(StopWorkers(f"babysit got signal {e.signal}"))
    return _to(m, State.STOPPED, f"signal {e.signal}"), [*actions, Finish(128 + e.signal)]


def _ignore(m: Machine, e: Event) -> Outcome:
    return m, []


LIVE = (State.STARTING, State.RUNNING)

# (state, event type) -> transition. Pairs not listed are ignored: for instance the workers'
# exit while INTERVENING is the stop babysit asked for, and terminal states accept nothing.
TABLE: dict[tuple[State, type], Callable[[Machine, Any], Outcome]] = {
    **{(s, Progress): _progress for s in LIVE},
    **{(s, Exited): _exited for s in LIVE},
    **{(s, Remedied): _remedied for s in LIVE},
    (State.INTERVENING, WorkersStopped): _stopped_for_remedy,
    (State.RELAUNCHING, BackoffElapsed): _relaunch,
    **{(s, StopRequested): _stop_requested
       for s in (State.STARTING, State.RUNNING, State.INTERVENING, State.RELAUNCHING)},
}


def decide(machine: Machine, event: Event) -> Outcome:
    """The next machine and the actions to perform, in order. Pure and total."""
    handler = TABLE.get((machine.state, type(event)), _ignore)
    return handler(machine, event)
