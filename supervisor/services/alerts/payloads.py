"""What an alert says, and how it is written for Slack and for generic webhooks. Pure functions.

The generic webhook payload, version 1. Stable: fields are only ever added within a version, so
consumers must ignore keys they do not know; a removal or change of meaning bumps ``version``::

    {
      "version": 1,
      "title": "Loss spike: 9.12 vs baseline 2.31",   # one line for a human
      "severity": "critical",                         # "info" | "warning" | "critical"
      "run": "gpt2-small",                            # run name
      "attempt": 2,                                   # int or null
      "step": 5120,                                   # int or null
      "ranks": [3],                                   # ranks concerned, maybe empty
      "incident": "loss_spike",                       # an Incident value, "test", or null
      "action": "rollback to step 5000, lr x0.5",     # what babysit did, or null
      "evidence": {"loss": 9.12, "baseline": 2.31},   # numbers behind it; NaN/inf as strings
      "incident_dir": "runs/gpt2/incidents/0003",     # folder with stacks, log tails; or null
      "time": "2025-01-31T12:00:00.000Z",             # when the alert was raised, UTC, ISO 8601
      "dedup_key": "loss_spike:loss:",                # alerts with the same key are de-duplicated
      "suppressed": {"duplicates": 0, "rate_limited": 0},
      "kind": "remedy",                               # see below; "alert" for anything else
      "incident_id": "0003-loss_spike-step5120",      # same for every message of one incident
      "host": "gpu-node-7",                           # machine concerned, or null
      "node": "2",                                    # node of a multi-node run, or null
      "needs": null,                                  # what a person must do, or null: nothing
      "remedy": {                                     # what babysit did about it, or null
        "action": "rollback", "reason": "ladder rung 2/5: rollback",
        "attempt": 3, "resume_step": 5000,            # kind "remedy" only: the applied values
        "skipped_batches": [[5090, 5130]],            # inclusive batch ranges newly skipped
        "lr_scale": 0.5,                              # LR multiplier now in force
        "lr_factor": 0.5,                             # this remedy's multiplier
        "lr_rewarm_steps": 50,                        # batches over which the cut wears off;
                                                      # null: the cut stays (a repeat spike)
        "lr_ramp": {"cut": 5090, "start": 5131,       # kind "remedy" only: the directive's ramp
                    "end": 5181, "to": 1.0},          # (data-cursor space), or null
        "just_in_time": {"step": 5120,                # kind "remedy", when the relaunch resumed
                         "writers": [0],              # from the state the live ranks wrote after
                         "fault": "hang",             # the fault (absent otherwise): its step,
                         "lost_steps": 1, ...}        # who wrote it, the steps lost
      }
    }

``kind`` says which message of the story this is (``story.IncidentStory``): ``incident`` (a
remedy was decided: the finding, its numbers, what babysit is doing), ``remedy`` (the relaunch
that applies it started: ``remedy.resume_step``, ``skipped_batches``, ``lr_scale``),
``recovered`` (the first step past the trouble; ``evidence.time_lost_s``), ``warning`` (a
finding whose remedy is only to tell you), ``finished`` / ``stopped`` / ``failed`` (the run
ended: succeeded, stopped by a signal, or failed;
``evidence`` has ``exit_code``, ``incidents``, ``elapsed_s``, ``time_lost_s`` and ``goodput``,
the productive share of the supervisor's goodput ledger, 0..1), and ``alert`` for everything
else (health, digests, tests). Every message of one incident has the same ``incident_id`` and
its title starts with ``[<run> #<incident_id>]``: Slack incoming webhooks cannot thread replies,
so that prefix is what groups an incident in a channel.

Changes within version 1: ``kind``, ``incident_id``, ``host``, ``node``, ``needs`` and
``remedy`` were added (babysit 0.1, issue 18); older consumers that ignore unknown keys keep
working. ``incident_id`` is also in the de-duplication key of incident messages, so two incidents
of the same kind are never merged.

``suppressed`` counts alerts this sink held back since its previous send: ``duplicates`` of this
same key, and ``rate_limited`` of any key.
"""

from __future__ import annotations

import enum
import json
import math
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from babysit.policies.types import Finding, Incident, Severity

PAYLOAD_VERSION = 1

_EMOJI = {
    Severity.INFO: ":information_source:",
    Severity.WARNING: ":warning:",
    Severity.CRITICAL: ":rotating_light:",
}

# Block Kit limits (api.slack.com/reference/block-kit/blocks); longer text makes Slack refuse the
# whole message with a 400, so everything is cut to fit.
_HEADER_MAX = 150
_FIELD_MAX = 2000
_SECTION_MAX = 3000
_RANKS_SHOWN = 16
_FIELDS_PER_SECTION = 10


@dataclass(frozen=True, slots=True)
class Alert:
    """One thing a human should hear about. Plain data; build it and hand it to ``submit``.

    ``evidence`` should be JSON-serialisable (anything else is sent as its ``str``). ``dedup_key``
    defaults to ``"<incident>:<title>"``; set it when the title carries changing numbers but the
    alerts are the same trouble (``from_finding`` does). ``time`` is wall-clock seconds.
    """

    title: str
    severity: Severity
    run: str
    attempt: int | None = None
    step: int | None = None
    ranks: tuple[int, ...] = ()
    incident: Incident | str | None = None
    action: str | None = None
    evidence: dict[str, Any] = field(default_factory=dict)
    incident_dir: str | None = None
    dedup_key: str | None = None
    time: float = field(default_factory=time.time)
    kind: str = "alert"
    """Which message of the story: see the module docstring."""
    incident_id: str | None = None
    host: str | None = None
    node: str | None = None
    needs: str | None = None
    """What a person must do, in words; None when nothing."""
    remedy: dict[str, Any] | None = None

    @property
    def key(self) -> str:
        """The key de-duplication compares."""
        if self.dedup_key is not None:
            return self.dedup_key
        if self.incident_id is not None:  # each message of an incident is news once
            return f"{self.incident_id}:{self.kind}"
        return f"{_text(self.incident) or ''}:{self.title}"

    @classmethod
    def from_finding(
        cls,
        finding: Finding,
        *,
        run: str,
        attempt: int | None = None,
        action: str | None = None,
        incident_dir: str | None = None,
    ) -> Alert:
        """An alert for a detector's finding; repeats by the same detector on the same ranks
        de-duplicate even though their numbers differ."""
        ranks = ",".join(map(str, finding.ranks))
        return cls(
            title=finding.message,
            severity=finding.severity,
            run=run,
            attempt=attempt,
            step=finding.step,
            ranks=finding.ranks,
            incident=finding.incident,
            action=action,
            evidence=dict(finding.evidence),
            incident_dir=incident_dir,
            dedup_key=f"{finding.incident.value}:{finding.detector}:{ranks}",
        )


def webhook_payload(alert: Alert, *, duplicates: int = 0, rate_limited: int = 0) -> dict[str, Any]:
    """The generic webhook body (version 1, documented in this module's docstring)."""
    return {
        "version": PAYLOAD_VERSION,
        "title": alert.title,
        "severity": alert.severity.name.lower(),
        "run": alert.run,
        "attempt": alert.attempt,
        "step": alert.step,
        "ranks": list(alert.ranks),
        "incident": _text(alert.incident),
        "action": alert.action,
        "evidence": jsonable(alert.evidence),
        "incident_dir": alert.incident_dir,
        "time": _iso(alert.time),
        "dedup_key": alert.key,
        "suppressed": {"duplicates": duplicates, "rate_limited": rate_limited},
        "kind": alert.kind,
        "incident_id": alert.incident_id,
        "host": alert.host,
        "node": alert.node,
        "needs": alert.needs,
        "remedy": jsonable(alert.remedy) if alert.remedy is not None else None,
    }


def slack_payload(alert: Alert, *, duplicates: int = 0, rate_limited: int = 0) -> dict[str, Any]:
    """A Slack incoming-webhook body: Block Kit ``blocks`` plus the plain ``text`` fallback that
    notifications and old clients show."""
    label = alert.severity.name
    emoji = _EMOJI.get(alert.severity, ":grey_question:")
    where = f"run {alert.run}" + (f", attempt {alert.attempt}" if alert.attempt is not None else "")
    where += f", step {alert.step}" if alert.step is not None else ""
    fields = [
        ("Severity", f"{emoji} {label}"),
        ("Run", alert.run),
        ("Attempt", _or_dash(alert.attempt)),
        ("Step", _or_dash(alert.step)),
        ("Rank(s)", format_ranks(alert.ranks) or ("all" if alert.incident else "-")),
        ("Incident", _text(alert.incident) or "-"),
    ]
    if alert.host:
        fields.append(("Host", alert.host + (f" (node {alert.node})" if alert.node else "")))
    fields.append(("What babysit did", alert.action or "-"))
    applied = alert.remedy if alert.kind == "remedy" else None
    if applied:
        skipped = applied.get("skipped_batches") or []
        kept = " (just-in-time state)" if applied.get("just_in_time") else ""
        fields += [
            ("Resumed from step", f"{_or_dash(applied.get('resume_step'))}{kept}"),
            ("Skipped batches", ", ".join(f"{a}-{b}" for a, b in skipped) or "none"),
            ("LR scale", f"x{applied.get('lr_scale', 1.0):g}"),
        ]
    if alert.needs:
        fields.append(("Needs from you", alert.needs))
    blocks: list[dict[str, Any]] = [
        {
            "type": "header",
            "text": {
                "type": "plain_text",
                "text": _cut(f"{emoji} {label}: {alert.title}", _HEADER_MAX),
                "emoji": True,
            },
        },
    ]
    for start in range(0, len(fields), _FIELDS_PER_SECTION):
        blocks.append({
            "type": "section",
            "fields": [
                {"type": "mrkdwn", "text": _cut(f"*{name}*\n{_esc(value)}", _FIELD_MAX)}
                for name, value in fields[start:start + _FIELDS_PER_SECTION]
            ],
        })
    if alert.evidence:
        evidence = _cut(_esc(format_evidence(alert.evidence)), _SECTION_MAX - 20)
        blocks.append(
            {
                "type": "section",
                "text": {"type": "mrkdwn", "text": f"*Evidence*\n```{evidence}```"},
            }
        )
    context = []
    if alert.incident_dir:
        context.append(f"Incident folder: `{_esc(alert.incident_dir)}`")
    context.append(f"Raised {_iso(alert.time)}")
    if duplicates:
        context.append(f"{duplicates} repeat(s) of this alert suppressed since it was last sent")
    if rate_limited:
        context.append(f"{rate_limited} alert(s) suppressed by the rate limit since the last one")
    blocks.append(
        {
            "type": "context",
            "elements": [{"type": "mrkdwn", "text": _cut(t, _FIELD_MAX)} for t in context],
        }
    )
    text = f"[{label}] {alert.title} ({where})"
    if alert.action:
        text += f". Action: {alert.action}"
    return {"text": _cut(_esc(text), _SECTION_MAX), "blocks": blocks}


def format_evidence(evidence: dict[str, Any]) -> str:
    """``key: value`` lines, numbers to 4 significant digits, nested values as compact JSON."""
    lines = []
    for key, value in evidence.items():
        if isinstance(value, float):
            shown = f"{value:.4g}"
        elif isinstance(value, (dict, list, tuple)):
            shown = json.dumps(jsonable(value), separators=(",", ":"))
        else:
            shown = str(value)
        lines.append(f"{key}: {shown}")
    return "\n".join(lines)


def format_ranks(ranks: tuple[int, ...]) -> str:
    """``"0, 3, 5"``; past a handful, the first few and a count, so 8,000 ranks stay one line."""
    if len(ranks) <= _RANKS_SHOWN:
        return ", ".join(map(str, ranks))
    shown = ", ".join(map(str, ranks[:_RANKS_SHOWN]))
    return f"{shown}, ... (+{len(ranks) - _RANKS_SHOWN} more)"


def jsonable(value: Any) -> Any:
    """``value`` with non-finite floats as strings (``"nan"``, ``"inf"``) and unknown objects as
    their ``str``, so it serialises as strict JSON (Slack and most parsers refuse a bare NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, (str, int, bool)) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, enum.Enum):
        return jsonable(value.value)
    return str(value)


def _text(value: enum.Enum | str | None) -> str | None:
    # Incident is a str enum, and str() of one is "Incident.HANG" on 3.11: use its value.
    if isinstance(value, enum.Enum):
        return str(value.value)
    return value


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=timezone.utc).isoformat(timespec="milliseconds")[:-6] + "Z"


def _or_dash(value: int | None) -> str:
    return "-" if value is None else str(value)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _esc(text: str) -> str:
    # Slack mrkdwn treats &, < and > as control characters (links, mentions); escape them so a
    # title or path can never turn into an @channel or a link.
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
