"""Alerts: tell humans on Slack and generic webhooks what babysit saw and did.

Modules, in the order an alert passes through them:

- ``config``     the ``alerts:`` config section (``AlertsConfig``) and ``resolve_sinks``, which
                 reads each sink's URL from the environment variable the config names.
- ``payloads``   ``Alert`` and the Slack Block Kit / generic JSON webhook bodies (pure).
- ``gate``       de-duplication and rate limiting per sink (pure, clock passed in).
- ``transport``  one POST with retries and backoff; redaction of URLs from details and logs.
- ``dispatcher`` ``AlertDispatcher``: per-sink sender threads, bounded queues, result records.

Typical use by the supervisor::

    alerts = AlertDispatcher.from_config(cfg.alerts, on_result=journal.append)  # startup
    alerts.start()
    alerts.submit(Alert.from_finding(finding, run=name, attempt=n, action="rollback"))
    alerts.close()                                                              # shutdown

Errors raised: only ``AlertConfigError`` (a ``ValueError``), from ``resolve_sinks`` and
``AlertDispatcher.from_config``, for a sink whose URL variable is unset or not a URL. Nothing is
raised after startup: delivery problems become ``on_result`` records and log warnings.
"""

from babysit.supervisor.services.alerts.config import (
    AlertConfigError,
    AlertsConfig,
    RateLimitConfig,
    ResolvedSink,
    SinkConfig,
    resolve_sinks,
)
from babysit.supervisor.services.alerts.dispatcher import AlertDispatcher, OnResult
from babysit.supervisor.services.alerts.gate import GateDecision, GateVerdict, SinkGate
from babysit.supervisor.services.alerts.payloads import (
    PAYLOAD_VERSION,
    Alert,
    slack_payload,
    webhook_payload,
)

__all__ = [
    "PAYLOAD_VERSION",
    "Alert",
    "AlertConfigError",
    "AlertDispatcher",
    "AlertsConfig",
    "GateDecision",
    "GateVerdict",
    "OnResult",
    "RateLimitConfig",
    "ResolvedSink",
    "SinkConfig",
    "SinkGate",
    "resolve_sinks",
    "slack_payload",
    "webhook_payload",
]
