"""The cadence in a live run (``run.cadence_live.LiveCadence``): fed by journal entries alone,
it says its advice and, with ``auto``, asks the ranks for a new interval."""

from __future__ import annotations

import itertools
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


def test_the_console_shows_the_advice_again_only_when_it_moved_materially() -> None:
    """Every move of 10 % is journaled; the console repeats the advice only once the advised
    interval halved or doubled since it last showed it."""
    lines: list[str] = []
    entries: list[str] = []
    c = LiveCadence(CheckpointConfig(every_steps=100),
                    journal=lambda event, **f: entries.append(event), log=lines.append,
                    request=lambda **f: None, newest_step=lambda: 0)
    for s in range(1, 65):
        c.observe_step(step(s, 0.1))
    c.hear(entry("state", 0.0, old="starting", new="running"))
    t = 0.0
    for blocking in (0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.2, 1.5, 2.0, 4.0, 8.0):  # costs grow
        t += 600.0
        c.hear(entry("checkpoint_saved", t, checkpoint_step=100,
                     data={"step": 100, "blocking_s": blocking}))
    advised = entries.count("cadence_advice")
    assert advised >= 4 and 1 <= len(lines) < advised
    shown = [int(line.split("checkpoint every ")[1].split()[0]) for line in lines]
    assert all(b >= 2 * a or b <= a / 2 for a, b in itertools.pairwise(shown))
