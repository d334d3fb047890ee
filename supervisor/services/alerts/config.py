"""The ``alerts:`` section of a run config, and turning it into sinks with real URLs.

Webhook URLs are secrets (a Slack incoming-webhook URL is its own credential), so the config holds
only the *name* of the environment variable that holds each URL. ``resolve_sinks`` reads them once,
at startup, and fails with one paragraph naming the sink and the variable when one is missing.
From there on a URL lives only inside ``ResolvedSink.url`` (left out of its repr) and the HTTP
call itself: logs, errors and journal records name the sink, never the URL.

Example::

    alerts:
      sinks:
        - name: team-slack
          kind: slack
          url_env: BABYSIT_SLACK_URL
          min_severity: warning
        - name: pager
          kind: webhook
          url_env: BABYSIT_PAGER_URL
          min_severity: critical
          rate_limit: {max_alerts: 3, window_s: 3600}
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, model_validator

from babysit.policies.types import Severity

SeverityName = Literal["info", "warning", "critical"]


class AlertConfigError(ValueError):
    """An alerts setting cannot work as written; the message says which sink and what to do."""


class RateLimitConfig(BaseModel):
    """At most ``max_alerts`` sends per sliding ``window_s``; the excess is dropped and counted."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    max_alerts: int = Field(default=10, ge=1)
    """Most alerts this sink sends within any ``window_s`` seconds."""
    window_s: float = Field(default=600.0, gt=0)
    """Length of the sliding rate-limit window, in seconds."""
    summary: bool = True
    """Say how many alerts were dropped ("N alerts suppressed") in the next alert that is sent."""


class SinkConfig(BaseModel):
    """One destination for alerts: a Slack incoming webhook or a generic JSON webhook."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    """How logs and the journal refer to this sink (its URL never appears anywhere)."""
    kind: Literal["slack", "webhook"]
    """``slack``: a Slack incoming webhook, sent as Block Kit. ``webhook``: any HTTP endpoint,
    sent the documented JSON payload (see
    ``babysit.supervisor.services.alerts.payloads.webhook_payload``)."""
    url_env: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """Name of the environment variable that holds the URL, read once when babysit starts."""
    min_severity: SeverityName = "warning"
    """Quietest alert this sink receives: ``info``, ``warning`` or ``critical``."""
    timeout_s: float = Field(default=5.0, gt=0)
    """Seconds to wait for the endpoint to connect and to answer, per attempt."""
    max_retries: int = Field(default=3, ge=0)
    """Retries after the first attempt on connection errors, timeouts, 429 and 5xx (not other
    4xx: those mean the request itself is wrong and would fail again)."""
    backoff_s: float = Field(default=1.0, ge=0)
    """Wait before the first retry, in seconds; it doubles for each further retry."""
    max_backoff_s: float = Field(default=30.0, ge=0)
    """Longest wait between attempts, in seconds; also caps a 429's ``Retry-After``."""
    dedup_window_s: float = Field(default=600.0, ge=0)
    """An alert whose dedup key was sent less than this many seconds ago is suppressed (and
    counted). 0 turns de-duplication off."""
    rate_limit: RateLimitConfig = Field(default_factory=RateLimitConfig)
    """How many alerts this sink may send per window."""

    @property
    def severity(self) -> Severity:
        """``min_severity`` as the ``Severity`` it names."""
        return Severity[self.min_severity.upper()]


class AlertsConfig(BaseModel):
    """Where alerts go. With no sinks, alerts are journaled only."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    sinks: list[SinkConfig] = Field(default_factory=list)
    """Destinations; each gets every alert at or above its ``min_severity``."""
    queue_size: int = Field(default=100, ge=1)
    """Alerts waiting per sink before new ones are dropped (and counted) rather than block."""
    close_timeout_s: float = Field(default=10.0, ge=0)
    """On shutdown, how long babysit keeps trying to deliver queued alerts, in seconds."""

    @model_validator(mode="after")
    def _names_unique(self) -> AlertsConfig:
        names = [s.name for s in self.sinks]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(
                f"alert sink names must be unique, but {', '.join(dupes)} appears more than once; "
                "rename one of them (the name is how logs and the journal tell sinks apart)"
            )
        return self


@dataclass(frozen=True, slots=True)
class ResolvedSink:
    """A sink's config plus its URL, read from the environment. ``url`` is kept out of repr."""

    config: SinkConfig
    url: str = field(repr=False)

    @property
    def name(self) -> str:
        return self.config.name


def resolve_sinks(
    config: AlertsConfig, environ: Mapping[str, str] | None = None
) -> list[ResolvedSink]:
    """Read every sink's URL from ``environ`` (default ``os.environ``); call once at startup.

    Raises ``AlertConfigError`` naming the sink and the variable when a variable is unset, empty,
    or not an http(s) URL. The message never contains the variable's value.
    """
    env = os.environ if environ is None else environ
    resolved = []
    for sink in config.sinks:
        url = env.get(sink.url_env, "").strip()
        where = f"alerts sink {sink.name!r} (kind {sink.kind}) reads its URL from ${sink.url_env}"
        if not url:
            raise AlertConfigError(
                f"{where}, but that environment variable is not set or is empty. Export it in "
                f"the environment that runs babysit (e.g. `export {sink.url_env}=https://...`), "
                "or remove the sink from the config's alerts.sinks."
            )
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise AlertConfigError(
                f"{where}, but its value is not an http:// or https:// URL (the value is not "
                f"shown because webhook URLs are secrets). Check ${sink.url_env}."
            )
        resolved.append(ResolvedSink(config=sink, url=url))
    return resolved
