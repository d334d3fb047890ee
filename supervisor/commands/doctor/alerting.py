"""Checks of the alert sinks: their URL variables are set (fast), and they answer.

"Answer" sends no alert unless ``--send-alert`` asks for one. A Slack incoming webhook is sent
an empty POST, which a live webhook refuses with HTTP 400 (``invalid_payload`` or ``no_text``)
without posting anything, while a revoked one answers 403, 404 or 410. A generic webhook is
sent a HEAD request, and any HTTP response counts. URLs are secrets: results name the sink,
never the URL."""

from __future__ import annotations

import requests

from babysit.supervisor.commands.doctor.core import CheckResult, Context, Status
from babysit.supervisor.config.plan import RunPlan
from babysit.supervisor.services.alerts import (
    AlertConfigError,
    AlertDispatcher,
    AlertsConfig,
    resolve_sinks,
    transport,
)
from babysit.supervisor.services.alerts.config import ResolvedSink

_SLACK_GONE = {403, 404, 410}  # invalid_token, no_service, channel_not_found, channel_is_archived


def _resolve(plan: RunPlan, ctx: Context) -> tuple[list[ResolvedSink], list[str]]:
    """The sinks whose URL variable is usable, and one line per sink whose variable is not."""
    ok, bad = [], []
    for sink in plan.config.alerts.sinks:
        try:
            ok += resolve_sinks(AlertsConfig(sinks=[sink]), ctx.environ)
        except AlertConfigError:
            value = ctx.environ.get(sink.url_env, "").strip()
            state = "is not set or empty" if not value else "is not an http(s) URL"
            bad.append(f"sink '{sink.name}' ({sink.kind}): ${sink.url_env} {state}")
    return ok, bad


def alert_config(plan: RunPlan, ctx: Context) -> CheckResult:
    name = "alert config"
    sinks = plan.config.alerts.sinks
    if not sinks:
        return CheckResult(name, Status.SKIP, "no sinks configured: alerts are only journaled")
    _, bad = _resolve(plan, ctx)
    if bad:
        names = [s.url_env for s in sinks if any(f"${s.url_env} " in line for line in bad)]
        return CheckResult(name, Status.FAIL, "; ".join(bad),
                           f"`export {'=https://... '.join(names)}=https://...` (the webhook "
                           "URL) where babysit runs, or remove the sink from alerts.sinks.")
    return CheckResult(name, Status.PASS, f"{len(sinks)} sink(s), every URL variable set")


def alert_sinks(plan: RunPlan, ctx: Context) -> CheckResult:
    name = "alert sinks"
    sinks, _ = _resolve(plan, ctx)
    if not sinks:
        why = "no sinks configured" if not plan.config.alerts.sinks else "no usable URL (above)"
        return CheckResult(name, Status.SKIP, why)
    transport.protect(s.url for s in sinks)
    if ctx.send_alert:
        results = AlertDispatcher(sinks).test_all(run=plan.name)
        outcomes = [(sink, Status.PASS if ok else Status.FAIL, f"sent a test alert: {detail}"
                     if ok else f"test alert not delivered: {detail}")
                    for sink, ok, detail in results]
    else:
        with requests.Session() as session:
            outcomes = [(s.name, *_knock(session, s)) for s in sinks]
    worst = max((o[1] for o in outcomes), key=[Status.PASS, Status.WARN, Status.FAIL].index)
    summary = "; ".join(f"'{sink}' {text}" for sink, _, text in outcomes)
    fix = None
    if worst is not Status.PASS:
        fix = ("Check each named sink's URL variable holds the current webhook URL (a revoked "
               "Slack webhook answers 403/404), and that this node can reach it.")
    return CheckResult(name, worst, summary, fix)


def _knock(session: requests.Session, sink: ResolvedSink) -> tuple[Status, str]:
    """Ask a sink whether it is there, without sending an alert."""
    timeout = sink.config.timeout_s
    slack = sink.config.kind == "slack"
    secrets = transport.secrets_of(sink.url)
    try:
        if slack:
            response = session.post(sink.url, data=b"", timeout=timeout, allow_redirects=False,
                                    headers={"User-Agent": "babysit-doctor/1"})
        else:
            response = session.head(sink.url, timeout=timeout, allow_redirects=False,
                                    headers={"User-Agent": "babysit-doctor/1"})
    except Exception as exc:  # any failure to get an answer: reported by kind, never by URL
        return Status.FAIL, transport.redact(transport.describe(exc, timeout), secrets)
    code = response.status_code
    body = transport.redact(response.text[:100].strip(), secrets)
    said = f"HTTP {code}" + (f" {body}" if body and slack else "")
    if 300 <= code < 400:
        return Status.WARN, (f"answered a redirect ({said}); alerts do not follow redirects, "
                             "so they would not arrive: use the URL it redirects to")
    if slack:
        if code == 400 or 200 <= code < 300:
            return Status.PASS, f"answers ({said} to an empty request; nothing posted)"
        if code in _SLACK_GONE:
            return Status.FAIL, f"refused ({said}): the webhook was revoked or its channel is gone"
    elif code < 500:
        return Status.PASS, f"answers ({said} to HEAD; nothing sent)"
    return Status.WARN, f"answered {said}; it may be down for now"
