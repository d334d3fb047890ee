"""The rules engine: a finding in, the policy's remedy out.

``Rules(policy).on_finding(finding, now) -> Remedy`` applies, in this order:

1. severity: findings below the incident's ``act_on`` get its ``below`` action (alert/ignore);
2. cooldown: a finding within ``cooldown_s`` seconds or ``cooldown_steps`` steps *after* the
   incident's last intervention is only journaled (IGNORE);
3. the ladder: the n-th intervention for an incident takes rung n (the last rung repeats); the
   ladder resets after ``reset_after_steps`` / ``reset_after_s`` of quiet;
   crashes follow the ``crash`` section instead: per-class relaunch limits, exponential backoff
   (from the second crash of a class, unless ``first_relaunch_at_once`` is off),
   stop on a deterministic repeat, numerical crashes rolled back; but first, a hang or a crash
   that came back is held against the earlier ones (``policies/cause.py``): one that follows
   the data is rolled back past its batches, one that follows the step count stops the run;
4. the rollback itself (``policies/rollback.py``'s ``plan``, the one place that decides it):
   the checkpoint, the skip sizes (wider when the same region spikes again), the LR cut and its
   re-warm; SDC rollbacks skip nothing and keep the LR; a spike's or a NaN's rollback first
   reruns the same steps, skipping nothing (``policies/rerun.py``, within the policy's bounds):
   the anomaly back on the rerun is the data's and gets the skip and the cut without climbing
   the ladder again (nor being charged to the budget: it ends the same intervention);
5. budget: a disruptive remedy (rollback, relaunch) that would exceed ``max_interventions`` in
   ``window_s`` becomes STOP; a relaunch that grows a multi-node job back (``node_joined``) is
   not charged.

``Rules(policy).judge(finding, now, known) -> (Remedy, Plan | None)`` does the same and also
returns the rollback's whole plan (skip range and LR orders placed with ``known``'s cursors
and orders) for the supervisor to carry out.

Pure: the clock is the ``now`` argument (seconds, any epoch, non-decreasing), there is no I/O,
and ``state_dict()`` / ``load_state_dict()`` carry everything through a supervisor restart.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from babysit.policies import cause, rerun, rollback
from babysit.policies.cause import Fault, Follows
from babysit.policies.rollback import Known, Plan, Region, Shelf
from babysit.policies.schema import Policy, Response
from babysit.policies.types import Action, Finding, Incident, Remedy, Severity
from babysit.policies.wording import said_ranks

_DISRUPTIVE = (Action.ROLLBACK, Action.RELAUNCH)
_SEVERITY = {"warning": Severity.WARNING, "critical": Severity.CRITICAL}


class Rules:
    """Turns findings into remedies per the policy; see the module docstring."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        # Per incident: next rung, step and time of the last intervention.
        self._ladders: dict[str, dict[str, Any]] = {}
        # Every rollback's skipped cursor range [lo, hi) and its escalation generation.
        self._rollbacks: list[Region] = []
        # Times of disruptive interventions (budget) and of crash relaunches per class.
        self._interventions: list[float] = []
        self._crashes: dict[str, list[float]] = {}
        # Where the run's hangs and crashes struck (``policies/cause.py``), oldest first.
        self._faults: list[Fault] = []

    def on_finding(self, finding: Finding, now: float, checkpoint: bool = True) -> Remedy:
        """``checkpoint``: a good checkpoint from before the onset exists (the caller knows the
        catalog). Without one a spike's rollback would restart the run from scratch, which
        loses more than the spike: it becomes an alert that says why, and uses up no rung, no
        budget and no escalation (a NaN or a crash still relaunches)."""
        return self.judge(finding, now, Known(shelf=None if checkpoint else Shelf()))[0]

    def judge(self, finding: Finding, now: float,
              known: Known = rollback.NOTHING_KNOWN) -> tuple[Remedy, Plan | None]:
        """The remedy for ``finding`` and, when it is a rollback, its whole plan
        (``rollback.plan``) from what the supervisor ``known``s: the checkpoints (a spike with
        no good one before its onset is an alert instead, as ``on_finding`` says), the cursor
        memory and the LR orders in force. ``now``: as for ``on_finding``."""
        caused = self._cause(finding, known)
        reproduced = rerun.taken_as_data(finding)
        if reproduced:
            remedy, plan = self._reproduced(finding, known)
        elif caused is not None:
            remedy, plan = caused
        elif finding.incident is Incident.CRASH:
            remedy, plan = self._crash(finding, now, known)
        else:
            remedy, plan = self._incident(finding, now, known)
        if plan is not None and plan.region is not None:
            # Remembered even when the budget stops the run instead: the region did spike.
            self._rollbacks.append(plan.region)
        if not reproduced and finding.incident is not Incident.NODE_JOINED:
            remedy = self._charge(remedy, now)  # (growing the job back is no fault's remedy)
        return remedy, plan if remedy.action is Action.ROLLBACK else None

    # -- ladders ----------------------------------------------------------------------------

    def _incident(self, finding: Finding, now: float,
                  known: Known) -> tuple[Remedy, Plan | None]:
        resp: Response = getattr(self.policy.incidents, finding.incident.value)
        name = finding.incident.value
        if finding.severity < _SEVERITY[resp.act_on]:
            return Remedy(resp.below, finding, f"{finding.severity.name.lower()} {name}: below "
                          f"act_on={resp.act_on}, so {resp.below.value} only"), None
        st = self._ladders.setdefault(name, {"rung": 0, "step": None, "time": None})
        if st["step"] is not None:
            since_s = now - st["time"]
            since_steps = finding.step - st["step"]
            if since_s < resp.cooldown_s or 0 <= since_steps < resp.cooldown_steps:
                return Remedy(Action.IGNORE, finding, f"inside the {name} cooldown: last "
                              f"intervention at step {st['step']}, {since_s:.0f}s ago"), None
            stale_steps = resp.reset_after_steps is not None and \
                since_steps >= resp.reset_after_steps
            stale_time = resp.reset_after_s is not None and since_s >= resp.reset_after_s
            if stale_steps or stale_time:
                st["rung"] = 0
        rung = min(st["rung"], len(resp.ladder) - 1)
        action = resp.ladder[rung]
        if action is Action.ROLLBACK and rollback.rerun_pays(finding, self.policy.rollback,
                                                             self._rollbacks, known):
            finding = rerun.ask(finding)
        plan = self._plan(finding, known) if action is Action.ROLLBACK else None
        if plan is not None and not plan.possible and finding.incident is Incident.RESUME:
            return Remedy(Action.STOP, finding, f"{name}: no good checkpoint older than step "
                          f"{finding.onset_step} to try instead: stopped rather than train on "
                          "what the resume left"), None
        if plan is not None and not plan.possible:
            return Remedy(Action.ALERT, finding, f"{name}: not rolled back: no good checkpoint "
                          f"from before step {finding.onset_step} to go back to, and restarting "
                          "from scratch would lose more than the spike. Save checkpoints ("
                          "babysit run --checkpoint-every N, or checkpoints.every_steps in the "
                          "config, with attach(model=...)) to make spikes recoverable"), None
        st.update(rung=st["rung"] + 1, step=finding.step, time=now)
        why = f"{name} intervention {rung + 1} -> ladder rung {rung + 1}/{len(resp.ladder)}: " \
              f"{action.value}"
        if plan is not None:
            return _rollback_remedy(plan, why), plan
        return Remedy(action, finding, why), None

    # -- rollbacks --------------------------------------------------------------------------

    def _plan(self, finding: Finding, known: Known) -> Plan:
        return rollback.plan(finding, self.policy.rollback, self._rollbacks, known)

    def _reproduced(self, finding: Finding, known: Known) -> tuple[Remedy, Plan | None]:
        """A spike or a NaN that came back on its rerun (``policies/rerun.py``): the data's.
        The rollback its rung chose, now with the skip and the cut: no new rung, no cooldown."""
        plan = self._plan(finding, known)
        verdict = finding.evidence.get("rerun_verdict", {})
        why = str(verdict.get("summary", f"{finding.incident.value} reproduced on the rerun"))
        if not plan.possible:
            return Remedy(Action.ALERT, finding, f"{why}, but no good checkpoint from before "
                          f"step {finding.onset_step} is left to roll back to"), None
        return _rollback_remedy(plan, why + ": rolled back"), plan

    # -- what a repeated fault follows ---------------------------------------------------------

    def _cause(self, finding: Finding, known: Known) -> tuple[Remedy, Plan | None] | None:
        """A hang or a crash held against the earlier ones (``policies/cause.py``): the remedy
        when it follows the data or the code, None when it has not shown what it follows."""
        fault = cause.place(finding, known.cursor_at, known.skips) or cause.at_step(finding)
        if fault is None or not self.policy.rollback.skip_repeated_faults:
            return None
        follows, earlier = cause.follows(fault, self._faults)
        self._faults = [*self._faults[-(cause.KEEP - 1):], fault]
        name = fault.incident
        if follows is Follows.DATA:
            size = fault.end - fault.start
            remedy = Remedy(Action.ROLLBACK, rollback.skip_data(finding, fault),
                            f"same {name} at {fault.where()} twice -> the data's: rolled back "
                            f"and {fault.batches()} skipped, the LR unchanged",
                            skip_before=size - 1, skip_after=0)
            return remedy, rollback.for_remedy(remedy, known)
        if follows is Follows.THE_STEP:
            ranks = said_ranks(fault.ranks) if fault.ranks else "every rank"
            stuck = replace(finding, evidence={**finding.evidence, "follows": "step"})
            return Remedy(Action.STOP, stuck, f"same {name} at step {fault.step} on "
                          f"{ranks} twice: a relaunch would meet it again, and with no data "
                          "cursor babysit can neither tell the data's fault from the code's "
                          "nor skip the batch (read the data through run.batches() for that)"
                          ), None
        if follows is Follows.CODE:
            assert earlier is not None
            code = replace(finding, evidence={**finding.evidence, "follows": "code"})
            return Remedy(Action.STOP, code, f"same {name} at step {fault.step} on "
                          f"{fault.batches()} as on {earlier.batches()} before: it follows the "
                          "step count, not the data -> the code's (an evaluation, a save or a "
                          "schedule at that step?); a relaunch would meet it again"), None
        return None

    # -- crashes ----------------------------------------------------------------------------

    def _crash(self, finding: Finding, now: float,
               known: Known) -> tuple[Remedy, Plan | None]:
        cp = self.policy.crash
        ev = finding.evidence
        cls = str(ev.get("class", "unknown"))
        if cp.stop_on_deterministic and ev.get("deterministic"):
            return Remedy(Action.STOP, finding, f"{cls} crash repeated with the same signature "
                          f"at the same step ({ev.get('signature')}): deterministic, a relaunch "
                          "would reproduce it"), None
        times = self._crashes.setdefault(cls, [])
        if cp.forget_after_s is not None:
            times[:] = [t for t in times if now - t < cp.forget_after_s]
        limit = getattr(cp.max_relaunches, cls, cp.max_relaunches.unknown)
        if len(times) >= limit:
            return Remedy(Action.STOP, finding, f"{cls} crash: {len(times)} relaunch(es) for "
                          f"this class already, limit crash.max_relaunches.{cls}={limit}"), None
        waits = len(times) - 1 if cp.first_relaunch_at_once else len(times)
        backoff = min(cp.backoff_base_s * 2 ** waits, cp.backoff_max_s) if waits >= 0 else 0.0
        times.append(now)
        why = f"{cls} crash {len(times)}/{limit}"
        if cls == "numerical" and cp.rollback_numerical:
            plan = self._plan(finding, known)
            r = _rollback_remedy(plan, why + ": numerical, so roll back past it")
            return replace(r, backoff_s=backoff), plan
        when = f"after {backoff:g}s" if backoff else "at once"
        return Remedy(Action.RELAUNCH, finding, f"{why}: relaunch {when}",
                      backoff_s=backoff), None

    # -- budget -----------------------------------------------------------------------------

    def _charge(self, remedy: Remedy, now: float) -> Remedy:
        if remedy.action not in _DISRUPTIVE:
            return remedy
        b = self.policy.budget
        self._interventions = [t for t in self._interventions if now - t < b.window_s]
        if len(self._interventions) >= b.max_interventions:
            return Remedy(Action.STOP, remedy.finding, f"intervention budget exhausted: "
                          f"{len(self._interventions)} rollbacks/relaunches in the last "
                          f"{b.window_s:g}s (budget.max_interventions={b.max_interventions}); "
                          f"would have done: {remedy.action.value}")
        self._interventions.append(now)
        return remedy

    # -- persistence ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "ladders": {k: dict(v) for k, v in self._ladders.items()},
            "rollbacks": [{"lo": r.lo, "hi": r.hi, "gen": r.gen} for r in self._rollbacks],
            "interventions": list(self._interventions),
            "crashes": {k: list(v) for k, v in self._crashes.items()},
            "faults": [f.to_json() for f in self._faults],
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self._ladders = {k: dict(v) for k, v in d["ladders"].items()}
        self._rollbacks = [Region(int(r["lo"]), int(r["hi"]), int(r["gen"]))
                           for r in d["rollbacks"]]
        self._interventions = [float(t) for t in d["interventions"]]
        self._crashes = {k: [float(t) for t in v] for k, v in d["crashes"].items()}
        self._faults = [Fault.from_json(f) for f in d.get("faults", ())]


def _rollback_remedy(plan: Plan, why: str) -> Remedy:
    """The remedy that carries ``plan``'s sizes and LR (journaled, and read back by a
    supervisor taking over)."""
    assert plan.finding is not None  # a rollback always answers a finding
    return Remedy(Action.ROLLBACK, plan.finding, why + plan.note, skip_before=plan.skip_before,
                  skip_after=plan.skip_after, lr_scale=plan.lr_factor, lr_rewarm=plan.lr_rewarm)
