"""Checkpoint cadence advice: how often to checkpoint so that saves and lost work waste the least.

A run that checkpoints every T seconds of training pays two prices. Each save stalls training
for C seconds (the blocking part of the save), so saves waste about C/T of the time. Each
interruption (a crash, a hang, a rollback, a preemption that got no final checkpoint) throws
away the work since the last checkpoint, T/2 on average; with interruptions every tau seconds on
average that is T/(2 tau) of the time. The total

    waste(T) ~= C/T + T/(2 tau)

is least at Young's interval T* = sqrt(2 C tau), where it is sqrt(2 C / tau) (J. W. Young, "A
first order approximation to the optimum checkpoint interval", CACM 17(9), 1974). Daly's
higher-order form (J. T. Daly, "A higher order estimate of the optimum checkpoint interval for
restart dumps", FGCS 22(3), 2006) differs from Young's by about (1/3) sqrt(C / 2 tau) - C/T*
relative; that matters only when C is not much smaller than tau (a few percent at C/tau = 0.01),
and the waste curve is flat near its minimum (10% off T* costs 0.5% more waste), so babysit uses
Young's.

Where the numbers come from on a babysit run (see docs/cadence.md):

- C: the median of the last few ``blocking_s`` that rank 0 reports with each checkpoint.
- tau: n interruptions over T_obs seconds of running time, pooled with a prior of one
  interruption per ``mtbf_prior_s`` (default a day): tau = (T_obs + tau0) / (n + 1). An
  interruption whose just-in-time state was saved (``checkpoints/just_in_time.py``) lost one
  step, not the work since the last checkpoint: it is counted apart (``covered``) and not in n,
  so a run whose faults the live ranks cover is advised sparser saves.
- seconds to steps: the median of recent step times.

Everything here is pure: no I/O and no clock; the loop passes times in. ``CadenceAdvisor`` is fed
live by the loop, or rebuilt from a run's journal by ``advisor_from_journal``.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any, Literal

from babysit.supervisor.contract.protocol import finite

DEFAULT_MTBF_PRIOR_S = 86_400.0
"""A day between interruptions. Llama 3 405B pretraining on 16,384 H100s saw 466 job
interruptions in 54 days, 419 of them unexpected ("The Llama 3 Herd of Models", Meta, 2024,
section 3.3.4): an unexpected one every 3.1 h. If failures scale with the number of GPUs, that is
a day between them at about 2,000 GPUs; fewer GPUs fail less often, so for most jobs a day is on
the cautious side (it advises more frequent checkpoints). After about a day of running the run's
own record outweighs it."""

INTERRUPTING_ACTIONS = frozenset({"rollback", "relaunch", "stop"})
"""Remedy actions (``Action`` values) that end the workers and lose the work since the last
(good) checkpoint: a finding answered with one of these is an interruption."""

TauSource = Literal["prior", "observed", "mixed"]

_STATE_VERSION = 1
_KEEP_INTERRUPTIONS = 64


@dataclass(frozen=True, slots=True)
class Advice:
    """What the cadence should be, with the numbers it rests on. Times in seconds, waste as
    fractions of the run's time (0.02 = 2%)."""

    blocking_s: float
    """C: median blocking seconds of the recent checkpoints."""
    tau_s: float
    """Mean seconds between interruptions, pooled with the prior."""
    tau_source: TauSource
    """"prior": no interruption yet and less running time than the prior is worth; "observed":
    the run supplied most of both the interruptions (n >= 2) and the time; "mixed" otherwise."""
    interruptions: int
    """Interruptions that lost the work since the last checkpoint (in tau)."""
    observed_s: float
    """Running time observed (the workers in the running state)."""
    step_s: float
    """Median seconds per step, used to turn seconds into steps."""
    optimal_interval_s: float
    """Young's T* = sqrt(2 C tau)."""
    optimal_steps: int
    """T* in whole steps, at least 1."""
    configured_steps: int
    """The cadence in force: the config's ``every_steps`` until another was adopted."""
    waste_configured: float
    waste_optimal: float
    """At ``optimal_steps`` whole steps."""
    covered: int = 0
    """Interruptions just-in-time state covered (one step lost each): not in tau."""

    def summary(self) -> str:
        """One line for the console and ``babysit status``."""
        return (
            f"checkpoint every {self.optimal_steps} steps (configured "
            f"{self.configured_steps}): C={duration(self.blocking_s)}, "
            f"tau={duration(self.tau_s)} ({self.tau_source}; {self.interruptions} "
            f"interruption{'' if self.interruptions == 1 else 's'} in "
            f"{duration(self.observed_s)}"
            + (f", {self.covered} more covered by just-in-time state or a memory copy"
               if self.covered else "")
            + f") -> T*={duration(self.optimal_interval_s)} at "
            f"{duration(self.step_s)}/step; waste {self.waste_configured:.2%} -> "
            f"{self.waste_optimal:.2%}")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def optimal_interval(blocking_s: float, tau_s: float) -> float:
    """Young's T* = sqrt(2 C tau), in seconds of training between checkpoints."""
    return math.sqrt(2.0 * blocking_s * tau_s)


@dataclass(frozen=True, slots=True)
class MemoryAdvice:
    """How often to copy the state into the nodes' shared memory (``checkpoints.memory``), by
    the same arithmetic as the checkpoints on disk: a copy stalls ``stall_s``, and every
    interruption loses the steps since the last one. Times in seconds."""

    every_steps: int
    stall_s: float
    tau_s: float
    step_s: float
    disk_every: int
    """The checkpoints on disk's interval: copies less often than that would add nothing."""

    def summary(self) -> str:
        interval = optimal_interval(self.stall_s, self.tau_s)
        waste = waste_fraction(self.every_steps * self.step_s, self.stall_s, self.tau_s)
        return (f"memory copies every {self.every_steps} steps: a copy stalls "
                f"{duration(self.stall_s)}, an interruption every {duration(self.tau_s)} -> "
                f"T*={duration(interval)} at {duration(self.step_s)}/step"
                + (f", at most the disk's {self.disk_every}"
                   if self.every_steps == self.disk_every and self.disk_every else "")
                + f"; waste {waste:.2%}")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def memory_advice(stall_s: float, tau_s: float, step_s: float, disk_every: int) -> MemoryAdvice:
    """Young's interval for memory copies, in whole steps, from 1 to the disk's interval."""
    steps = max(1, round(optimal_interval(stall_s, tau_s) / step_s)) if step_s > 0 else 1
    if disk_every > 0:
        steps = min(steps, disk_every)
    return MemoryAdvice(steps, stall_s, tau_s, step_s, disk_every)


def waste_fraction(interval_s: float, blocking_s: float, tau_s: float) -> float:
    """Expected fraction of time lost to saves and re-done work: C/T + T/(2 tau).

    First order in C/T and T/tau; an interval of 0 wastes everything (inf)."""
    if interval_s <= 0:
        return math.inf
    return blocking_s / interval_s + interval_s / (2.0 * tau_s)


def estimate_tau(observed_s: float, interruptions: int,
                 prior_s: float = DEFAULT_MTBF_PRIOR_S) -> tuple[float, TauSource]:
    """Mean seconds between interruptions and which evidence dominated it.

    The prior counts as one interruption in ``prior_s`` seconds of running, pooled with the
    run's own ``interruptions`` in ``observed_s``: tau = (observed_s + prior_s) /
    (interruptions + 1), the posterior mean-time estimate under a gamma prior on the rate. It
    is finite from the start, equals the prior before anything was observed, and tends to the
    run's own observed_s / interruptions as those grow.
    """
    tau = (observed_s + prior_s) / (interruptions + 1)
    # The prior's shares of the pooled time and of the pooled interruptions.
    time_share = prior_s / (observed_s + prior_s)
    count_share = 1.0 / (interruptions + 1)
    source: TauSource
    if time_share > 0.5 and count_share > 0.5:
        source = "prior"
    elif time_share < 0.5 and count_share < 0.5:
        source = "observed"
    else:
        source = "mixed"
    return tau, source


class CadenceAdvisor:
    """Collects checkpoint costs, step times, interruptions and running time; says the best
    cadence.

    Calling rules (the loop, one thread): ``on_checkpoint`` for each checkpoint rank 0 reports
    with ``blocking_s``; ``on_step_time`` for each step record (its step time); ``on_run_time``
    with the seconds the workers ran since the last call (every tick while running, or once when
    an attempt ends: only the sum counts); ``on_interruption`` once per event that lost the work
    since the last checkpoint. Set ``every_steps`` when the cadence in force changes. Bad inputs
    (negative, NaN, inf) are ignored: a garbled report must not move the advice.
    """

    def __init__(self, every_steps: int, mtbf_prior_s: float = DEFAULT_MTBF_PRIOR_S,
                 window: int = 8, step_window: int = 64) -> None:
        if not (math.isfinite(mtbf_prior_s) and mtbf_prior_s > 0):
            raise ValueError(
                f"checkpoints.cadence.mtbf_prior_s must be a positive number of seconds, not "
                f"{mtbf_prior_s!r}; 86400 (a day between interruptions) is the default.")
        if window < 1 or step_window < 1:
            raise ValueError("window and step_window must be at least 1")
        self.every_steps = every_steps
        """The cadence in force, in steps (0: babysit saves no checkpoints, nothing to
        advise)."""
        self.mtbf_prior_s = mtbf_prior_s
        self._blocking: deque[float] = deque(maxlen=window)
        self._step_times: deque[float] = deque(maxlen=step_window)
        self._interruptions: deque[tuple[str, float]] = deque(maxlen=_KEEP_INTERRUPTIONS)
        self.interruption_count = 0
        self.covered_count = 0
        """Interruptions just-in-time state covered (``cover``): not in tau."""
        self.observed_s = 0.0

    # -- inputs ---------------------------------------------------------------------------------

    def on_checkpoint(self, blocking_s: float) -> None:
        """A checkpoint stalled training for ``blocking_s`` seconds."""
        if _valid(blocking_s, allow_zero=True):
            self._blocking.append(float(blocking_s))

    def on_step_time(self, seconds: float) -> None:
        """One step took ``seconds`` (wall time per step as the job sees it)."""
        if _valid(seconds, allow_zero=False):
            self._step_times.append(float(seconds))

    def on_run_time(self, seconds: float) -> None:
        """The workers ran (could fail and lose work) for ``seconds`` more."""
        if _valid(seconds, allow_zero=True):
            self.observed_s += float(seconds)

    def on_interruption(self, kind: str, wall_time: float) -> None:
        """Something lost the work since the last checkpoint: ``kind`` says what (an incident
        such as "crash" or "hang", "preemption", "supervisor_lost"), ``wall_time`` when (Unix
        seconds; kept for the record, the estimate uses only the count)."""
        self.interruption_count += 1
        self._interruptions.append((kind, float(wall_time)))

    def cover(self, interruption: tuple[str, float] | None) -> None:
        """An interruption lost no more than the step it interrupted (its just-in-time state was
        saved): ``interruption``, counted already by ``on_interruption``, is taken back out of
        tau; None: one that was not counted."""
        self.covered_count += 1
        if interruption is not None and interruption in self._interruptions:
            self._interruptions.remove(interruption)
            self.interruption_count -= 1

    @property
    def interruptions(self) -> list[tuple[str, float]]:
        """The most recent interruptions, oldest first, as (kind, wall_time)."""
        return list(self._interruptions)

    # -- output ---------------------------------------------------------------------------------

    def step_s(self) -> float | None:
        """The median of the recent step times (None: none seen yet)."""
        return statistics.median(self._step_times) if self._step_times else None

    def advice(self) -> Advice | None:
        """The advice, or None until a checkpoint cost and a step time are known (or when
        babysit saves no checkpoints)."""
        if self.every_steps < 1 or not self._blocking or not self._step_times:
            return None
        blocking = statistics.median(self._blocking)
        step_s = statistics.median(self._step_times)  # (step_s() above: not None here)
        tau, source = estimate_tau(self.observed_s, self.interruption_count, self.mtbf_prior_s)
        interval = optimal_interval(blocking, tau)
        steps = max(1, round(interval / step_s))
        return Advice(
            blocking_s=blocking, tau_s=tau, tau_source=source,
            interruptions=self.interruption_count, observed_s=self.observed_s, step_s=step_s,
            optimal_interval_s=interval, optimal_steps=steps, configured_steps=self.every_steps,
            waste_configured=waste_fraction(self.every_steps * step_s, blocking, tau),
            waste_optimal=waste_fraction(steps * step_s, blocking, tau),
            covered=self.covered_count)

    # -- takeover -------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The history, JSON-safe. The prior and ``every_steps`` are configuration, not
        history: they are not in it."""
        return {
            "version": _STATE_VERSION,
            "blocking": list(self._blocking),
            "step_times": list(self._step_times),
            "interruptions": [[kind, t] for kind, t in self._interruptions],
            "interruption_count": self.interruption_count,
            "covered_count": self.covered_count,
            "observed_s": self.observed_s,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state_dict()``'s history (windows keep their newest entries)."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"cadence state version {state.get('version')!r} is not "
                             f"{_STATE_VERSION}; rebuild it from the journal instead")
        self._blocking.clear()
        self._blocking.extend(float(v) for v in state["blocking"])
        self._step_times.clear()
        self._step_times.extend(float(v) for v in state["step_times"])
        self._interruptions.clear()
        self._interruptions.extend((str(k), float(t)) for k, t in state["interruptions"])
        self.interruption_count = int(state["interruption_count"])
        self.covered_count = int(state.get("covered_count", 0))
        self.observed_s = float(state["observed_s"])


def adopt(advice: Advice, current_steps: int, min_steps: int, max_steps: int,
          tolerance: float = 0.2) -> int | None:
    """The ``every_steps`` to switch to, or None to keep ``current_steps``.

    The advice's ``optimal_steps``, clamped to ``[min_steps, max_steps]``, is adopted when it
    differs from ``current_steps`` by more than ``tolerance`` as a ratio (larger / smaller - 1,
    so the band is the same going up and down). That band is the hysteresis: after a switch the
    estimate must move by more than ``tolerance`` again before the next one, and near T* it
    costs little to be off (20% off wastes 1.7% more than optimal). A cadence outside the bounds
    is brought inside them. ``current_steps`` < 1 (babysit saves nothing): None.
    """
    if min_steps < 1 or max_steps < min_steps:
        raise ValueError(
            f"checkpoints.cadence: min_steps ({min_steps}) must be at least 1 and at most "
            f"max_steps ({max_steps}); fix the bounds in the config.")
    if tolerance < 0:
        raise ValueError(f"tolerance must be >= 0, not {tolerance}")
    if current_steps < 1:
        return None
    target = min(max(advice.optimal_steps, min_steps), max_steps)
    if max(target, current_steps) / min(target, current_steps) - 1.0 > tolerance:
        return target
    return None


# -- rebuilding from the journal ----------------------------------------------------------------


def advisor_from_journal(entries: Iterable[dict[str, Any]], every_steps: int,
                         mtbf_prior_s: float = DEFAULT_MTBF_PRIOR_S) -> CadenceAdvisor:
    """A fresh advisor fed with a run's journal (``journal.read()``), e.g. for a supervisor
    taking over, ``babysit status`` or the report."""
    advisor = CadenceAdvisor(every_steps, mtbf_prior_s)
    replay_journal(advisor, entries)
    return advisor


def replay_journal(advisor: CadenceAdvisor, entries: Iterable[dict[str, Any]]) -> None:
    """Feed ``advisor`` what a journal says, in order. The journal fields it relies on:

    - ``state`` (``old``, ``new``): running time is the time between entering and leaving
      "running"; a supervisor that died while running is charged up to its last entry.
    - ``finding`` (``finding.incident``, ``remedy.action``): an interruption of that incident's
      kind when the action is rollback, relaunch or stop.
    - ``final_checkpoint_requested`` then ``final_checkpoint`` (``saved``): a preemption is an
      interruption only when its final checkpoint was not saved (or never confirmed before the
      next supervisor started); a saved one lost nothing.
    - ``run_started``, ``run_finished``, ``supervisor_takeover`` (``inherited_remedy``): a
      supervisor that vanished without ``run_finished`` lost its running workers
      ("supervisor_lost"), unless the finding it had already journaled counted it.
    - ``checkpoint_saved`` (``data.blocking_s``): checkpoint costs; and, between two of one
      attempt, (seconds between them - blocking_s) / steps between them as the step time.
    - ``just_in_time`` (``outcome`` saved): the interruption of its attempt is covered
      (``Covering``).
    """
    running_since: float | None = None
    last_time: float | None = None
    finished = True  # no segment before the first run_started to have died
    previous_unfinished, previous_end = False, 0.0
    final_requested: float | None = None
    last_save: tuple[Any, int, float] | None = None  # (attempt, step, time)
    covering = Covering(advisor)
    for entry in entries:
        t = finite(entry.get("time"))
        if t is None:
            continue
        event = entry.get("event")
        if event == "run_started":
            if running_since is not None and last_time is not None:
                advisor.on_run_time(last_time - running_since)
            running_since = None
            previous_unfinished, previous_end = not finished, last_time or t
            if final_requested is not None:  # the supervisor ended inside the grace period
                advisor.on_interruption("preemption", final_requested)
                final_requested, previous_unfinished = None, False  # one loss, counted
            finished = False
            last_save = None
        elif event == "state":
            if entry.get("old") == "running" and running_since is not None:
                advisor.on_run_time(t - running_since)
                running_since = None
            if entry.get("new") == "running" and running_since is None:
                running_since = t
        elif event in Covering.EVENTS:
            covering.hear(entry, t)
        elif event == "final_checkpoint_requested":
            final_requested = t
        elif event == "final_checkpoint":
            if final_requested is not None and not entry.get("saved"):
                advisor.on_interruption("preemption", final_requested)
            final_requested = None
        elif event == "run_finished":
            finished = True
        elif event == "supervisor_takeover":
            if previous_unfinished and not entry.get("inherited_remedy"):
                advisor.on_interruption("supervisor_lost", previous_end)
        elif event == "checkpoint_saved":
            last_save = _checkpoint_saved(advisor, entry, t, last_save)
        last_time = t
    if running_since is not None and last_time is not None:
        advisor.on_run_time(last_time - running_since)  # still running, as far as we know


class Covering:
    """Interruptions and the just-in-time saves that cover them, matched by attempt: a crash's
    save comes before its finding (its ranks hold on while it is written), a hang's after (it is
    written just before the workers are stopped). A relaunch that resumed from a memory copy
    (``resume`` of origin ``memory``) covers its attempt's interruption too: only a loss of the
    whole job's memory needs the disk. Feeds ``advisor``, live and replayed alike."""

    EVENTS = ("finding", "just_in_time", "resume")

    def __init__(self, advisor: CadenceAdvisor) -> None:
        self.advisor = advisor
        self._saved: set[Any] = set()
        self._counted: dict[Any, tuple[str, float]] = {}

    def hear(self, entry: dict[str, Any], t: float) -> None:
        attempt = entry.get("attempt")
        if entry.get("event") == "resume":  # the attempt before it was the interrupted one
            if entry.get("origin") != "memory" or not isinstance(attempt, int):
                return
            entry, attempt = {"event": "just_in_time", "outcome": "saved"}, attempt - 1
        if entry.get("event") == "just_in_time":
            if entry.get("outcome") == "saved" and attempt not in self._saved:
                self._saved.add(attempt)
                counted = self._counted.pop(attempt, None)
                if counted is not None:
                    self.advisor.cover(counted)
            return
        kind = interruption(entry)
        if kind is None:
            return
        if attempt in self._saved and attempt not in self._counted:
            self._counted[attempt] = (kind, t)  # one per attempt is covered: this one
            self.advisor.cover(None)
            return
        self.advisor.on_interruption(kind, t)
        self._counted.setdefault(attempt, (kind, t))


def interruption(entry: dict[str, Any]) -> str | None:
    """The kind of interruption a ``finding`` journal entry records (its incident), or None when
    its remedy kept the workers (``INTERRUPTING_ACTIONS``). Live (``cadence_live``) and replayed
    alike; a malformed entry counts as a "finding"."""
    remedy, finding = entry.get("remedy"), entry.get("finding")
    if not (isinstance(remedy, dict) and remedy.get("action") in INTERRUPTING_ACTIONS):
        return None
    kind = finding.get("incident") if isinstance(finding, dict) else None
    return str(kind or "finding")


def _checkpoint_saved(advisor: CadenceAdvisor, entry: dict[str, Any], t: float,
                      last: tuple[Any, int, float] | None) -> tuple[Any, int, float] | None:
    data = entry.get("data")
    if not isinstance(data, dict) or data.get("external"):
        return last
    blocking = finite(data.get("blocking_s"))
    step = data.get("step", entry.get("checkpoint_step"))
    if blocking is None or not isinstance(step, int):
        return last
    advisor.on_checkpoint(blocking)
    attempt = entry.get("attempt")
    if last is not None and last[0] == attempt and step > last[1]:
        # Includes evals and other phases: all of it is work an interruption would redo.
        advisor.on_step_time((t - last[2] - blocking) / (step - last[1]))
    return attempt, step, t


def _valid(value: float, allow_zero: bool) -> bool:
    number = finite(value)
    return number is not None and (number >= 0 if allow_zero else number > 0)


def duration(seconds: float) -> str:
    """A short human duration: "850 ms", "2.1 s", "10.6 min", "24.0 h", "3.2 d"."""
    if not math.isfinite(seconds):
        return str(seconds)
    if seconds == 0:
        return "0 s"
    if seconds < 1:
        return f"{seconds * 1000:.3g} ms"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    if seconds < 172_800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86_400:.1f} d"


# -- the loop's side ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Adoption:
    """Switch to saving every ``every_steps`` steps from step ``from_step`` on."""

    every_steps: int
    from_step: int


class CadenceKeeper:
    """When the loop journals the advice and when ``auto`` adopts a new interval. Pure.

    ``after_checkpoint(newest_step)`` is called after each checkpoint a rank reports (the
    advisor has been fed its cost). It returns the advice when it is worth journaling (the first
    one, and whenever the advised interval moved by more than ``JOURNAL_CHANGE``) and, with
    ``auto``, an ``Adoption`` that the loop writes to the attempt's control file. A switch starts
    ``lead_steps`` ahead of the newest step (at least 10, or about ``lead_s`` of steps) so that
    every rank reads it before it applies, and no new switch is made before the previous one
    took effect (a rank that missed it would disagree on the steps between).
    """

    JOURNAL_CHANGE = 0.1

    def __init__(self, advisor: CadenceAdvisor, auto: bool = False, min_steps: int = 1,
                 max_steps: int = 1_000_000, lead_s: float = 5.0) -> None:
        self.advisor = advisor
        self.auto = auto
        self.min_steps, self.max_steps = min_steps, max_steps
        self.lead_s = lead_s
        self._journaled: tuple[int, int] | None = None  # (optimal, configured) last journaled
        self._switch_at = -1

    def after_checkpoint(self, newest_step: int) -> tuple[Advice | None, Adoption | None]:
        advice = self.advisor.advice()
        if advice is None:
            return None, None
        report: Advice | None = advice
        if self._journaled is not None:
            optimal, configured = self._journaled
            moved = abs(advice.optimal_steps - optimal) > self.JOURNAL_CHANGE * optimal
            if not moved and configured == advice.configured_steps:
                report = None
        if report is not None:
            self._journaled = (advice.optimal_steps, advice.configured_steps)
        if not self.auto or newest_step < self._switch_at:
            return report, None
        every = adopt(advice, self.advisor.every_steps, self.min_steps, self.max_steps)
        if every is None:
            return report, None
        lead = max(10, math.ceil(self.lead_s / advice.step_s))
        self._switch_at = newest_step + lead
        self.advisor.every_steps = every
        return report, Adoption(every, self._switch_at)
