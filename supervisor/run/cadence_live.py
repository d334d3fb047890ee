"""The checkpoint cadence in a live run: it hears the journal, and says and adopts its advice.

``run.cadence`` is the arithmetic (pure). This is its place in a run: it listens to the journal
for what the advice is made of, and speaks through the handles the loop gives it::

    state            running time: the time between entering and leaving "running"
    finding          an interruption, when the remedy ends the workers (rollback, relaunch, stop)
    just_in_time     its attempt's interruption lost one step: covered, not in tau
    supervisor_takeover   an interruption, when the previous supervisor died with workers up
                          and left no remedy that counted it
    checkpoint_saved its cost (``data.blocking_s``); then the advice is journaled when it moved,
                     and with ``checkpoints.cadence.auto`` a new interval is asked of the ranks

and each merged step's time (``observe_step``). The loop never calls it for any of these.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from babysit.policies.types import JobStep
from babysit.supervisor.config.schema import CheckpointConfig
from babysit.supervisor.contract.protocol import finite
from babysit.supervisor.run.cadence import (
    Advice,
    CadenceAdvisor,
    CadenceKeeper,
    Covering,
    duration,
    estimate_tau,
    memory_advice,
    replay_journal,
)

Entry = tuple[str, dict[str, Any]]


class LiveCadence:
    """Calling rules: ``restore()`` once before the run's first entry; then, on the loop's
    thread, ``hear()`` each journal entry of ``EVENTS`` (``Journal.listen``), ``observe_step()``
    each merged step, and ``closing()`` once as the run finishes."""

    EVENTS = ("state", "finding", "supervisor_takeover", "checkpoint_saved", "just_in_time",
              "resume", "memory_copy")
    FAR = 2.0
    """The console says the advice only when the configured interval is this factor or more
    from it: nearer, the waste curve is flat (20 % off costs 1.7 % more than the least)."""
    SETTLED = 3
    """... and only once the advice settled: the interruptions the run saw outweigh the prior
    (``tau_source`` observed), and the last this many checkpoints' advice agree within
    ``SETTLED_BAND``. Early estimates wander while costs and failure rate are learnt (one run's
    swung from 205 to 2889 steps on the prior); the journal keeps every move of 10 %, and
    ``babysit status`` shows the newest."""
    SETTLED_BAND = 1.25

    def __init__(self, config: CheckpointConfig, *, journal: Callable[..., None],
                 log: Callable[[str], None], request: Callable[..., None],
                 newest_step: Callable[[], int]) -> None:
        """``journal(event, **fields)``, ``log(line)`` and ``request(**fields)`` (to the running
        ranks' control file) are how it speaks; ``newest_step()`` is the newest step any rank
        reported (a switch of interval must start ahead of every rank)."""
        self.config = config
        c = config.cadence
        self.keeper = CadenceKeeper(CadenceAdvisor(config.every_steps, c.mtbf_prior_s),
                                    c.auto, c.min_steps, c.max_steps)
        self.advisor = self.keeper.advisor
        self._journal, self._log, self._request = journal, log, request
        self._newest_step = newest_step
        self._covering = Covering(self.advisor)
        self._running_since: float | None = None
        self._told = False
        """The console said the advice (once a run: ``_worth_telling``)."""
        self._recent: deque[int] = deque(maxlen=self.SETTLED)
        """The advised interval at the last checkpoints (``SETTLED``)."""
        self._memory_chosen = config.memory_every_steps != "auto"
        """The memory copies' interval is set (the config's), or was chosen (``auto``)."""
        self.memory_every: int | None = None
        """The memory copies' interval ``auto`` chose (None: not yet, or not ``auto``): every
        attempt after it is launched with it."""

    @property
    def every_steps(self) -> int:
        """The interval in force: the config's, or the one ``auto`` adopted (every attempt's
        directive carries it)."""
        return self.advisor.every_steps

    def restore(self, previous: list[dict[str, Any]]) -> list[Entry]:
        """Earlier runs in this directory (their journal): their interruptions, checkpoint costs
        and running time count, and an interval ``auto`` chose stays in force. The journal
        entries saying so."""
        if not previous:
            return []
        replay_journal(self.advisor, previous)
        self._told = any(e.get("event") == "cadence_advice" and e.get("told") for e in previous)
        c = self.config
        adopted = [e for e in previous if e.get("event") == "cadence_adopted"]
        # Only when the config still says what the adoptions started from: a changed
        # every_steps (0 in particular: the script saves itself) is the user's word.
        if not (adopted and c.cadence.auto and c.every_steps > 0
                and adopted[0].get("old_every") == c.every_steps):
            return []
        every = adopted[-1].get("new_every")
        if not (isinstance(every, int) and every > 0):
            return []
        self.advisor.every_steps = min(max(every, c.cadence.min_steps), c.cadence.max_steps)
        return [("cadence_restored", {
            "every_steps": self.advisor.every_steps,
            "reason": "checkpoints.cadence.auto adopted it before babysit restarted"})]

    def observe_step(self, record: JobStep) -> None:
        if record.step_time is not None:
            self.advisor.on_step_time(record.step_time)

    def hear(self, entry: dict[str, Any]) -> None:
        event, t = entry.get("event"), float(entry["time"])
        if event == "state":
            if entry.get("old") == "running":
                self._ran_until(t)
                self._running_since = None
            if entry.get("new") == "running":
                self._running_since = t
        elif event in Covering.EVENTS:  # an interruption, or the state saved that covers it
            self._covering.hear(entry, t)
        elif event == "memory_copy":
            self._choose_memory(entry)
        elif event == "supervisor_takeover":
            if not entry.get("inherited_remedy"):  # one it inherited counted the loss already
                self.advisor.on_interruption("supervisor_lost", t)
        elif event == "checkpoint_saved":
            self._ran_until(t)
            blocking = finite((entry.get("data") or {}).get("blocking_s"))
            if blocking is not None:  # a save that reported no cost costs nothing known
                self.advisor.on_checkpoint(blocking)
            self._advise(max(entry.get("checkpoint_step") or 0, self._newest_step()))

    def _choose_memory(self, entry: dict[str, Any]) -> None:
        """``memory_every_steps: auto``: at the first memory copy whose stall is measured, once
        a step time is known, the interval the cost model gives is asked of the ranks and
        said, with its figures."""
        stall = finite(entry.get("stall_s"))
        step_s = self.advisor.step_s()
        if self._memory_chosen or stall is None or step_s is None:
            return
        self._memory_chosen = True
        tau, _ = estimate_tau(self.advisor.observed_s, self.advisor.interruption_count,
                              self.advisor.mtbf_prior_s)
        advice = memory_advice(stall, tau, step_s, self.advisor.every_steps)
        # The ranks switch together at a copy they agree on (``memory_copy.Copier``).
        start = self._newest_step() + 1
        self.memory_every = advice.every_steps
        self._request(memory_every=advice.every_steps, memory_from_step=start)
        self._journal("memory_cadence", from_step=start, summary=advice.summary(),
                      **advice.to_json())
        self._log(f"babysit: {advice.summary()}")

    def closing(self) -> list[Entry]:
        """The whole run's advice, for status and report (none when there is nothing to
        advise)."""
        advice = self.advisor.advice()
        if advice is None:
            return []
        return [("cadence_advice", {"summary": advice.summary(), "final": True,
                                    **advice.to_json()})]

    def _ran_until(self, t: float) -> None:
        if self._running_since is not None:
            self.advisor.on_run_time(t - self._running_since)
            self._running_since = t

    def _advise(self, newest: int) -> None:
        """A checkpoint was saved: journal the advice when it moved (``told`` when the console
        says it too: ``_worth_telling``); adopt it when ``auto``."""
        old = self.advisor.every_steps
        advice, adoption = self.keeper.after_checkpoint(newest)
        current = self.advisor.advice() if advice is None else advice
        if current is not None:
            self._recent.append(current.optimal_steps)
        told = current is not None and self._worth_telling(current)
        if current is not None and (advice is not None or told):
            self._journal("cadence_advice", summary=current.summary(),
                          **({"told": True} if told else {}), **current.to_json())
        if told and current is not None:
            self._told = True
            self._log(f"babysit: {in_words(current)}")
        if adoption is None:
            return
        self._request(checkpoint_every=adoption.every_steps, from_step=adoption.from_step)
        self._journal("cadence_adopted", old_every=old, new_every=adoption.every_steps,
                      from_step=adoption.from_step,
                      reason="checkpoints.cadence.auto: the advised interval is outside the "
                             "20% band around the one in force")
        self._log(f"babysit: cadence: checkpointing every {adoption.every_steps} steps from "
                  f"step {adoption.from_step} (was {old})")

    def _worth_telling(self, advice: Advice) -> bool:
        """Whether the console should say ``advice``: once a run, where it would change what
        the user does: babysit does not adopt it itself (``auto``), it settled (``SETTLED``),
        and the configured interval is far from it (``FAR``)."""
        if self._told or self.keeper.auto or advice.tau_source != "observed":
            return False
        recent = self._recent
        if len(recent) < self.SETTLED or max(recent) > self.SETTLED_BAND * min(recent):
            return False
        ours, best = advice.configured_steps, advice.optimal_steps
        return max(ours, best) >= self.FAR * min(ours, best)


def in_words(advice: Advice) -> str:
    """The advice as the console says it (``Advice.summary`` has the figures, for ``babysit
    status`` and the journal)."""
    ours = advice.configured_steps
    why = ("are more frequent than this run needs" if ours < advice.optimal_steps
           else "leave too much work to redo at each failure")
    return (f"checkpoints every {ours} steps {why}: every {advice.optimal_steps} steps would "
            f"waste {advice.waste_optimal:.1%} of its time instead of "
            f"{advice.waste_configured:.1%}, going by its {advice.interruptions} interruptions "
            f"in {duration(advice.observed_s)} (set checkpoints.every_steps, or "
            f"checkpoints.cadence.auto: true to let babysit adapt it; `babysit status` has the "
            f"figures)")
