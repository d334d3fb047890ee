"""Hangs: a rank stops making progress for longer than any healthy stall.

State per rank: the last step it reported and when that step first arrived, plus the phase it
declared itself in (checkpoint, eval, ...). ``check(now)`` compares each rank's stall with its
allowance:

- before the rank's first step of the attempt: ``startup_s`` (imports, rendezvous, loading);
  once it said hello (attached, its checkpoint restored), ``first_step_k`` x the slowest first
  step this run has measured (hello to first step, in earlier attempts), at least
  ``first_step_floor_s``: a relaunch that resumes right before a batch its loader deadlocks on
  is named in seconds, not after ``startup_s`` (a fallback for a run with no history);
- inside a declared phase: ``phase_s`` (or the per-phase value in ``phase_allowance_s``);
- otherwise: ``max(floor_s, k x p99)`` of the recent step intervals of all ranks (2 s and 5 by
  default). Adaptive, so a model whose steps take 40 s is not called hung at 60 s, and a
  0.05 s/step model is suspected after 2 s.

A step stall is only a *suspicion*: its finding carries ``evidence["confirm"] = True`` and the
supervisor confirms it from the ranks' processes (``babysit.supervisor.node.hang``: stacks,
process state, CPU) before acting. When they show work going on (a slow eval without
``phase()``, a GC pause), the supervisor calls ``defer(now)`` and the detector stays quiet for
as long again as the stall has lasted (2 s, 4 s, 8 s, ...), until ``busy_s``: a stall that long
is a hang whatever the processes show (an endless loop is busy forever). Startup and phase
allowances are long already and need no confirmation.

Which ranks are named: with synchronous collectives one rank stuck *outside* a collective stops
first and the others block inside the next one, so everyone stops at about the same time; the
rank(s) with the oldest last step are the ones that differ, and they are named. If all stopped
at the same step none differs, and the finding says so (the stack dumps will tell).

Calling rules: the clock is always injected. ``start(now, ranks)`` at every attempt launch;
``observe(rank_step, now)`` for every report (``now`` = the supervisor's receive time; it
defaults to ``rank_step.time``, which is only safe when worker and supervisor clocks agree);
``phase(rank, name, begin, now)`` when a rank declares a phase; ``check(now, ranks_alive)``
periodically (every tick), and ``looming(now, ranks_alive)`` to read ahead before a suspicion;
``defer(now, stalled_s)`` when the supervisor found a suspected
hang's ranks working. One finding per hang: after it fires it stays quiet until a rank makes
progress again, ``defer`` re-arms it, or ``start`` is called. Units: seconds.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection
from typing import Any

from pydantic import Field

from babysit.policies.detectors._base import DetectorConfig
from babysit.policies.types import Finding, Incident, RankStep, Severity, r4
from babysit.policies.wording import said_ranks


class HangConfig(DetectorConfig):
    floor_s: float = Field(default=2.0, gt=0.0)
    """No stall shorter than this is suspected, however fast the steps are. A suspicion is
    confirmed from the ranks' stacks, process state and CPU before anything is done, so this
    need not leave room for slow evals or GC pauses."""
    k: float = Field(default=5.0, gt=1.0)
    """Suspect a stall after max(floor_s, k x recent p99 step interval)."""
    busy_s: float = Field(default=600.0, gt=0.0)
    """A rank still busy outside any collective after this many seconds without a step is
    called hung anyway (an endless loop looks busy forever)."""
    startup_s: float = Field(default=900.0, gt=0.0)
    """Allowance before a rank's first step of an attempt (launch, imports, checkpoint load),
    and after its hello as long as this run has measured no first step."""
    first_step_k: float = Field(default=5.0, gt=1.0)
    """After a rank's hello (attached and restored), its first step is allowed this many times
    the slowest first step this run measured (hello to first step: compilation, warm-up)..."""
    first_step_floor_s: float = Field(default=30.0, gt=0.0)
    """...and at least this many seconds. A stall there is confirmed from the processes like
    any step's: a rank still compiling is busy, and is given more time."""
    phase_s: float = Field(default=1800.0, gt=0.0)
    """Allowance inside a declared phase (checkpoint, eval) unless phase_allowance_s names it."""
    phase_allowance_s: dict[str, float] = Field(default_factory=dict)
    """Per-phase allowances in seconds, e.g. {checkpoint: 600, eval: 3600}."""
    history: int = Field(default=256, ge=8)
    """Recent step intervals (all ranks together) kept for the p99."""


class HangDetector:
    """Decides, from injected time, that ranks stopped progressing; see the module docstring."""

    name = "hang"

    def __init__(self, config: HangConfig | None = None) -> None:
        self.config = config or HangConfig()
        self._started: float | None = None
        self._expected: list[int] = []
        self._ranks: dict[str, dict[str, Any]] = {}
        self._intervals: deque[float] = deque(maxlen=self.config.history)
        self._first_steps: deque[float] = deque(maxlen=self.config.history)
        """Seconds from a rank's hello to its first step, over the run's attempts."""
        self._fired = False
        self._quiet_until: float | None = None

    def start(self, now: float, ranks: Collection[int] = ()) -> None:
        """A new attempt launched at ``now`` with these ranks: forget the previous attempt's
        progress (step intervals and first-step times are kept: the model did not get faster
        by relaunching)."""
        self._started = now
        self._expected = sorted(ranks)
        self._ranks = {}
        self._fired = False
        self._quiet_until = None

    def hello(self, rank: int, step: int, now: float) -> None:
        """Rank ``rank`` attached at ``now``, its checkpoint (of ``step``) restored: from here
        its first step is timed, and allowed what earlier first steps took."""
        st = self._ranks.setdefault(
            str(rank), {"step": None, "since": now, "phase": None, "phase_since": None})
        st["hello"], st["resumed"] = now, step
        if st["step"] is None:
            st["since"] = now

    def first_step_allowance(self) -> float:
        """A rank's allowance from its hello to its first step (module docstring)."""
        if not self._first_steps:
            return self.config.startup_s
        return min(self.config.startup_s, max(self.config.first_step_floor_s,
                                              self.config.first_step_k * max(self._first_steps)))

    def observe(self, rank_step: RankStep, now: float | None = None) -> None:
        t = rank_step.time if now is None else now
        st = self._ranks.setdefault(
            str(rank_step.rank), {"step": None, "since": t, "phase": None, "phase_since": None}
        )
        if st["step"] is None and st.get("hello") is not None:
            self._first_steps.append(max(0.0, t - st["hello"]))
        if st["step"] is None or rank_step.step != st["step"]:
            if st["step"] is not None and rank_step.step > st["step"]:
                # Per step, not per report: a rank that reports every 5 steps is not 5x slower.
                self._intervals.append((t - st["since"]) / (rank_step.step - st["step"]))
            st["step"] = rank_step.step
            st["since"] = t
            self._fired = False
            self._quiet_until = None

    def phase(self, rank: int, name: str, begin: bool, now: float) -> None:
        """Rank ``rank`` entered (``begin=True``) or left phase ``name`` at ``now``. Leaving a
        phase counts as progress: the step allowance restarts from there."""
        st = self._ranks.setdefault(
            str(rank), {"step": None, "since": now, "phase": None, "phase_since": None}
        )
        if begin:
            st["phase"], st["phase_since"] = name, now
        else:
            st["phase"], st["phase_since"] = None, None
            st["since"] = max(st["since"], now)
            self._fired = False
            self._quiet_until = None

    def p99(self) -> float | None:
        if not self._intervals:
            return None
        s = sorted(self._intervals)
        return s[min(len(s) - 1, int(0.99 * len(s)))]

    def step_allowance(self) -> float:
        p99 = self.p99()
        return self.config.floor_s if p99 is None else max(self.config.floor_s,
                                                            self.config.k * p99)

    def check(self, now: float, ranks_alive: Collection[int] | None = None) -> Finding | None:
        """Is anything hung at ``now``? ``ranks_alive``: ranks whose processes still run (dead
        ones are the crash classifier's business); ``None`` means every known rank."""
        if self._quiet(now):
            return None
        step_allow = self.step_allowance()
        stalled: dict[str, dict[str, Any]] = {}
        for key, st, allow, why, since in self._stalls(ranks_alive, step_allow):
            if now - since > allow:
                stalled[key] = {
                    "last_step": None if st is None else st["step"],
                    "stalled_s": r4(now - since), "allowance_s": r4(allow), "waiting_in": why,
                }
        if not stalled:
            return None
        self._fired = True
        return self._finding(now, stalled, step_allow)

    def looming(self, now: float, ranks_alive: Collection[int] | None = None,
                fraction: float = 0.5) -> bool:
        """Has some rank gone ``fraction`` of the step allowance without a step (outside any
        phase and past startup)? The supervisor then reads ahead what is slow to read about the
        ranks (their native stacks), so that a suspicion is confirmed without waiting for it.
        False while a finding stands or a deferral runs."""
        if self._quiet(now):
            return False
        step_allow = self.step_allowance()
        return any(why == "step" and now - since > fraction * step_allow
                   for _, _, _, why, since in self._stalls(ranks_alive, step_allow))

    def _quiet(self, now: float) -> bool:
        return self._fired or (self._quiet_until is not None and now < self._quiet_until)

    def _stalls(self, ranks_alive: Collection[int] | None, step_allow: float
                ) -> list[tuple[str, dict[str, Any] | None, float, str, float]]:
        """Each watched rank's (key, state, allowance, what it waits in, since when)."""
        if ranks_alive is None:
            keys = set(self._ranks) | {str(r) for r in self._expected}
        else:
            keys = {str(r) for r in ranks_alive}
        out = []
        for key in keys:
            st = self._ranks.get(key)
            since: float
            if st is not None and st["phase"] is not None:
                allow, why = self._phase_allowance(st["phase"]), f"phase {st['phase']}"
                since = st["phase_since"]
            elif st is not None and st["step"] is None and st.get("hello") is not None:
                allow, why, since = self.first_step_allowance(), "first step", st["hello"]
            elif st is None or st["step"] is None:
                starts = [t for t in (self._started, None if st is None else st["since"])
                          if t is not None]
                if not starts:
                    continue
                allow, why, since = self.config.startup_s, "startup", max(starts)
            else:
                allow, why, since = step_allow, "step", st["since"]
            out.append((key, st, allow, why, since))
        return out

    def defer(self, now: float, stalled_s: float) -> None:
        """The supervisor found the suspected ranks working (``stall.judge``): stay quiet for
        as long again as the stall has lasted (``stalled_s``), then suspect again. Progress
        ends the quiet at once."""
        self._fired = False
        self._quiet_until = now + max(stalled_s, self.step_allowance())

    def _phase_allowance(self, name: str) -> float:
        return self.config.phase_allowance_s.get(name, self.config.phase_s)

    def _finding(self, now: float, stalled: dict[str, dict[str, Any]],
                 step_allow: float) -> Finding:
        steps = {k: v["last_step"] for k, v in stalled.items()}
        known = [s for s in steps.values() if s is not None]
        if len(known) < len(steps):
            culprits = [k for k, s in steps.items() if s is None]
        else:
            oldest = min(known)
            culprits = [k for k, s in steps.items() if s == oldest]
        # A rank that resumed and never stepped is at its checkpoint's step.
        all_steps: list[int] = [
            int(at) for at in (st["step"] if st["step"] is not None else st.get("resumed")
                               for st in self._ranks.values()) if at is not None]
        newest = max(all_steps) if all_steps else None
        ranks = tuple(sorted(int(k) for k in culprits))
        p99 = self.p99()
        if p99 is not None:
            p99 = r4(p99)
        # A step stall is a suspicion the supervisor confirms (module docstring), unless it
        # has lasted busy_s or a startup/phase allowance ran out (those are long already).
        confirm = all(v["waiting_in"] in ("step", "first step") for v in stalled.values()) and \
            max(v["stalled_s"] for v in stalled.values()) < self.config.busy_s
        differs = len(culprits) < max(len(self._ranks), len(self._expected), len(stalled))
        where = min(known) if known else None
        head = (
            f"{said_ranks(ranks)} stopped progressing"
            + (f" at step {where}" if where is not None else " before their first step")
        )
        tail = (
            f" while others reached step {newest}" if differs and newest is not None
            else " (no rank differs: all stopped together; see the stack dumps)"
        )
        return Finding(
            incident=Incident.HANG,
            detector=self.name,
            severity=Severity.CRITICAL,
            step=newest if newest is not None else 0,
            onset_step=where if where is not None else 0,
            ranks=ranks,
            message=head + tail,
            evidence={"now": now, "step_allowance_s": r4(step_allow), "p99_step_s": p99,
                      "stalled": stalled, "newest_step": newest, "confirm": confirm},
        )

    def state_dict(self) -> dict[str, Any]:
        return {"started": self._started, "expected": list(self._expected),
                "ranks": {k: dict(v) for k, v in self._ranks.items()},
                "intervals": list(self._intervals), "first_steps": list(self._first_steps),
                "fired": self._fired,
                "quiet_until": self._quiet_until}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self._started = d["started"]
        self._expected = [int(r) for r in d["expected"]]
        self._ranks = {str(k): dict(v) for k, v in d["ranks"].items()}
        self._intervals = deque((float(v) for v in d["intervals"]), maxlen=self.config.history)
        self._first_steps = deque((float(v) for v in d.get("first_steps", ())),
                                  maxlen=self.config.history)
        self._fired = bool(d["fired"])
        quiet = d.get("quiet_until")
        self._quiet_until = float(quiet) if quiet is not None else None
