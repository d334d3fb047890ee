"""Alert payloads and the alerts config: pure, no network."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from babysit.policies.types import Finding, Incident, Severity
from babysit.supervisor.services.alerts import (
    Alert,
    AlertConfigError,
    AlertsConfig,
    RateLimitConfig,
    SinkConfig,
    resolve_sinks,
    slack_payload,
    webhook_payload,
)
from babysit.supervisor.services.alerts.transport import redact, retry_after_s, secrets_of


def make_alert(**kw: Any) -> Alert:
    fields: dict[str, Any] = {"title": "hang", "severity": Severity.WARNING, "run": "r"}
    fields.update(kw)
    return Alert(**fields)


def strict_json(payload: dict[str, Any]) -> Any:
    return json.loads(json.dumps(payload, allow_nan=False))


# --- payloads ----------------------------------------------------------------------------------


def test_non_finite_evidence_becomes_strict_json() -> None:
    evidence = {"loss": math.nan, "grad": [math.inf, 1.0], "nested": {"x": -math.inf}}
    a = make_alert(evidence=evidence)
    assert strict_json(webhook_payload(a))["evidence"] == {
        "loss": "nan",
        "grad": ["inf", 1.0],
        "nested": {"x": "-inf"},
    }
    strict_json(slack_payload(a))


def test_unserialisable_evidence_is_sent_as_text() -> None:
    payload = webhook_payload(make_alert(evidence={"where": object, "incident": Incident.HANG}))
    assert strict_json(payload)["evidence"] == {"where": str(object), "incident": "hang"}


def test_slack_text_cannot_mention_or_link() -> None:
    nasty = "<!channel> see <http://x|here> & more"
    payload = slack_payload(make_alert(title=nasty, action=nasty, evidence={"e": nasty}))
    # The header is plain_text, which Slack never parses; everything else is mrkdwn, which does.
    header, *rest = payload["blocks"]
    assert header["text"]["type"] == "plain_text"
    mrkdwn = json.dumps([payload["text"], rest])
    assert "<!channel>" not in mrkdwn and "<http" not in mrkdwn
    assert "&lt;!channel&gt;" in mrkdwn and "&amp; more" in mrkdwn


def test_slack_blocks_stay_within_block_kit_limits() -> None:
    huge = make_alert(
        title="x" * 5000,
        evidence={f"k{i}": "v" * 100 for i in range(100)},
        ranks=tuple(range(8000)),
        action="a" * 5000,
    )
    header, facts, evidence, context = slack_payload(huge)["blocks"]
    assert len(header["text"]["text"]) <= 150
    assert len(facts["fields"]) <= 10
    assert all(len(f["text"]) <= 2000 for f in facts["fields"])
    assert len(evidence["text"]["text"]) <= 3000
    ranks = next(f["text"] for f in facts["fields"] if f["text"].startswith("*Rank"))
    assert ranks.endswith("(+7984 more)")
    assert all(len(e["text"]) <= 2000 for e in context["elements"])


def test_missing_fields_show_as_dashes_and_nulls() -> None:
    a = make_alert()
    fields = [f["text"] for f in slack_payload(a)["blocks"][1]["fields"]]
    assert "*Step*\n-" in fields and "*Rank(s)*\n-" in fields
    payload = webhook_payload(a)
    assert payload["step"] is None and payload["ranks"] == [] and payload["incident"] is None
    assert len(slack_payload(a)["blocks"]) == 3  # no evidence section when there is none


def test_dedup_key_defaults_to_incident_and_title() -> None:
    assert make_alert(incident=Incident.HANG).key == "hang:hang"
    assert make_alert(dedup_key="mine").key == "mine"


def test_from_finding_dedups_repeats_of_the_same_detector_on_the_same_ranks() -> None:
    def finding(step: int, loss: float) -> Finding:
        return Finding(
            incident=Incident.STRAGGLER,
            detector="straggler",
            severity=Severity.WARNING,
            step=step,
            onset_step=step - 10,
            message=f"rank 3 is slow (loss {loss})",
            ranks=(3,),
            evidence={"ratio": 1.8},
        )

    a = Alert.from_finding(finding(100, 2.0), run="r", attempt=1, action="alert")
    b = Alert.from_finding(finding(200, 2.1), run="r", attempt=1, action="alert")
    assert a.key == b.key == "straggler:straggler:3"
    assert a.step == 100 and a.ranks == (3,) and a.evidence == {"ratio": 1.8}
    assert webhook_payload(a)["incident"] == "straggler"


def test_severity_labels() -> None:
    for severity, emoji in [
        (Severity.INFO, ":information_source:"),
        (Severity.WARNING, ":warning:"),
        (Severity.CRITICAL, ":rotating_light:"),
    ]:
        a = make_alert(severity=severity)
        assert webhook_payload(a)["severity"] == severity.name.lower()
        assert slack_payload(a)["blocks"][0]["text"]["text"].startswith(emoji)


# --- transport helpers -------------------------------------------------------------------------


def test_retry_after_accepts_seconds_and_http_dates() -> None:
    assert retry_after_s("7") == 7.0
    assert retry_after_s(None) is None and retry_after_s("soon") is None
    assert retry_after_s("Wed, 21 Oct 2015 07:28:30 GMT", now=1445412480.0) == 30.0
    assert retry_after_s("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412480.0 + 99) == 0.0


def test_redact_removes_the_url_its_path_and_its_token() -> None:
    url = "https://user:pa55word@hooks.example.com/services/T0/B0/abcdefgh12345?token=tok123"
    secrets = secrets_of(url)
    for leak in [url, "/services/T0/B0/abcdefgh12345", "abcdefgh12345", "tok123", "pa55word"]:
        assert "abcdefgh12345" not in redact(f"failed: {leak}", secrets)
        assert leak not in redact(f"failed: {leak}", secrets)
    assert redact("see http://other.example/x?y=1 now") == "see <url> now"


# --- config ------------------------------------------------------------------------------------


def test_defaults_are_sensible() -> None:
    sink = SinkConfig(name="s", kind="slack", url_env="S")
    assert sink.severity is Severity.WARNING
    assert sink.timeout_s == 5.0 and sink.max_retries == 3
    assert sink.rate_limit.max_alerts == 10 and sink.dedup_window_s == 600
    assert AlertsConfig().sinks == []


@pytest.mark.parametrize("model", [AlertsConfig, SinkConfig, RateLimitConfig])
def test_every_field_is_documented(model: type[BaseModel]) -> None:
    for name, info in model.model_fields.items():
        assert info.description, f"{model.__name__}.{name} has no docstring"


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        ({"sinks": [{"name": "s", "kind": "slack", "url_env": "S", "url": "x"}]}, "url"),
        ({"sinks": [{"name": "s", "kind": "email", "url_env": "S"}]}, "kind"),
        ({"sinks": [{"name": "s", "kind": "slack", "url_env": "https://x"}]}, "url_env"),
        ({"sinks": [{"name": "s", "kind": "slack", "url_env": "S", "min_severity": "x"}]}, "min"),
        ({"sinks": [{"name": "s", "kind": "slack", "url_env": "S", "max_retries": -1}]}, "max_"),
        ({"queue_size": 0}, "queue_size"),
        ({"sinks": [{"name": "s", "kind": "slack", "url_env": "A"}] * 2}, "unique"),
    ],
)
def test_bad_config_is_refused(data: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ValidationError, match=fragment):
        AlertsConfig.model_validate(data)


def test_resolve_reads_each_url_from_its_variable() -> None:
    config = AlertsConfig.model_validate(
        {
            "sinks": [
                {"name": "a", "kind": "slack", "url_env": "A"},
                {"name": "b", "kind": "webhook", "url_env": "B"},
            ]
        }
    )
    sinks = resolve_sinks(config, {"A": "https://a.example/x", "B": " http://b.example/y \n"})
    assert [(s.name, s.url) for s in sinks] == [
        ("a", "https://a.example/x"),
        ("b", "http://b.example/y"),
    ]
    assert "a.example" not in repr(sinks[0])


def test_an_empty_variable_is_as_missing_as_an_unset_one() -> None:
    config = AlertsConfig(sinks=[SinkConfig(name="pager", kind="webhook", url_env="PAGER")])
    with pytest.raises(AlertConfigError, match=r"'pager'.*\$PAGER.*not set or is empty"):
        resolve_sinks(config, {"PAGER": "  "})
