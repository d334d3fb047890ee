"""The telemetry wire format between a rank and its node's supervisor.

Ranks send messages over a node-local Unix socket inside the run directory (mode 0700, so other
users cannot reach it; the transport is described in ``babysit.supervisor.node.intake``) and prefix
every message with the run's 16-byte token, so a stray process of the same user that finds the
socket still cannot inject telemetry. Sends are non-blocking: when the supervisor falls behind and
the rank's buffer is full, ``send`` fails at once and the rank drops the report instead of waiting.

Two kinds of message share one header::

    magic "BS" | version u8 | kind u8 | token 16 bytes | payload

- ``STEP``: the per-step report, a fixed binary struct (packing it costs well under a microsecond;
  JSON would cost several).
- ``EVENT``: rare messages (hello, phase begin/end, skip, close) as UTF-8 JSON.

This module is imported by the worker side, so it must stay free of heavy imports.
"""

from __future__ import annotations

import json
import math
import socket
import struct
from dataclasses import dataclass
from typing import Any

from babysit.policies.types import RankStep

MAGIC = b"BS"
VERSION = 2
KIND_STEP = 1
KIND_EVENT = 2
TOKEN_BYTES = 16
MAX_DATAGRAM = 8192
"""Largest message the intake accepts; events larger than this are refused by the sender."""

HEADER = struct.Struct("<2sBB16s")

OPTIONAL_FIELDS = ("loss", "grad_norm", "lr", "tokens", "samples", "step_time", "data_wait",
                   "forward_time")
"""A step report's optional ``RankStep`` fields, in the order they are packed after ``time``.
This is the one declaration: the worker, the decoder and the incident ring all follow it."""
PRESENT = {name: 1 << bit for bit, name in enumerate(OPTIONAL_FIELDS)}
"""The flag bit that says an optional field was reported (absent fields are packed as 0.0)."""
FLAG_SKIPPED = 1 << 15

# A step report's body: rank, flags, step, cursor, time, then the optional fields.
STEP_BODY = struct.Struct("<iHqqd" + "d" * len(OPTIONAL_FIELDS))
STEP = struct.Struct(HEADER.format + STEP_BODY.format[1:])


class ProtocolError(ValueError):
    """A datagram that is not a valid babysit message.

    ``reason`` is a short stable label (``short``, ``magic``, ``version``, ``token``, ``kind``,
    ``size``, ``fields``, ``json``, ``too_big``) that the intake counts rejections by.
    """

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class WorkerEvent:
    """A rare message from a rank: ``type`` is hello, phase, checkpoint or close."""

    rank: int
    type: str
    time: float
    data: dict[str, Any]


def step_body(sample: RankStep) -> tuple[Any, ...]:
    """``sample`` as the values of a ``STEP_BODY``: rank, flags, step, cursor, time, then
    ``OPTIONAL_FIELDS`` (0.0 where absent, with its ``PRESENT`` bit clear)."""
    flags = FLAG_SKIPPED if sample.skipped else 0
    values: list[float] = []
    for name in OPTIONAL_FIELDS:
        value = getattr(sample, name)
        if value is None:
            values.append(0.0)
        else:
            flags |= PRESENT[name]
            values.append(float(value))
    return (sample.rank, flags, sample.step, sample.cursor, sample.time, *values)


def rank_step(body: tuple[Any, ...]) -> RankStep:
    """The ``RankStep`` of a ``STEP_BODY``'s unpacked values (``step_body``'s inverse)."""
    rank, flags, step, cursor, time = body[:5]
    optional = {name: (body[5 + i] if flags & PRESENT[name] else None)
                for i, name in enumerate(OPTIONAL_FIELDS)}
    return RankStep(rank=rank, step=step, cursor=cursor, time=time,
                    skipped=bool(flags & FLAG_SKIPPED), **optional)


def encode_step(token: bytes, sample: RankStep) -> bytes:
    """Pack one step report. The worker's hot path inlines this; it is here for tests and tools."""
    return STEP.pack(MAGIC, VERSION, KIND_STEP, token, *step_body(sample))


def encode_event(token: bytes, rank: int, type_: str, time: float, **data: Any) -> bytes:
    """Pack a rare event as JSON. Raises ``ProtocolError`` if it would not fit in one datagram."""
    body = json.dumps({"rank": rank, "type": type_, "time": time, "data": data}).encode()
    message = HEADER.pack(MAGIC, VERSION, KIND_EVENT, token) + body
    if len(message) > MAX_DATAGRAM:
        raise ProtocolError(
            "too_big", f"event {type_!r} is {len(message)} bytes, over {MAX_DATAGRAM}")
    return message


def decode(token: bytes, datagram: bytes) -> RankStep | WorkerEvent:
    """Parse and authenticate one datagram. Raises ``ProtocolError`` on anything malformed.

    The token comparison is constant-time so a local attacker cannot guess it byte by byte.
    """
    import hmac

    if len(datagram) < HEADER.size:
        raise ProtocolError("short", f"message of {len(datagram)} bytes is shorter than a header")
    magic, version, kind, their_token = HEADER.unpack_from(datagram)
    if magic != MAGIC:
        raise ProtocolError("magic", "bad magic")
    if version != VERSION:
        raise ProtocolError("version", f"protocol version {version}, expected {VERSION}")
    if not hmac.compare_digest(their_token, token):
        raise ProtocolError("token", "wrong token")
    if kind == KIND_STEP:
        return _decode_step(datagram)
    if kind == KIND_EVENT:
        return _decode_event(datagram[HEADER.size :])
    raise ProtocolError("kind", f"unknown message kind {kind}")


def _decode_step(datagram: bytes) -> RankStep:
    if len(datagram) != STEP.size:
        raise ProtocolError("size", f"step message of {len(datagram)} bytes, expected {STEP.size}")
    body = STEP.unpack(datagram)[4:]
    rank, _, step, cursor, time = body[:5]
    if rank < 0 or step < 0 or cursor < 0 or not math.isfinite(time):
        raise ProtocolError("fields", f"step message with rank={rank} step={step} cursor={cursor}")
    return rank_step(body)


def _decode_event(body: bytes) -> WorkerEvent:
    try:
        obj = json.loads(body)
        rank, type_, time, data = obj["rank"], obj["type"], obj["time"], obj["data"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ProtocolError("json", f"malformed event: {exc}") from None
    if not (isinstance(rank, int) and rank >= 0 and isinstance(type_, str)
            and isinstance(time, (int, float)) and isinstance(data, dict)):
        raise ProtocolError("fields", "malformed event fields")
    return WorkerEvent(rank=rank, type=type_, time=float(time), data=data)


# Environment variables the supervisor sets for every rank. The worker API reads only these; when
# they are absent (plain torchrun or python) it runs as a no-op.
ENV_SOCKET = "BABYSIT_SOCKET"
ENV_TOKEN = "BABYSIT_TOKEN"
ENV_RUN_DIR = "BABYSIT_RUN_DIR"
ENV_ATTEMPT = "BABYSIT_ATTEMPT"
ENV_DIRECTIVE = "BABYSIT_DIRECTIVE"
ENV_STANDBY = "BABYSIT_STANDBY"
"""Set only for a warm standby's ranks (``node.standby``): the folder where ``attach()`` says
it is ready (``ready/<local rank>``) and then waits for ``go`` before it reads the directive."""
ENV_SUPERVISOR_PID = "BABYSIT_SUPERVISOR_PID"
"""With ``ENV_STANDBY``: a waiting standby rank exits when this process is gone."""
STANDBY_READY = "ready"
STANDBY_GO = "go"


def connect(path: str, timeout_s: float = 5.0) -> socket.socket:
    """A rank's connection to the intake: non-blocking for sends, with a large send buffer so a
    briefly busy supervisor costs nothing but memory. Raises ``OSError`` if nobody listens."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    sock.settimeout(timeout_s)
    try:
        sock.connect(path)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock

def finite(value: Any) -> float | None:
    """A JSON number from a rank's event or the journal as a finite float, else None: not a
    bool, not NaN or infinite, and never an ``OverflowError`` (a JSON integer can be too large
    for a float, and a rank's event is only as sane as its script)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def mfu_inputs(hello: dict[str, Any]) -> tuple[float | None, float | None]:
    """MFU's inputs from rank 0's hello: FLOPs per token and one device's peak FLOP/s, the
    script's own numbers or None (never a guess)."""
    return positive(hello.get("flops_per_token")), positive(hello.get("peak_flops"))


def positive(value: Any) -> float | None:
    """A positive finite number from a rank's event, else None (never a guess, never a crash)."""
    number = finite(value)
    return number if number is not None and number > 0 else None
