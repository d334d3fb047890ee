"""The rules engine: a finding in, the policy's remedy out.

``Rules(policy).on_finding(finding, now) -> Remedy`` applies, in this order:

1. severity: findings below the incident's ``act_on`` get its ``below`` action (alert/ignore);
2. cooldown: a finding within ``cooldown_s`` seconds or ``cooldown_steps`` steps *after* the
   incident's last intervention is only journaled (IGNORE);
3. the ladder: the n-th intervention for an incident takes rung n (the last rung repeats); the
   ladder resets after ``reset_after_steps`` / ``reset_after_s`` of quiet;
   crashes follow the ``crash`` section instead: per-class relaunch limits, exponential backoff
   (from the second crash of a class, unless ``first_relaunch_at_once`` is off),
   stop on a deterministic repeat, numerical crashes rolled back;
4. escalation (rollbacks): a rollback cuts the LR by ``lr_factor`` for a while (it wears off
   over ``lr_rewarm_steps`` past the skipped batches); an onset within ``escalation_window``
   batches of a previous rollback's skip range is the same region again: the skip range grows
   by ``escalation_skip_factor`` per repeat and the cut stays (``lr_rewarm`` None). SDC rollbacks
   are the exception: they skip nothing and keep the LR (the data is fine, the hardware is
   not), and leave no skip range behind;
5. budget: a disruptive remedy (rollback, relaunch) that would exceed ``max_interventions`` in
   ``window_s`` becomes STOP.

Pure: the clock is the ``now`` argument (seconds, any epoch, non-decreasing), there is no I/O,
and ``state_dict()`` / ``load_state_dict()`` carry everything through a supervisor restart.
"""

from __future__ import annotations

from typing import Any

from babysit.policies.schema import Policy, Response
from babysit.policies.types import Action, Finding, Incident, Remedy, Severity

_DISRUPTIVE = (Action.ROLLBACK, Action.RELAUNCH)
_SPIKES = (Incident.LOSS_SPIKE, Incident.GRAD_SPIKE)
"""Anomalies a run survives unaided: never worth a restart from scratch."""
_SEVERITY = {"warning": Severity.WARNING, "critical": Severity.CRITICAL}


class Rules:
    """Turns findings into remedies per the policy; see the module docstring."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        # Per incident: next rung, step and time of the last intervention.
        self._ladders: dict[str, dict[str, Any]] = {}
        # Every rollback's skipped cursor range [lo, hi) and its escalation generation.
        self._rollbacks: list[dict[str, Any]] = []
        # Times of disruptive interventions (budget) and of crash relaunches per class.
        self._interventions: list[float] = []
        self._crashes: dict[str, list[float]] = {}

    def on_finding(self, finding: Finding, now: float, checkpoint: bool = True) -> Remedy:
        """``checkpoint``: a good checkpoint from before the onset exists (the caller knows the
        catalog). Without one a spike's rollback would restart the run from scratch, which
        loses more than the spike: it becomes an alert that says why, and uses up no rung, no
        budget and no escalation (a NaN or a crash still relaunches)."""
        if finding.incident is Incident.CRASH:
            remedy = self._crash(finding, now)
        else:
            remedy = self._incident(finding, now, checkpoint)
        return self._charge(remedy, now)

    # -- ladders ----------------------------------------------------------------------------

    def _incident(self, finding: Finding, now: float, checkpoint: bool = True) -> Remedy:
        resp: Response = getattr(self.policy.incidents, finding.incident.value)
        name = finding.incident.value
        if finding.severity < _SEVERITY[resp.act_on]:
            return Remedy(resp.below, finding, f"{finding.severity.name.lower()} {name}: below "
                          f"act_on={resp.act_on}, so {resp.below.value} only")
        st = self._ladders.setdefault(name, {"rung": 0, "step": None, "time": None})
        if st["step"] is not None:
            since_s = now - st["time"]
            since_steps = finding.step - st["step"]
            if since_s < resp.cooldown_s or 0 <= since_steps < resp.cooldown_steps:
                return Remedy(Action.IGNORE, finding, f"inside the {name} cooldown: last "
                              f"intervention at step {st['step']}, {since_s:.0f}s ago")
            stale_steps = resp.reset_after_steps is not None and \
                since_steps >= resp.reset_after_steps
            stale_time = resp.reset_after_s is not None and since_s >= resp.reset_after_s
            if stale_steps or stale_time:
                st["rung"] = 0
        rung = min(st["rung"], len(resp.ladder) - 1)
        action = resp.ladder[rung]
        if action is Action.ROLLBACK and not checkpoint and finding.incident in _SPIKES:
            return Remedy(Action.ALERT, finding, f"{name}: not rolled back: no good checkpoint "
                          f"from before step {finding.onset_step} to go back to, and restarting "
                          "from scratch would lose more than the spike. Save checkpoints ("
                          "babysit run --checkpoint-every N, or checkpoints.every_steps in the "
                          "config, with attach(model=...)) to make spikes recoverable")
        st.update(rung=st["rung"] + 1, step=finding.step, time=now)
        why = f"{name} intervention {rung + 1} -> ladder rung {rung + 1}/{len(resp.ladder)}: " \
              f"{action.value}"
        if action is Action.ROLLBACK and finding.incident is Incident.SDC:
            # Not a bad region of data: skipping batches or lowering the LR would change the run
            # for nothing. Roll back to before the corruption and replay the same steps.
            return Remedy(Action.ROLLBACK, finding, why + "; silent data corruption is the "
                          "hardware's fault, not the data's or the LR's: no batches skipped, "
                          "LR kept", skip_before=0, skip_after=0, lr_scale=1.0)
        if action is Action.ROLLBACK:
            return self._rollback(finding, why)
        return Remedy(action, finding, why)

    # -- rollbacks and their escalation -----------------------------------------------------

    def _rollback(self, finding: Finding, why: str) -> Remedy:
        rb = self.policy.rollback
        onset = finding.onset_cursor if finding.onset_cursor is not None else finding.onset_step
        same = [r for r in self._rollbacks
                if r["lo"] - rb.escalation_window <= onset < r["hi"] + rb.escalation_window]
        gen = 1 + max((r["gen"] for r in same), default=-1)
        widen = rb.escalation_skip_factor ** gen
        before = round(rb.skip_before * widen)
        after = round(rb.skip_after * widen)
        self._rollbacks.append({"lo": onset - before, "hi": onset + after, "gen": gen})
        if gen:
            why += (f"; onset {onset} is inside the region of {len(same)} earlier rollback(s), "
                    f"so skip x{widen:g} and LR x{rb.lr_factor:g} for the rest of the run")
        return Remedy(Action.ROLLBACK, finding, why, skip_before=before, skip_after=after,
                      lr_scale=rb.lr_factor, lr_rewarm=None if gen else rb.lr_rewarm_steps)

    # -- crashes ----------------------------------------------------------------------------

    def _crash(self, finding: Finding, now: float) -> Remedy:
        cp = self.policy.crash
        ev = finding.evidence
        cls = str(ev.get("class", "unknown"))
        if cp.stop_on_deterministic and ev.get("deterministic"):
            return Remedy(Action.STOP, finding, f"{cls} crash repeated with the same signature "
                          f"at the same step ({ev.get('signature')}): deterministic, a relaunch "
                          "would reproduce it")
        times = self._crashes.setdefault(cls, [])
        if cp.forget_after_s is not None:
            times[:] = [t for t in times if now - t < cp.forget_after_s]
        limit = getattr(cp.max_relaunches, cls, cp.max_relaunches.unknown)
        if len(times) >= limit:
            return Remedy(Action.STOP, finding, f"{cls} crash: {len(times)} relaunch(es) for "
                          f"this class already, limit crash.max_relaunches.{cls}={limit}")
        waits = len(times) - 1 if cp.first_relaunch_at_once else len(times)
        backoff = min(cp.backoff_base_s * 2 ** waits, cp.backoff_max_s) if waits >= 0 else 0.0
        times.append(now)
        why = f"{cls} crash {len(times)}/{limit}"
        if cls == "numerical" and cp.rollback_numerical:
            r = self._rollback(finding, why + ": numerical, so roll back past it")
            return Remedy(r.action, finding, r.reason, r.skip_before, r.skip_after, r.lr_scale,
                          backoff, r.lr_rewarm)
        when = f"after {backoff:g}s" if backoff else "at once"
        return Remedy(Action.RELAUNCH, finding, f"{why}: relaunch {when}", backoff_s=backoff)

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
            "rollbacks": [dict(r) for r in self._rollbacks],
            "interventions": list(self._interventions),
            "crashes": {k: list(v) for k, v in self._crashes.items()},
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self._ladders = {k: dict(v) for k, v in d["ladders"].items()}
        self._rollbacks = [dict(r) for r in d["rollbacks"]]
        self._interventions = [float(t) for t in d["interventions"]]
        self._crashes = {k: [float(t) for t in v] for k, v in d["crashes"].items()}
