"""``decide()`` for every state and every event: the control loop's table, tested exhaustively."""

from __future__ import annotations

import itertools

import pytest

from babysit.policies import decide as sm
from babysit.policies.types import Action, Finding, Incident, Remedy, Severity

FINDING = Finding(Incident.LOSS_SPIKE, "loss_spike", Severity.CRITICAL, step=50, onset_step=45,
                  message="loss 3.1x baseline")


def remedy(action: Action, backoff: float = 2.0) -> Remedy:
    return Remedy(action, FINDING, reason=f"policy says {action.value}", backoff_s=backoff)


EVENTS: dict[str, sm.Event] = {
    "progress": sm.Progress(12),
    "exit_ok": sm.Exited(0),
    "crash_relaunch": sm.Exited(1, remedy(Action.RELAUNCH)),
    "crash_rollback": sm.Exited(1, remedy(Action.ROLLBACK)),
    "crash_stop": sm.Exited(1, remedy(Action.STOP)),
    "crash_unjudged": sm.Exited(-9),
    "ignore": sm.Remedied(remedy(Action.IGNORE)),
    "alert": sm.Remedied(remedy(Action.ALERT)),
    "skip_step": sm.Remedied(remedy(Action.SKIP_STEP)),
    "rollback": sm.Remedied(remedy(Action.ROLLBACK)),
    "relaunch": sm.Remedied(remedy(Action.RELAUNCH)),
    "stop_policy": sm.Remedied(remedy(Action.STOP)),
    "stopped": sm.WorkersStopped(),
    "backoff": sm.BackoffElapsed(),
    "sigint": sm.StopRequested(2),
}

S = sm.State
# (state, event) -> (next state, action types in order). Every pair not listed leaves the machine
# unchanged and does nothing.
EXPECTED: dict[tuple[sm.State, str], tuple[sm.State, list[type]]] = {}
for live in (S.STARTING, S.RUNNING):
    EXPECTED.update({
        (live, "progress"): (S.RUNNING, []),
        (live, "exit_ok"): (S.SUCCEEDED, [sm.Finish]),
        (live, "crash_relaunch"): (S.RELAUNCHING, [sm.Notify, sm.Wait]),
        (live, "crash_rollback"): (S.RELAUNCHING, [sm.Notify, sm.Wait]),
        (live, "crash_stop"): (S.FAILED, [sm.Notify, sm.Finish]),
        (live, "crash_unjudged"): (S.FAILED, [sm.Notify, sm.Finish]),
        (live, "ignore"): (live, []),
        (live, "skip_step"): (live, []),
        (live, "alert"): (live, [sm.Notify]),
        (live, "rollback"): (S.INTERVENING, [sm.Notify, sm.StopWorkers]),
        (live, "relaunch"): (S.INTERVENING, [sm.Notify, sm.StopWorkers]),
        (live, "stop_policy"): (S.FAILED, [sm.StopWorkers, sm.Notify, sm.Finish]),
        (live, "sigint"): (S.STOPPED, [sm.StopWorkers, sm.Finish]),
    })
EXPECTED.update({
    (S.INTERVENING, "stopped"): (S.RELAUNCHING, [sm.Wait]),
    (S.INTERVENING, "sigint"): (S.STOPPED, [sm.StopWorkers, sm.Finish]),
    (S.RELAUNCHING, "backoff"): (S.STARTING, [sm.Launch]),
    (S.RELAUNCHING, "sigint"): (S.STOPPED, [sm.Finish]),
})


@pytest.mark.parametrize("state, event", list(itertools.product(S, EVENTS)))
def test_every_state_and_event(state: sm.State, event: str) -> None:
    machine = sm.Machine(state=state, attempt=3, step=40, pending=remedy(Action.ROLLBACK))
    new, actions = sm.decide(machine, EVENTS[event])
    want_state, want_actions = EXPECTED.get((state, event), (state, []))
    assert new.state is want_state
    assert [type(a) for a in actions] == want_actions
    if (state, event) not in EXPECTED:
        assert new == machine


def test_terminal_states_accept_nothing() -> None:
    for state in (S.SUCCEEDED, S.FAILED, S.STOPPED):
        assert state.terminal
        for event in EVENTS.values():
            assert sm.decide(sm.Machine(state=state), event) == (sm.Machine(state=state), [])


def test_rollback_cycle_carries_the_remedy_into_the_next_launch() -> None:
    m = sm.Machine()
    m, _ = sm.decide(m, sm.Progress(10))
    m, actions = sm.decide(m, sm.Remedied(remedy(Action.ROLLBACK, backoff=1.5)))
    assert m.state is S.INTERVENING and m.pending is not None
    m, actions = sm.decide(m, sm.WorkersStopped())
    assert actions == [sm.Wait(1.5)]
    m, actions = sm.decide(m, sm.BackoffElapsed())
    assert m.state is S.STARTING and m.attempt == 1
    assert actions == [sm.Launch(1, remedy(Action.ROLLBACK, backoff=1.5))]


def test_exit_code_of_a_signal_stop() -> None:
    _, actions = sm.decide(sm.Machine(state=S.RUNNING), sm.StopRequested(15))
    assert actions[-1] == sm.Finish(143)


def test_progress_tracks_the_step_and_reason() -> None:
    m, _ = sm.decide(sm.Machine(), sm.Progress(1))
    assert (m.state, m.step, m.reason) == (S.RUNNING, 1, "first step 1")
    m, _ = sm.decide(m, sm.Progress(2))
    assert m.step == 2 and m.reason == "first step 1"


def test_an_alert_title_says_once_what_babysit_does() -> None:
    """The remedies the default policy gives a hang and a crash, through ``decide()``: the
    title the console and the journal's ``alert`` show is the remedy's reason, which names
    the relaunch itself; prefixed with the action it read "relaunch: ... relaunch"."""
    from babysit.policies.detectors import classify
    from babysit.policies.loader import load_policy
    from babysit.policies.rules import Rules
    from tests.journal_text import unreadable

    rules = Rules(load_policy("default"))
    hang = Finding(Incident.HANG, "hang", Severity.CRITICAL, step=9, onset_step=9,
                   message="hang at step 9: rank 1 is stuck", ranks=(1,))
    crash = classify(-9, None, "", 12, []).to_finding()
    running = sm.Machine(state=S.RUNNING, step=9)
    for event in (sm.Remedied(rules.on_finding(hang, 0.0)),
                  sm.Exited(-9, rules.on_finding(crash, 1.0))):
        _, actions = sm.decide(running, event)
        [notify] = [a for a in actions if isinstance(a, sm.Notify)]
        assert notify.remedy is not None and notify.title == notify.remedy.reason
        assert notify.title.count("relaunch") == 1 and unreadable(notify.title) == [], \
            notify.title
