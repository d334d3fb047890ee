"""The cadence in a live run (``run.cadence_live.LiveCadence``): fed by journal entries alone,
it says its advice and, with ``auto``, asks the ranks for a new interval."""

from __future__ import annotations

from typing import Any

from babysit.policies.types import JobStep, RankStep, StepRecord
from babysit.supervisor.config.schema import CheckpointConfig
from babysit.supervisor.run.cadence_live import LiveCadence


class Heard:
    def __init__(self) -> None:
        self.entries: list[tuple[str, dict[str, Any]]] = []
        self.requests: list[dict[str, Any]] = []

    def cadence(self, **config: Any) -> LiveCadence:
        return LiveCadence(CheckpointConfig(**config),
                           journal=lambda event, **f: self.entries.append((event, f)),
                           log=lambda line: None, request=lambda **f: self.requests.append(f),
                           newest_step=lambda: 0)


def entry(event: str, t: float, **fields: Any) -> dict[str, Any]:
    return {"event": event, "time": t, **fields}


def step(s: int, seconds: float) -> JobStep:
    rank = RankStep(rank=0, step=s, time=float(s), cursor=s, loss=2.0, step_time=seconds)
    return StepRecord(step=s, time=float(s), ranks=(rank,), world_size=1)


def test_running_time_interruptions_and_costs_come_from_the_journal() -> None:
    heard = Heard()
    c = heard.cadence(every_steps=100)
    c.hear(entry("state", 10.0, old="starting", new="running"))
    c.hear(entry("checkpoint_saved", 70.0, checkpoint_step=100,
                 data={"step": 100, "blocking_s": 2.0}))
    assert c.advisor.observed_s == 60.0  # charged up to the save, not only when running ends
    c.hear(entry("finding", 80.0, finding={"incident": "hang"}, remedy={"action": "relaunch"}))
    c.hear(entry("finding", 81.0, finding={"incident": "straggler"}, remedy={"action": "alert"}))
    c.hear(entry("state", 90.0, old="running", new="intervening"))
    assert c.advisor.observed_s == 80.0
    assert c.advisor.interruptions == [("hang", 80.0)]  # an alert lost no work
    # A takeover counts the dead supervisor's loss, unless a remedy it left counted it already.
    c.hear(entry("supervisor_takeover", 95.0, inherited_remedy=None))
    c.hear(entry("supervisor_takeover", 96.0, inherited_remedy={"action": "rollback"}))
    assert c.advisor.interruption_count == 2


def test_the_advice_is_journaled_and_auto_asks_the_ranks_for_the_interval() -> None:
    heard = Heard()
    c = heard.cadence(every_steps=1000, cadence={"auto": True, "min_steps": 10})
    for s in range(1, 65):
        c.observe_step(step(s, 0.1))
    c.hear(entry("state", 0.0, old="starting", new="running"))
    c.hear(entry("checkpoint_saved", 3600.0, checkpoint_step=1000,
                 data={"step": 1000, "blocking_s": 0.5}))

    events = [e for e, _ in heard.entries]
    assert events[0] == "cadence_advice"
    assert "cadence_adopted" in events
    (request,) = heard.requests
    assert request["checkpoint_every"] == c.every_steps != 1000
    adopted = dict(heard.entries)["cadence_adopted"]
    assert (adopted["old_every"], adopted["new_every"]) == (1000, c.every_steps)
    assert [e for e, _ in c.closing()] == ["cadence_advice"]


def test_an_interval_auto_adopted_before_a_restart_stays_in_force() -> None:
    heard = Heard()
    c = heard.cadence(every_steps=1000, cadence={"auto": True, "min_steps": 10})
    previous = [entry("run_started", 0.0),
                entry("cadence_adopted", 5.0, old_every=1000, new_every=300),
                entry("cadence_adopted", 9.0, old_every=300, new_every=250)]

    restored = c.restore(previous)

    assert c.every_steps == 250
    assert [e for e, _ in restored] == ["cadence_restored"]
    # The user changed the interval since: their word wins.
    other = Heard().cadence(every_steps=500, cadence={"auto": True})
    assert other.restore(previous) == [] and other.every_steps == 500


def said(config: CheckpointConfig, blocking: list[float], *, interruptions: int,
         hours: float, previous: list[dict[str, Any]] | None = None
         ) -> tuple[list[str], list[tuple[str, dict[str, Any]]]]:
    """What the console says, and the journal keeps, of a run that saved a checkpoint costing
    each of ``blocking`` in turn, an hour apart after ``interruptions`` relaunches spread over
    its first ``hours`` hours of running."""
    lines: list[str] = []
    entries: list[tuple[str, dict[str, Any]]] = []
    c = LiveCadence(config, journal=lambda event, **f: entries.append((event, f)),
                    log=lines.append, request=lambda **f: None, newest_step=lambda: 0)
    c.restore(previous or [])
    for s in range(1, 65):
        c.observe_step(step(s, 0.1))
    c.hear(entry("state", 0.0, old="starting", new="running"))
    for i in range(interruptions):
        c.hear(entry("finding", (i + 1) * hours * 3600 / (interruptions + 1),
                     finding={"incident": "crash"}, remedy={"action": "relaunch"}))
    t = hours * 3600
    for cost in blocking:
        t += 3600.0
        c.hear(entry("checkpoint_saved", t, checkpoint_step=100,
                     data={"step": 100, "blocking_s": cost}))
    return lines, entries


def test_the_console_says_the_advice_once_a_run_where_it_would_change_what_the_user_does(
        ) -> None:
    """Every move of 10 % is journaled, figures and all (``babysit status`` shows the newest);
    the console says it in plain words, once a run, and only once the run's own interruptions
    outweigh the prior, the advice settled and the configured interval is far from it."""
    often = CheckpointConfig(every_steps=100)
    # On the prior (no interruption yet), or while the costs still wander: journaled only.
    lines, entries = said(often, [0.5, 0.6, 0.7, 0.8, 1.0, 1.5, 2.0, 4.0, 8.0],
                          interruptions=0, hours=1)
    assert lines == [] and [e for e, _ in entries].count("cadence_advice") >= 4
    lines, _ = said(often, [0.5, 1.0, 2.0, 4.0, 8.0, 16.0], interruptions=3, hours=48)
    assert lines == []
    # Settled on the run's own record, and far from the configured interval: said once.
    lines, entries = said(often, [2.0] * 8, interruptions=3, hours=48)
    assert len(lines) == 1, lines
    told = [f for e, f in entries if e == "cadence_advice" and f.get("told")]
    assert len(told) == 1 and told[0]["tau_source"] == "observed"
    assert lines[0] == (
        f"babysit: checkpoints every 100 steps are more frequent than this run needs: every "
        f"{told[0]['optimal_steps']} steps would waste {told[0]['waste_optimal']:.1%} of its "
        f"time instead of {told[0]['waste_configured']:.1%}, going by its 3 interruptions in "
        "2.1 d (set checkpoints.every_steps, or checkpoints.cadence.auto: true to let babysit "
        "adapt it; `babysit status` has the figures)")
    assert "C=" not in lines[0] and "tau" not in lines[0]
    # Not again after a restart in the same run directory.
    again, _ = said(often, [2.0] * 8, interruptions=3, hours=48,
                    previous=[{"event": "cadence_advice", "time": 1.0, **told[0]}])
    assert again == []
    # Near the advice, or babysit adopts it itself (auto): nothing to do, nothing said.
    near = CheckpointConfig(every_steps=told[0]["optimal_steps"])
    assert said(near, [2.0] * 8, interruptions=3, hours=48)[0] == []
    auto = CheckpointConfig(every_steps=100, cadence={"auto": True, "min_steps": 10})
    assert not [line for line in said(auto, [2.0] * 8, interruptions=3, hours=48)[0]
                if "would waste" in line]
