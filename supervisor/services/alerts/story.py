"""The story of a run, told to a person: one alert per thing they would want to hear. Pure.

The control loop hands facts to an ``IncidentStory`` as they happen; each method returns the
alerts to send (or none). The facts, in the order a rollback produces them::

    incident(...)   a remedy was decided: what was seen (with its numbers), on which rank, node
                    and host, what babysit is doing about it, what it needs from a person, and
                    where the incident folder is. Opens an incident.
    launched(...)   the relaunch that applies it started: resumed from step N, skipped batches
                    a-b, LR xS (from the attempt's directive, what the ranks actually run with).
    step(...)       every merged step; the first one past the step where the trouble was
                    detected closes the incident with a "recovered" message and the time lost.
    finished(...)   the run ended: "finished", "stopped" (by a signal) or "failed", with a
                    summary.

Every message of one incident carries the same ``incident_id`` (the incident folder's name, or a
number when there is none) and starts its title with ``[<run> #<id>]``: Slack incoming webhooks
cannot thread replies, so the common prefix is what groups them in a channel.

Calling rules: one thread (the loop's). Times are wall-clock seconds (``time.time()``). The
constructor does no I/O; ``host`` is passed in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any

from babysit.policies.types import Action, Remedy, Severity
from babysit.supervisor.contract.directive import Directive, LrRamp, SkipRange
from babysit.supervisor.services.alerts.payloads import Alert

_DOING = {
    Action.ROLLBACK: "rolling back to the newest good checkpoint before the trouble",
    Action.RELAUNCH: "relaunching the workers from the newest good checkpoint",
    Action.STOP: "stopping the run",
    Action.ALERT: "only telling you (the policy's action for this is alert)",
}


@dataclass(slots=True)
class _Open:
    """The incident whose remedy is under way."""

    id: str
    prefix: str
    remedy: Remedy
    at: float
    """When it was decided (wall clock)."""
    last_good_at: float | None
    """When the last step before it was merged: the time lost counts from there."""
    resume_step: int | None = None
    launched: bool = False


class IncidentStory:
    """Turns the loop's facts into alerts a person can act on (see the module docstring)."""

    def __init__(self, run: str, host: str) -> None:
        self.run = run
        self.host = host
        self.incidents = 0
        """Incidents opened so far (remedies that stop, relaunch or roll back)."""
        self._open: _Open | None = None
        self._skips: tuple[SkipRange, ...] = ()
        self._lr_scale = 1.0
        self._lr_ramp: LrRamp | None = None
        self._kept: dict[str, Any] | None = None
        """The just-in-time state the next launch resumes from (the journal's ``resume``)."""
        self._last_step_at: float | None = None
        self._started_at: float | None = None
        self._lost_s = 0.0

    # -- facts ----------------------------------------------------------------------------------

    def incident(self, remedy: Remedy, *, attempt: int, incident_dir: str | None,
                 now: float, ends_run: bool = False) -> Alert:
        """A remedy was decided for ``remedy.finding``. Rollback, relaunch and stop open an
        incident (its follow-ups come from ``launched`` and ``step``); alert-only remedies are
        a single warning. ``ends_run``: the run fails because of it (a crash no rung of the
        ladder relaunches), whatever the remedy says; it is told as a stop."""
        if ends_run and remedy.action is not Action.STOP:
            remedy = dataclasses.replace(remedy, action=Action.STOP)
        finding = remedy.finding
        ev = finding.evidence
        host = str(ev.get("host") or self.host)
        node = ev.get("node")
        ranks = finding.ranks
        who = (f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}" if ranks
               else "the whole job")
        where = f"{who} on host {host}" + (f" (node {node})" if node is not None else "")
        opens = remedy.action in (Action.ROLLBACK, Action.RELAUNCH, Action.STOP)
        if opens:
            self.incidents += 1
            ident = PurePath(incident_dir).name if incident_dir else f"{self.incidents:04d}"
            prefix = f"[{self.run} #{ident}]"
        else:
            ident, prefix = None, f"[{self.run}]"
        doing = _DOING.get(remedy.action, remedy.action.value)
        plan = _plan(remedy)
        action = f"Seen on {where}; babysit is {doing}" + (f" ({plan})" if plan else "") + \
            f". Why this remedy: {remedy.reason}."
        needs = None
        if remedy.action is Action.STOP:
            needs = ("A person: babysit will not retry this. Read the incident folder, fix the "
                     "cause, then run `babysit run` again with the same config to resume.")
        elif remedy.action is Action.ALERT:
            needs = "Nothing right now; look if it keeps happening."
        alert = Alert(
            title=f"{prefix} {finding.message}",
            severity=finding.severity if remedy.action is not Action.STOP else Severity.CRITICAL,
            run=self.run, attempt=attempt, step=finding.step, ranks=ranks,
            incident=finding.incident, action=action, evidence=dict(ev),
            incident_dir=incident_dir, kind="incident" if opens else "warning",
            incident_id=ident, host=host, node=None if node is None else str(node), needs=needs,
            remedy={"action": remedy.action.value, "reason": remedy.reason,
                    "lr_factor": remedy.lr_scale, "skip_before": remedy.skip_before,
                    "skip_after": remedy.skip_after, "backoff_s": remedy.backoff_s},
            dedup_key=None if opens else
            f"{finding.incident.value}:{finding.detector}:{','.join(map(str, ranks))}",
            time=now,
        )
        if opens and remedy.action is not Action.STOP:
            self._open = _Open(ident or "", prefix, remedy, now, self._last_step_at)
        elif remedy.action is Action.STOP:
            self._open = None
        return alert

    def resuming(self, entry: Mapping[str, Any]) -> None:
        """The journal's ``resume`` entry of the launch about to start: from just-in-time state
        (``checkpoints/just_in_time.py``) or not."""
        kept = entry.get("just_in_time")
        self._kept = {**kept, "step": entry.get("checkpoint_step")} \
            if isinstance(kept, dict) else None

    def launched(self, directive: Directive, now: float) -> Alert | None:
        """An attempt started with ``directive``. Says what the open incident's remedy did;
        None for the first attempt, or when no incident is open."""
        new_skips = tuple(r for r in directive.skip if r not in self._skips)
        old = (self._lr_scale, self._lr_ramp)
        old_scale = self._lr_scale
        self._skips, self._lr_scale = directive.skip, directive.lr_scale
        self._lr_ramp = directive.lr_ramp
        if self._started_at is None:
            self._started_at = now
        o = self._open
        if o is None or o.launched:
            return None
        o.launched = True
        resume = directive.resume
        o.resume_step = resume.step if resume is not None else None
        kept, self._kept = self._kept, None
        if kept is not None and (resume is None or kept.get("step") != resume.step):
            kept = None
        parts = [f"attempt {directive.attempt} started",
                 f"resumed from the just-in-time state of step {kept['step']} (written by the "
                 f"ranks still alive)" if kept is not None else
                 f"resumed from step {resume.step}" if resume is not None
                 else "no good checkpoint before the trouble: restarted from step 0"]
        if new_skips:
            parts.append("skipped batches " + ", ".join(_range(r) for r in new_skips))
        if (directive.lr_scale, directive.lr_ramp) != old:
            parts.append(f"{_lr(directive)} (was x{old_scale:g})")
        lost = o.remedy.finding.step - (resume.step if resume is not None else 0)
        if kept is not None:
            lost = int(kept.get("lost_steps") or 0)
        if lost > 0:
            parts.append(f"{lost} step(s) to redo")
        finding = o.remedy.finding
        return Alert(
            title=f"{o.prefix} {o.remedy.action.value} applied: " + "; ".join(parts[1:3]),
            severity=Severity.INFO, run=self.run, attempt=directive.attempt,
            step=resume.step if resume is not None else 0, ranks=finding.ranks,
            incident=finding.incident, action="; ".join(parts), kind="remedy",
            incident_id=o.id, host=self.host,
            remedy={**remedy_fields(o.remedy, directive, new_skips),
                    **({"just_in_time": kept} if kept is not None else {})},
            evidence={"detected_at_step": finding.step, "steps_to_redo": max(lost, 0)},
            time=now,
        )

    def step(self, step: int, now: float) -> Alert | None:
        """A step was merged. Returns the "recovered" message when it is the first step past
        the one where the open incident was detected."""
        self._last_step_at = now
        o = self._open
        if o is None or not o.launched or step <= o.remedy.finding.step:
            return None
        self._open = None
        since = o.last_good_at if o.last_good_at is not None else o.at
        lost_s = max(0.0, now - since)
        self._lost_s += lost_s
        finding = o.remedy.finding
        return Alert(
            title=f"{o.prefix} recovered: training passed step {finding.step} again "
                  f"(about {_duration(lost_s)} lost)",
            severity=Severity.INFO, run=self.run, step=step, ranks=finding.ranks,
            incident=finding.incident, kind="recovered", incident_id=o.id, host=self.host,
            action=f"healthy steps since the {o.remedy.action.value}; nothing more to do",
            evidence={"time_lost_s": round(lost_s, 1), "resumed_from_step": o.resume_step,
                      "detected_at_step": finding.step, "first_healthy_step": step},
            time=now,
        )

    def finished(self, *, state: str, exit_code: int, reason: str, attempt: int,
                 step: int | None, now: float, goodput: float | None = None) -> Alert:
        """The run ended (``state`` is the machine's final state). ``goodput`` (0..1, the share
        of the wall time that became kept training) is reported when a ledger supplies it."""
        ok = exit_code == 0
        elapsed = now - self._started_at if self._started_at is not None else None
        summary = [f"{state} at step {step if step is not None else '-'}",
                   f"{attempt + 1} attempt(s)", f"{self.incidents} incident(s)"]
        if elapsed is not None:
            summary.append(f"{_duration(elapsed)} in all")
        if self._lost_s:
            summary.append(f"about {_duration(self._lost_s)} lost to incidents")
        if goodput is not None:
            summary.append(f"goodput {goodput:.1%}")
        evidence: dict[str, Any] = {"exit_code": exit_code, "incidents": self.incidents,
                                    "time_lost_s": round(self._lost_s, 1)}
        if elapsed is not None:
            evidence["elapsed_s"] = round(elapsed, 1)
        if goodput is not None:
            evidence["goodput"] = goodput
        if self._skips:
            evidence["skipped_batches"] = [[r.start, r.end - 1] for r in self._skips]
        if self._lr_scale != 1.0:
            evidence["lr_scale"] = self._lr_scale
        kind = "finished" if ok else "stopped" if state == "stopped" else "failed"
        needs = {"finished": None,
                 "stopped": "Nothing, if you stopped it: `babysit run` with the same run_dir "
                            "resumes it from its newest checkpoint.",
                 "failed": "A person: the run stopped and babysit will not retry it. "
                           "`babysit status` and the incident folders say why."}[kind]
        severity = {"finished": Severity.INFO, "stopped": Severity.WARNING,
                    "failed": Severity.CRITICAL}[kind]
        return Alert(
            title=f"[{self.run}] run {kind}: " + ", ".join(summary), severity=severity,
            run=self.run, attempt=attempt, step=step, kind=kind, host=self.host,
            action=f"exit code {exit_code} ({reason})", needs=needs, evidence=evidence, time=now,
        )


def remedy_fields(remedy: Remedy, directive: Directive,
                  new_skips: Sequence[SkipRange]) -> dict[str, Any]:
    """The webhook payload's ``remedy`` object for an applied remedy (documented in
    ``payloads``). Skip ranges are inclusive ``[first, last]`` batch numbers."""
    ramp = directive.lr_ramp
    return {
        "action": remedy.action.value,
        "reason": remedy.reason,
        "attempt": directive.attempt,
        "resume_step": directive.resume.step if directive.resume is not None else None,
        "skipped_batches": [[r.start, r.end - 1] for r in new_skips],
        "lr_scale": directive.lr_scale,
        "lr_factor": remedy.lr_scale,
        "lr_rewarm_steps": None if ramp is None else ramp.end - ramp.start,
        "lr_ramp": None if ramp is None else {"cut": ramp.cut, "start": ramp.start,
                                              "end": ramp.end, "to": ramp.to},
    }


def _plan(remedy: Remedy) -> str:
    bits = []
    if remedy.action is Action.ROLLBACK and (remedy.skip_before or remedy.skip_after):
        bits.append(f"skipping {remedy.skip_before} batch(es) before the onset and "
                    f"{remedy.skip_after} after")
    if remedy.lr_scale != 1.0:
        bits.append(f"LR x{remedy.lr_scale:g}" + (
            f", re-warming over {remedy.lr_rewarm} batches past the skipped ones"
            if remedy.lr_rewarm else ", kept" if remedy.action is Action.ROLLBACK else ""))
    if remedy.backoff_s:
        bits.append(f"after {remedy.backoff_s:g} s")
    return ", ".join(bits)


def _lr(d: Directive) -> str:
    """The attempt's LR orders in words (as ``run.rollback.describe_lr`` says them)."""
    ramp = d.lr_ramp
    if ramp is None:
        return f"LR x{d.lr_scale:g} of the schedule"
    return (f"LR x{d.lr_scale:g} from batch {ramp.cut}, back to x{ramp.to:g} over batches "
            f"{ramp.start}-{ramp.end - 1}")


def _range(r: SkipRange) -> str:
    batches = f"{r.start}-{r.end - 1}" if r.end - 1 > r.start else str(r.start)
    return batches if r.samples is None else \
        f"{batches} (samples {r.samples[0]}-{r.samples[1] - 1})"


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
