"""The messages between babysitters (``supervisor.cluster.messages``): every kind survives the
trip through JSON as the wire carries it, and an object that is no message of this version is
refused with an error that names its kind and field, never a KeyError.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import pytest

from babysit.policies.types import Finding, Incident, RankStep, Severity
from babysit.supervisor.cluster.messages import (
    Beat,
    Control,
    Exited,
    Finish,
    FollowerMessage,
    HangCleared,
    HangSuspected,
    KeepAsk,
    KeepRelease,
    KeepViews,
    KeepWrite,
    KeepWritten,
    Launch,
    LeaderMessage,
    Leaving,
    MessageError,
    NodeFinding,
    RankDied,
    RankEvent,
    Refused,
    Stop,
    Stopped,
    Summary,
    encode,
    from_follower,
    from_leader,
)
from babysit.supervisor.contract.directive import Directive, LrRamp, SkipRange
from babysit.supervisor.contract.protocol import WorkerEvent
from babysit.supervisor.node.sketch import StepSummary


def wire(obj: dict[str, Any]) -> dict[str, Any]:
    """What the other end's ``Peer.receive`` hands over: the object through strict JSON."""
    out: dict[str, Any] = json.loads(json.dumps(obj, allow_nan=False))
    return out


def summary() -> StepSummary:
    s = StepSummary(12, 4)
    for rank in (2, 3):
        s.add(RankStep(rank=rank, step=12, time=100.0 + rank, loss=2.5 + rank, grad_norm=1.0,
                       tokens=4096.0, step_time=0.25))
    return s


def finding() -> Finding:
    return Finding(incident=Incident.NONFINITE, detector="nonfinite", severity=Severity.CRITICAL,
                   step=12, onset_step=11, ranks=(3,), onset_cursor=4096,
                   message="rank 3 reported a NaN loss [node 1, host gpu-b]",
                   evidence={"loss": {"3": "nan"}, "node": 1, "host": "gpu-b"})


LEADER_MESSAGES: list[LeaderMessage] = [
    Launch(attempt=2, directive=Directive(attempt=2, skip=(SkipRange(100, 120),), lr_scale=0.5,
                                          lr_ramp=LrRamp(100, 120, 220, 1.0)),
           rdzv_id="run-2", rdzv_endpoint="10.0.0.1:29400", nnodes=3, node_rank=2),
    Stop("hang", replacing=True),
    Stop("the run is over"),
    Control({"checkpoint_every": 50, "final": True}),
    Refused("node rank 1 is already taken by gpu-a", final=False),
    Refused("node rank 7 is not in 1..2 (launch.nnodes)", final=True),
    Finish(3),
    Beat(),
    KeepAsk(2, 9.5),
    KeepWrite(2, {"step": 239, "cursor": 239, "samples": None, "lr_scale": 1.0,
                  "writers": [0, 4], "marks": [1, 2, 3], "streams_lost": [5, 6, 7]},
              "/ckpt/.just_in_time-00000239", 8.25),
    KeepRelease(2),
]

FOLLOWER_MESSAGES: list[FollowerMessage] = [
    NodeFinding(1, finding()),
    HangSuspected(1),
    HangCleared(1),
    RankDied(1),
    RankEvent(1, WorkerEvent(rank=3, type="checkpoint", time=1700000000.5,
                             data={"step": 40, "path": "/ckpt/step-40"})),
    Exited(1, 1, tails={3: "RuntimeError: boom", 2: "peer closed"}, root=3,
           exits={3: 1, 2: -15}, step=40),
    Exited(1, 0),
    Stopped(1),
    Leaving("signal 15"),
    Beat(),
    KeepViews(2, [{"rank": 4, "consistent": True, "step": 239, "cursor": 239, "samples": None,
                   "lr_scale": 1.0, "shard": 0, "shards": 1, "why": None}],
              absent={5: "dead", 6: "stopped (SIGSTOP): it cannot answer until continued"},
              marks={4: 239, 5: 239}),
    KeepViews(2, []),
    KeepWritten(2, [{"name": "__4_0.distcp", "size": 4096, "crc32": 123}], failed={4: "disk"}),
    KeepWritten(2, [{"name": "model.safetensors", "size": 4096, "crc32": 123}],
                formats={4: {"name": "transformers", "resume": "."}, 5: {}}),
]


@pytest.mark.parametrize("message", LEADER_MESSAGES, ids=lambda m: type(m).__name__)
def test_every_leader_message_comes_back_as_it_was_sent(message: LeaderMessage) -> None:
    assert from_leader(wire(encode(message))) == message


@pytest.mark.parametrize("message", FOLLOWER_MESSAGES, ids=lambda m: type(m).__name__)
def test_every_follower_message_comes_back_as_it_was_sent(message: FollowerMessage) -> None:
    assert from_follower(wire(encode(message))) == message


def test_a_summary_comes_back_as_the_same_summary() -> None:
    sent = summary()

    got = from_follower(wire(encode(Summary(4, sent))))

    assert isinstance(got, Summary) and got.attempt == 4
    assert got.summary.to_dict() == sent.to_dict()
    assert got.summary.to_row(4) == sent.to_row(4)


def test_non_finite_values_in_free_form_data_cross_as_strings() -> None:
    nan = dataclasses.replace(finding(), evidence={"loss": math.nan, "grad_norm": -math.inf})
    event = WorkerEvent(rank=0, type="fingerprint", time=1.0, data={"digest": math.inf})

    got_finding = from_follower(wire(encode(NodeFinding(0, nan))))
    got_event = from_follower(wire(encode(RankEvent(0, event))))

    assert isinstance(got_finding, NodeFinding)
    assert got_finding.finding.evidence == {"loss": "nan", "grad_norm": "-inf"}
    assert isinstance(got_event, RankEvent) and got_event.event.data == {"digest": "inf"}


def test_the_on_wire_layout_is_the_documented_one() -> None:
    """The objects the two ends exchange: the kind under ``type``, the fields beside it."""
    assert encode(Stop("hang")) == {"type": "stop", "reason": "hang", "replacing": False}
    assert encode(Beat()) == {"type": "beat"}
    assert encode(Exited(0, 1, tails={4: "boom"}, root=4, exits={4: 1}, step=7)) == {
        "type": "exited", "attempt": 0, "code": 1, "tails": {"4": "boom"}, "root": 4,
        "exits": {"4": 1}, "step": 7}
    assert encode(RankEvent(2, WorkerEvent(rank=5, type="hello", time=3.0, data={}))) == {
        "type": "event", "attempt": 2, "rank": 5, "event": "hello", "time": 3.0, "data": {}}


def test_an_exit_without_its_optional_fields_reads_as_no_evidence() -> None:
    assert from_follower({"type": "exited", "attempt": 0, "code": 137}) == Exited(0, 137)


# -- what is refused ------------------------------------------------------------------------------


def refused(read: Any, obj: dict[str, Any]) -> MessageError:
    with pytest.raises(MessageError) as caught:
        read(obj)
    return caught.value


@pytest.mark.parametrize("obj", [{}, {"type": 3}, {"type": "teleport", "attempt": 0}],
                         ids=["no type", "not a string", "unknown"])
def test_an_unknown_kind_is_refused_by_both_sides(obj: dict[str, Any]) -> None:
    for read in (from_leader, from_follower):
        error = refused(read, obj)
        assert error.reason == "type"
        assert "unknown type" in str(error) and "same babysit version" in str(error)


def test_a_kind_from_the_other_direction_is_unknown() -> None:
    # A follower never launches; a leader never reports a summary.
    launch = encode(LEADER_MESSAGES[0])
    error = refused(from_follower, launch)
    assert (error.reason, error.kind) == ("type", "launch")
    assert str(error).startswith("a follower sent a message of unknown type 'launch'")
    assert refused(from_leader, encode(Stopped(0))).reason == "type"


@pytest.mark.parametrize(("obj", "field", "what"), [
    ({"type": "stopped"}, "attempt", "is missing"),
    ({"type": "stopped", "attempt": "0"}, "attempt", "is not an integer: '0'"),
    ({"type": "stopped", "attempt": True}, "attempt", "is not an integer: True"),
    ({"type": "exited", "attempt": 0, "code": 1.5}, "code", "is not an integer: 1.5"),
    ({"type": "exited", "attempt": 0, "code": 1, "tails": ["boom"]}, "tails",
     "is not a JSON object"),
    ({"type": "exited", "attempt": 0, "code": 1, "tails": {"four": "boom"}}, "tails",
     "does not map ranks to strs"),
    ({"type": "exited", "attempt": 0, "code": 1, "exits": {"4": "1"}}, "exits",
     "does not map ranks to ints"),
    ({"type": "exited", "attempt": 0, "code": 1, "root": "4"}, "root", "is not an integer"),
    ({"type": "event", "attempt": 0, "rank": 1, "event": "hello", "time": "now", "data": {}},
     "time", "is not a number: 'now'"),
    ({"type": "event", "attempt": 0, "rank": 1, "event": "hello", "time": 1.0}, "data",
     "is missing"),
    ({"type": "summary", "attempt": 0, "summary": {"step": 1}}, "summary", "is not valid"),
    ({"type": "finding", "attempt": 0, "finding": {"incident": "no-such-incident"}}, "finding",
     "is not valid"),
    ({"type": "leaving", "why": None}, "why", "is not a string: None"),
])
def test_a_malformed_follower_message_names_its_kind_and_field(
        obj: dict[str, Any], field: str, what: str) -> None:
    error = refused(from_follower, obj)

    assert (error.reason, error.kind) == ("field", obj["type"])
    assert str(error).startswith(f"a {obj['type']!r} message whose field {field!r} {what}")


@pytest.mark.parametrize(("obj", "field"), [
    ({"type": "launch", "attempt": 1, "directive": {}, "rdzv_id": "r", "rdzv_endpoint": "h:1",
      "nnodes": "2", "node_rank": 1}, "nnodes"),
    ({"type": "launch", "attempt": 1, "directive": {"skip": [{"start": 1}]}, "rdzv_id": "r",
      "rdzv_endpoint": "h:1", "nnodes": 2, "node_rank": 1}, "directive"),
    ({"type": "launch", "attempt": 1, "directive": [], "rdzv_id": "r", "rdzv_endpoint": "h:1",
      "nnodes": 2, "node_rank": 1}, "directive"),
    ({"type": "stop", "reason": "hang", "replacing": "yes"}, "replacing"),
    ({"type": "control", "fields": "final"}, "fields"),
    ({"type": "refused", "reason": "taken"}, "final"),
    ({"type": "finish"}, "code"),
])
def test_a_malformed_leader_message_names_its_kind_and_field(
        obj: dict[str, Any], field: str) -> None:
    error = refused(from_leader, obj)

    assert (error.reason, error.kind) == ("field", obj["type"])
    assert f"field {field!r}" in str(error)


def test_a_message_error_is_a_value_error() -> None:
    # What a caller that guards a peer's input with ``except ValueError`` already catches.
    assert issubclass(MessageError, ValueError)
