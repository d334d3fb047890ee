"""One HTTP POST with retries, whose every outcome is told without the URL.

Retried: connection errors, timeouts, 429 and 5xx (``Retry-After`` is honoured up to the sink's
``max_backoff_s``); otherwise exponential backoff from ``backoff_s``. Not retried: other 4xx and
3xx (redirects are not followed: a webhook that moved is a config error to fix, and following it
would POST the alert somewhere the config never named).

Redaction: a webhook URL is a credential, and both requests' exception messages and urllib3's
DEBUG log lines contain it. So ``Delivery.detail`` is written here from known pieces (never a raw
exception message), passes through ``redact`` anyway, and ``protect()`` installs a filter on
urllib3's loggers that scrubs registered URLs from their records before any handler sees them.
"""

from __future__ import annotations

import email.utils
import logging
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timezone
from urllib.parse import parse_qsl, urlsplit

import requests

from babysit.supervisor.services.alerts.config import ResolvedSink

_HEADERS = {"Content-Type": "application/json; charset=utf-8", "User-Agent": "babysit-alerts/1"}
_BODY_SNIPPET = 200
_URL_RE = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"<>]+")
# Pieces of a requests/urllib3 error message that say *why* without saying *where*.
_REASON_RE = re.compile(
    r"\[Errno -?\d+\][^'\"()\]]*|Connection (?:refused|reset by peer|aborted)"
    r"|Remote end closed connection without response|Name or service not known"
)
_RETRIABLE = (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError)
_URLLIB3_LOGGERS = (
    "urllib3.connectionpool",
    "urllib3.connection",
    "urllib3.poolmanager",
    "urllib3.util.retry",
)


@dataclass(frozen=True, slots=True)
class Delivery:
    """How one alert's delivery to one sink ended.

    ``attempts`` counts requests actually made. ``status`` is the last HTTP status (None if no
    response came back); ``error`` is the last exception's class name (None if the last attempt
    got a response). ``detail`` is one redacted sentence for humans.
    """

    ok: bool
    attempts: int
    status: int | None
    error: str | None
    detail: str
    elapsed_s: float


def post(
    session: requests.Session,
    sink: ResolvedSink,
    body: bytes,
    *,
    max_attempts: int,
    pause: Callable[[float], bool] | None = None,
    time_left: Callable[[], float | None] = lambda: None,
) -> Delivery:
    """POST ``body`` (JSON bytes) to ``sink`` until it succeeds, fails for good, or time is up.

    Blocks for up to ``max_attempts`` requests and the backoffs between them; call it from a
    sender thread, never from the supervisor's loop. ``pause(seconds)`` waits between attempts and
    returns False to give up (shutdown). ``time_left()`` gives seconds until a hard deadline, or
    None; each request's timeout is cut to fit it. Never raises.
    """
    cfg = sink.config
    pause = pause or _sleep
    secrets = secrets_of(sink.url)
    start = time.monotonic()
    attempts, status, error, detail = 0, None, None, "not attempted"

    def result(ok: bool, why: str) -> Delivery:
        return Delivery(ok, attempts, status, error, redact(why, secrets), time.monotonic() - start)

    while True:
        timeout = cfg.timeout_s
        left = time_left()
        if left is not None:
            if left <= 0:
                return result(False, f"{detail}; gave up: shutdown deadline reached")
            timeout = min(timeout, left)
        attempts += 1
        hint: float | None = None
        try:
            response = session.post(
                sink.url,
                data=body,
                headers=_HEADERS,
                timeout=timeout,
                allow_redirects=False,
                stream=True,  # read only a snippet of whatever the endpoint sends back
            )
        except Exception as exc:  # any failure becomes a Delivery, never a raise
            status, error = None, type(exc).__name__
            detail = describe(exc, timeout)
            retriable = isinstance(exc, _RETRIABLE)
        else:
            status, error = response.status_code, None
            snippet = _snippet(response)
            if 200 <= status < 300:
                return result(True, f"HTTP {status} after {attempts} attempt(s)")
            detail = f"HTTP {status}" + (f": {snippet}" if snippet else "")
            retriable = status == 429 or status >= 500
            hint = retry_after_s(response.headers.get("Retry-After"))
        if not retriable:
            return result(False, f"{detail} (not retried)")
        if attempts >= max_attempts:
            return result(False, f"{detail}; gave up after {attempts} attempt(s)")
        delay = min(cfg.backoff_s * 2 ** (attempts - 1), cfg.max_backoff_s)
        if hint is not None:
            delay = min(hint, cfg.max_backoff_s)
        if not pause(delay):
            return result(False, f"{detail}; gave up: shutdown deadline reached")


def describe(exc: BaseException, timeout: float) -> str:
    """One sentence for a failed request, built without the exception's own (URL-bearing) text."""
    if isinstance(exc, requests.ConnectTimeout):
        return f"could not connect within {timeout:.3g} s"
    if isinstance(exc, requests.ReadTimeout):
        return f"no response within {timeout:.3g} s"
    if isinstance(exc, requests.exceptions.SSLError):
        return "TLS handshake or certificate failed"
    if isinstance(exc, requests.ConnectionError):
        reason = _REASON_RE.search(str(exc))
        return "connection failed" + (f": {reason.group(0).strip()}" if reason else "")
    return f"request failed ({type(exc).__name__})"


def retry_after_s(value: str | None, now: float | None = None) -> float | None:
    """Seconds a ``Retry-After`` header asks for (delta-seconds or HTTP-date), or None if absent
    or unreadable. ``now`` is wall-clock seconds, for the date form."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def secrets_of(url: str) -> list[str]:
    """The parts of ``url`` that must not be shown: the URL, its path and query, long path
    segments, query values and any password (longest first, so redaction replaces whole ones)."""
    parts = urlsplit(url)
    found = {url, parts.path, parts.query, f"{parts.path}?{parts.query}"}
    found.update(seg for seg in parts.path.split("/") if len(seg) >= 8)
    found.update(v for _, v in parse_qsl(parts.query) if len(v) >= 4)
    if parts.password:
        found.add(parts.password)
    return sorted((s for s in found if len(s) > 1 and s != "?"), key=len, reverse=True)


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with each secret, and anything shaped like a URL, replaced by a placeholder."""
    for secret in secrets:
        text = text.replace(secret, "<redacted>")
    return _URL_RE.sub("<url>", text)


class _RedactFilter(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self.secrets: list[str] = []
        self.lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        secrets = self.secrets  # replaced, never mutated, so reading it needs no lock
        try:
            message = record.getMessage()
        except Exception:  # a malformed record is not ours to fix
            return True
        if any(s in message for s in secrets):
            record.msg, record.args = redact(message, secrets), None
        return True


_FILTER = _RedactFilter()
_FILTER_INSTALLED = False


def protect(urls: Iterable[str]) -> None:
    """Scrub ``urls`` (and their secret parts) from urllib3's log records from now on.

    Filters on a logger apply only to records created on that very logger, so the filter is
    installed on each urllib3 logger that can print a request line. Idempotent; thread-safe.
    """
    global _FILTER_INSTALLED
    with _FILTER.lock:
        new = set(_FILTER.secrets)
        for url in urls:
            new.update(secrets_of(url))
        _FILTER.secrets = sorted(new, key=len, reverse=True)
        if not _FILTER_INSTALLED:
            for name in _URLLIB3_LOGGERS:
                logging.getLogger(name).addFilter(_FILTER)
            _FILTER_INSTALLED = True


def _sleep(seconds: float) -> bool:
    time.sleep(seconds)
    return True


def _snippet(response: requests.Response) -> str:
    try:
        raw = response.raw.read(_BODY_SNIPPET, decode_content=True)
        text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else ""
    except Exception:  # the status code already says enough
        text = ""
    finally:
        response.close()
    return " ".join(text.split())[:_BODY_SNIPPET]
