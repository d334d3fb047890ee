"""The messages between the babysitters of a multi-node run, declared once.

``wire`` carries JSON objects between the leader (node rank 0) and its followers and vouches
for who sent them; this module says what those objects are. Each kind of message is a frozen
dataclass below, one docstring per field; ``encode`` turns one into the JSON object that goes
on the wire (its kind under ``"type"``, its fields beside it), and ``from_leader`` /
``from_follower`` turn an object that came off the wire back into one, checking every field::

    leader -> follower                      follower -> leader
    Launch    start an attempt              Summary        one step, summarised over the node
    Stop      stop the attempt's workers    NodeFinding    a per-rank detector, a named hang
    Control   a request to the ranks        HangSuspected  reading the ranks' stacks now
    Refused   this connection is not taken  HangCleared    the stalled ranks were working
    Finish    the run is over               RankDied       a rank's process died, or is ending
    Beat      heartbeat                     RankEvent      hello, checkpoint, fingerprint, ...
    KeepAsk   what do your ranks hold?      Exited         torchrun's exit: code, log tails
    KeepWrite write your part of it         Stopped        the stop asked for is done
    KeepRelease  done with your ranks       Leaving        a signal stops this node
                                            KeepViews      what this node's ranks hold
                                            KeepWritten    the files its writers wrote
                                            Beat           heartbeat

The ``Keep`` messages are a just-in-time save of the last completed step across the nodes
(``node.just_in_time``): the leader asks every node what its ranks hold, chooses the writers
(``checkpoints.just_in_time.plan``), has them write, commits, and releases the ranks.

What each side does with them is ``membership``'s and ``leader``'s (the leader) and
``follower``'s business. A follower's reports about an attempt carry its number, so the leader
can drop what an attempt it already replaced still had to say.

Both ends run the same babysit version (the handshake checks ``wire.VERSION``), so a message
this module cannot read is another version's or a bug. Error tree::

    ValueError
     └── MessageError   a peer's object is not a message of this version: ``reason`` is
                        ``type`` (no or unknown kind) or ``field`` (a field missing or mistyped)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from babysit.policies.types import Finding
from babysit.supervisor.contract.directive import Directive
from babysit.supervisor.contract.protocol import WorkerEvent
from babysit.supervisor.node.sketch import StepSummary
from babysit.supervisor.run.journal import json_safe

T = TypeVar("T")


class MessageError(ValueError):
    """An object from a peer that is not a message of this version.

    ``reason``: ``type`` (it names no kind, or one this side does not take) or ``field`` (a
    field is missing or of the wrong type); ``kind``: the ``"type"`` it claimed, as sent.
    """

    def __init__(self, reason: str, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.kind = kind


# -- leader -> follower ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Launch:
    """Start ``attempt``'s workers on this node (stopping any still running first)."""

    TYPE: ClassVar[str] = "launch"
    attempt: int
    """The attempt's number, which the follower's reports about it carry."""
    directive: Directive
    """What the attempt's ranks are told (resume, skips, LR scale, cadence)."""
    rdzv_id: str
    """torchrun's ``--rdzv-id``: the same on every node of the attempt."""
    rdzv_endpoint: str
    """torchrun's ``--rdzv-endpoint`` (``host:port``): the same on every node of the attempt."""
    nnodes: int
    """How many nodes take part in this attempt (torchrun's ``--nnodes``)."""
    node_rank: int
    """This node's index among them (torchrun's ``--node-rank``); the leader's is 0. Not the
    node's configured rank: an elastic run numbers the nodes present."""


@dataclass(frozen=True, slots=True)
class Stop:
    """Stop the attempt's workers, then answer ``Stopped``."""

    TYPE: ClassVar[str] = "stop"
    reason: str
    """Why, for the follower's journal."""
    replacing: bool = False
    """A new attempt follows: torchrun's own shutdown is not waited for (``NodeWorkers.stop``)."""


@dataclass(frozen=True, slots=True)
class Control:
    """Ask the running ranks for something through the attempt's control file."""

    TYPE: ClassVar[str] = "control"
    fields: dict[str, Any]
    """The requests, as ``contract.control.ControlFile.request`` takes them."""


@dataclass(frozen=True, slots=True)
class Refused:
    """The leader will not take this connection; it hangs up after saying so."""

    TYPE: ClassVar[str] = "refused"
    reason: str
    """Why, in a sentence for the follower's journal and console."""
    final: bool
    """Retrying cannot help (a node rank outside ``launch.nnodes``); when false, the node rank
    may still be held by this follower's previous connection, and joining again may work."""


@dataclass(frozen=True, slots=True)
class Finish:
    """The run is over: stop the workers and exit with ``code``."""

    TYPE: ClassVar[str] = "finish"
    code: int
    """The run's exit code, which the follower exits with too."""


@dataclass(frozen=True, slots=True)
class KeepAsk:
    """Say what this node's ranks hold of the last completed step: answer ``KeepViews``."""

    TYPE: ClassVar[str] = "keep_ask"
    attempt: int
    """The attempt whose ranks are asked."""
    seconds: float
    """How long the node may take (the leader's bound on the whole save, what is left of it)."""


@dataclass(frozen=True, slots=True)
class KeepWrite:
    """Have this node's writers of ``plan`` write their part into ``dest`` and copy the marks
    it names from here: answer ``KeepWritten``."""

    TYPE: ClassVar[str] = "keep_write"
    attempt: int
    """The attempt whose ranks write."""
    plan: dict[str, Any]
    """The plan (``checkpoints.just_in_time.Plan.to_json``)."""
    dest: str
    """The staging folder, on the storage every node shares."""
    seconds: float
    """How long the writes may take."""


@dataclass(frozen=True, slots=True)
class KeepRelease:
    """The save is over (written or not): release this node's ranks, which end as they would
    have."""

    TYPE: ClassVar[str] = "keep_release"
    attempt: int
    """The attempt whose ranks are released."""


@dataclass(frozen=True, slots=True)
class Beat:
    """A heartbeat, both ways, from the connection's own thread (``wire.Peer.keep_alive``):
    the other side's silence timer measures whether this process lives."""

    TYPE: ClassVar[str] = "beat"


# -- follower -> leader ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Summary:
    """One step of the attempt, summarised over this node's ranks (in step order)."""

    TYPE: ClassVar[str] = "summary"
    attempt: int
    """The attempt the step belongs to."""
    summary: StepSummary
    """The step's summary, which the leader merges with the other nodes' (``NodeMerger``)."""


@dataclass(frozen=True, slots=True)
class NodeFinding:
    """What a per-rank detector or a hang timer found on this node, named with its host."""

    TYPE: ClassVar[str] = "finding"
    attempt: int
    """The attempt it was found in."""
    finding: Finding
    """The finding; a hang's evidence names its incident folder on this node."""


@dataclass(frozen=True, slots=True)
class HangSuspected:
    """This node's ranks stalled and it reads their stacks now: its view of the hang follows
    (a ``NodeFinding``) or it says ``HangCleared``."""

    TYPE: ClassVar[str] = "hang_suspected"
    attempt: int
    """The attempt whose ranks stalled."""


@dataclass(frozen=True, slots=True)
class HangCleared:
    """The stalled ranks were found working after all: no view of a hang is coming."""

    TYPE: ClassVar[str] = "hang_cleared"
    attempt: int
    """The attempt whose ranks stalled."""


@dataclass(frozen=True, slots=True)
class RankDied:
    """One of this node's ranks' processes died: a crash whose ``Exited`` is on its way."""

    TYPE: ClassVar[str] = "rank_died"
    attempt: int
    """The attempt the rank belonged to."""


@dataclass(frozen=True, slots=True)
class RankEvent:
    """A rare event from one of this node's ranks that the leader needs (``follower.FORWARDED``:
    hello, close, skip, checkpoints, cadence, fingerprints)."""

    TYPE: ClassVar[str] = "event"
    attempt: int
    """The attempt the rank belongs to."""
    event: WorkerEvent
    """The event as the rank sent it (global rank, type, wall time, data)."""


@dataclass(frozen=True, slots=True)
class Exited:
    """This node's torchrun exited on its own."""

    TYPE: ClassVar[str] = "exited"
    attempt: int
    """The attempt that exited."""
    code: int
    """torchrun's exit code (0 also when only the processes' teardown crashed or hung)."""
    tails: dict[int, str] = field(default_factory=dict)
    """Each failed rank's log tail, by global rank."""
    root: int | None = None
    """The rank torchrun named as the first failure, if it named one."""
    exits: dict[int, int] = field(default_factory=dict)
    """Each failed rank's own exit code, by global rank (from torchrun's failure summary)."""
    step: int = 0
    """The newest step this node's ranks reported in the attempt."""


@dataclass(frozen=True, slots=True)
class Stopped:
    """The ``Stop`` the leader asked for is done: this node's workers are gone."""

    TYPE: ClassVar[str] = "stopped"
    attempt: int
    """The attempt that was stopped."""


@dataclass(frozen=True, slots=True)
class Leaving:
    """A signal stops this node: its workers are stopped and its babysitter exits."""

    TYPE: ClassVar[str] = "leaving"
    why: str
    """Which signal, for the leader's journal (``signal 2``)."""


@dataclass(frozen=True, slots=True)
class KeepViews:
    """What this node's ranks hold (the answer to ``KeepAsk``)."""

    TYPE: ClassVar[str] = "keep_views"
    attempt: int
    """The attempt asked about."""
    views: list[dict[str, Any]]
    """Each live rank's answer (``checkpoints.just_in_time.RankView``, as JSON)."""
    absent: dict[int, str] = field(default_factory=dict)
    """Why each other rank of this node gave none (dead, stopped, no answer)."""
    marks: dict[int, int] = field(default_factory=dict)
    """The step each mark file here starts from, by rank."""


@dataclass(frozen=True, slots=True)
class KeepWritten:
    """What this node's writers wrote (the answer to ``KeepWrite``)."""

    TYPE: ClassVar[str] = "keep_written"
    attempt: int
    """The attempt whose ranks wrote."""
    files: list[dict[str, Any]]
    """The files written, as manifest entries (name, size, crc32)."""
    failed: dict[int, str] = field(default_factory=dict)
    """Why each writer here that failed did."""
    formats: dict[int, dict[str, Any]] = field(default_factory=dict)
    """The format each writer here that succeeded wrote: a framework's
    (``checkpoints.just_in_time.Format``, as JSON), or ``{}`` for babysit's own."""


LeaderMessage = Launch | Stop | Control | Refused | Finish | Beat | KeepAsk | KeepWrite | \
    KeepRelease
"""What a follower hears from the leader."""
FollowerMessage = (Summary | NodeFinding | HangSuspected | HangCleared | RankDied | RankEvent
                   | Exited | Stopped | Leaving | Beat | KeepViews | KeepWritten)
"""What the leader hears from a follower."""
Message = LeaderMessage | FollowerMessage


# -- encoding -------------------------------------------------------------------------------------


def encode(message: Message) -> dict[str, Any]:
    """``message`` as the JSON object that goes on the wire (``wire.Peer.send`` takes it).

    Non-finite floats in free-form data (a finding's evidence, an event's data) are written as
    strings (``"nan"``, ``"inf"``): JSON has no such numbers.
    """
    body: dict[str, Any]
    match message:
        case Launch():
            body = {"attempt": message.attempt, "directive": message.directive.to_json(),
                    "rdzv_id": message.rdzv_id, "rdzv_endpoint": message.rdzv_endpoint,
                    "nnodes": message.nnodes, "node_rank": message.node_rank}
        case Stop():
            body = {"reason": message.reason, "replacing": message.replacing}
        case Control():
            body = {"fields": message.fields}
        case Refused():
            body = {"reason": message.reason, "final": message.final}
        case Finish():
            body = {"code": message.code}
        case Beat():
            body = {}
        case Summary():
            body = {"attempt": message.attempt, "summary": message.summary.to_dict()}
        case NodeFinding():
            body = {"attempt": message.attempt, "finding": message.finding.to_json()}
        case HangSuspected() | HangCleared() | RankDied() | Stopped():
            body = {"attempt": message.attempt}
        case RankEvent():
            e = message.event
            body = {"attempt": message.attempt, "rank": e.rank, "event": e.type, "time": e.time,
                    "data": e.data}
        case Exited():
            body = {"attempt": message.attempt, "code": message.code,
                    "tails": {str(r): t for r, t in message.tails.items()}, "root": message.root,
                    "exits": {str(r): c for r, c in message.exits.items()},
                    "step": message.step}
        case Leaving():
            body = {"why": message.why}
        case KeepAsk():
            body = {"attempt": message.attempt, "seconds": message.seconds}
        case KeepWrite():
            body = {"attempt": message.attempt, "plan": message.plan, "dest": message.dest,
                    "seconds": message.seconds}
        case KeepRelease():
            body = {"attempt": message.attempt}
        case KeepViews():
            body = {"attempt": message.attempt, "views": message.views,
                    "absent": {str(r): w for r, w in message.absent.items()},
                    "marks": {str(r): s for r, s in message.marks.items()}}
        case KeepWritten():
            body = {"attempt": message.attempt, "files": message.files,
                    "failed": {str(r): w for r, w in message.failed.items()},
                    "formats": {str(r): f for r, f in message.formats.items()}}
    safe: dict[str, Any] = json_safe({"type": message.TYPE, **body})
    return safe


# -- decoding -------------------------------------------------------------------------------------


_REQUIRED: Any = object()
"""The default of a field that must be present."""


class _Fields:
    """One object's fields, each read with the type it must have; a missing or mistyped one is
    a ``MessageError`` naming the message's kind and the field."""

    def __init__(self, kind: str, obj: dict[str, Any]) -> None:
        self.kind = kind
        self.obj = obj

    def error(self, key: str, what: str) -> MessageError:
        return MessageError("field", self.kind,
                            f"a {self.kind!r} message whose field {key!r} {what} (it holds "
                            f"{sorted(self.obj)})")

    def _get(self, key: str, default: Any) -> Any:
        if key in self.obj:
            return self.obj[key]
        if default is _REQUIRED:
            raise self.error(key, "is missing")
        return default

    def integer(self, key: str, default: Any = _REQUIRED) -> int:
        value = self._get(key, default)
        if not isinstance(value, int) or isinstance(value, bool):
            raise self.error(key, f"is not an integer: {value!r}")
        return value

    def optional_int(self, key: str) -> int | None:
        return None if self._get(key, None) is None else self.integer(key)

    def number(self, key: str) -> float:
        value = self._get(key, _REQUIRED)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise self.error(key, f"is not a number: {value!r}")
        return float(value)

    def text(self, key: str, default: Any = _REQUIRED) -> str:
        value = self._get(key, default)
        if not isinstance(value, str):
            raise self.error(key, f"is not a string: {value!r}")
        return value

    def flag(self, key: str, default: Any = _REQUIRED) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise self.error(key, f"is not true or false: {value!r}")
        return value

    def mapping(self, key: str, default: Any = _REQUIRED) -> dict[str, Any]:
        value = self._get(key, default)
        if not isinstance(value, dict):
            raise self.error(key, f"is not a JSON object: {value!r}")
        return value

    def by_rank(self, key: str, kind: type[T]) -> dict[int, T]:
        """An object from ranks (JSON keys are strings) to values of ``kind``; empty if absent."""
        out: dict[int, T] = {}
        for rank, value in self.mapping(key, {}).items():
            if not isinstance(rank, str) or not rank.isdigit() or not isinstance(value, kind) \
                    or isinstance(value, bool):
                raise self.error(key, f"does not map ranks to {kind.__name__}s: "
                                      f"{rank!r}: {value!r}")
            out[int(rank)] = value
        return out

    def objects(self, key: str) -> list[dict[str, Any]]:
        """A list of JSON objects."""
        value = self._get(key, _REQUIRED)
        if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
            raise self.error(key, f"is not a list of JSON objects: {value!r}")
        return value

    def parsed(self, key: str, parse: Callable[[dict[str, Any]], T]) -> T:
        """A nested object, read by its own type's reader (``from_json``, ``from_dict``)."""
        value = self.mapping(key)
        try:
            return parse(value)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise self.error(key, f"is not valid ({type(exc).__name__}: {exc})") from None


def _launch(f: _Fields) -> Launch:
    return Launch(attempt=f.integer("attempt"),
                  directive=f.parsed("directive", Directive.from_json),
                  rdzv_id=f.text("rdzv_id"), rdzv_endpoint=f.text("rdzv_endpoint"),
                  nnodes=f.integer("nnodes"), node_rank=f.integer("node_rank"))


def _event(f: _Fields) -> RankEvent:
    return RankEvent(attempt=f.integer("attempt"), event=WorkerEvent(
        rank=f.integer("rank"), type=f.text("event"), time=f.number("time"),
        data=f.mapping("data")))


def _exited(f: _Fields) -> Exited:
    return Exited(attempt=f.integer("attempt"), code=f.integer("code"),
                  tails=f.by_rank("tails", str), root=f.optional_int("root"),
                  exits=f.by_rank("exits", int), step=f.integer("step", 0))


_FROM_LEADER: dict[str, Callable[[_Fields], LeaderMessage]] = {
    Launch.TYPE: _launch,
    Stop.TYPE: lambda f: Stop(reason=f.text("reason"), replacing=f.flag("replacing", False)),
    Control.TYPE: lambda f: Control(fields=f.mapping("fields")),
    Refused.TYPE: lambda f: Refused(reason=f.text("reason"), final=f.flag("final")),
    Finish.TYPE: lambda f: Finish(code=f.integer("code")),
    Beat.TYPE: lambda f: Beat(),
    KeepAsk.TYPE: lambda f: KeepAsk(attempt=f.integer("attempt"), seconds=f.number("seconds")),
    KeepWrite.TYPE: lambda f: KeepWrite(attempt=f.integer("attempt"), plan=f.mapping("plan"),
                                        dest=f.text("dest"), seconds=f.number("seconds")),
    KeepRelease.TYPE: lambda f: KeepRelease(attempt=f.integer("attempt")),
}

_FROM_FOLLOWER: dict[str, Callable[[_Fields], FollowerMessage]] = {
    Summary.TYPE: lambda f: Summary(attempt=f.integer("attempt"),
                                    summary=f.parsed("summary", StepSummary.from_dict)),
    NodeFinding.TYPE: lambda f: NodeFinding(attempt=f.integer("attempt"),
                                            finding=f.parsed("finding", Finding.from_json)),
    HangSuspected.TYPE: lambda f: HangSuspected(attempt=f.integer("attempt")),
    HangCleared.TYPE: lambda f: HangCleared(attempt=f.integer("attempt")),
    RankDied.TYPE: lambda f: RankDied(attempt=f.integer("attempt")),
    RankEvent.TYPE: _event,
    Exited.TYPE: _exited,
    Stopped.TYPE: lambda f: Stopped(attempt=f.integer("attempt")),
    Leaving.TYPE: lambda f: Leaving(why=f.text("why")),
    Beat.TYPE: lambda f: Beat(),
    KeepViews.TYPE: lambda f: KeepViews(attempt=f.integer("attempt"), views=f.objects("views"),
                                        absent=f.by_rank("absent", str),
                                        marks=f.by_rank("marks", int)),
    KeepWritten.TYPE: lambda f: KeepWritten(attempt=f.integer("attempt"),
                                            files=f.objects("files"),
                                            failed=f.by_rank("failed", str),
                                            formats=f.by_rank("formats", dict)),
}


def from_leader(obj: dict[str, Any]) -> LeaderMessage:
    """What a follower received, as its message. Raises ``MessageError`` for an object that is
    no message a leader sends, or whose fields are missing or mistyped."""
    return _decode(obj, _FROM_LEADER, "the leader")


def from_follower(obj: dict[str, Any]) -> FollowerMessage:
    """What the leader received from a follower, as its message. Raises ``MessageError`` for
    an object that is no message a follower sends, or whose fields are missing or mistyped."""
    return _decode(obj, _FROM_FOLLOWER, "a follower")


def _decode(obj: dict[str, Any], readers: dict[str, Callable[[_Fields], T]], sender: str) -> T:
    kind = obj.get("type")
    reader = readers.get(kind) if isinstance(kind, str) else None
    if reader is None:
        raise MessageError("type", str(kind),
                           f"{sender} sent a message of unknown type {kind!r} (it holds "
                           f"{sorted(obj)}); every node must run the same babysit version")
    return reader(_Fields(str(kind), obj))
