"""The telemetry path from a rank's ``run.step()`` to the supervisor's intake, on a real socket."""

from __future__ import annotations

import json
import math
import os
import socket
from pathlib import Path

import pytest

from babysit.policies.types import RankStep
from babysit.supervisor.contract import protocol
from babysit.supervisor.contract.directive import Directive, SkipRange
from babysit.supervisor.node.intake import Intake
from babysit.supervisor.rank.api import Run, attach

TOKEN = bytes(range(16))


def test_step_round_trip_keeps_absent_and_nonfinite_values() -> None:
    sample = RankStep(rank=3, step=7, time=1.5, cursor=9, loss=math.nan, grad_norm=None,
                      lr=1e-3, tokens=512.0, step_time=0.25, data_wait=0.01, skipped=True)
    decoded = protocol.decode(TOKEN, protocol.encode_step(TOKEN, sample))
    assert isinstance(decoded, RankStep)
    assert math.isnan(decoded.loss or 0.0)
    assert decoded.grad_norm is None and decoded.samples is None
    assert (decoded.rank, decoded.step, decoded.cursor, decoded.lr, decoded.skipped) == (
        3, 7, 9, 1e-3, True)


@pytest.mark.parametrize("datagram, reason", [
    (b"", "short"),
    (b"XX" + bytes(30), "magic"),
    (protocol.HEADER.pack(b"BS", 9, 1, TOKEN), "version"),
    (protocol.HEADER.pack(b"BS", protocol.VERSION, 1, bytes(16)), "token"),
    (protocol.HEADER.pack(b"BS", protocol.VERSION, 7, TOKEN), "kind"),
    (protocol.HEADER.pack(b"BS", protocol.VERSION, 1, TOKEN) + b"xx", "size"),
    (protocol.HEADER.pack(b"BS", protocol.VERSION, 2, TOKEN) + b"{not json", "json"),
    (protocol.HEADER.pack(b"BS", protocol.VERSION, 2, TOKEN)
     + b'{"rank": -1, "type": 1, "time": 0, "data": {}}', "fields"),
])
def test_bad_datagrams_are_refused_with_a_reason(datagram: bytes, reason: str) -> None:
    with pytest.raises(protocol.ProtocolError) as info:
        protocol.decode(TOKEN, datagram)
    assert info.value.reason == reason


@pytest.fixture
def intake(tmp_path: Path):
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    it = Intake(run_dir / "telemetry.sock", TOKEN).open()
    yield it
    it.close()


def connect(path: Path) -> socket.socket:
    from babysit.supervisor.contract.protocol import connect as rank_connect

    return rank_connect(str(path))


def test_worker_reports_reach_the_intake(intake: Intake, monkeypatch) -> None:
    monkeypatch.setenv(protocol.ENV_SOCKET, str(intake.path))
    monkeypatch.setenv(protocol.ENV_TOKEN, TOKEN.hex())
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    run = attach()
    assert run.active
    for loss in (2.0, 1.5):
        assert run.step(loss=loss, grad_norm=0.5, tokens=64)
    with run.phase("eval"):
        pass
    run.close()
    messages = intake.drain()
    types = [m.type if isinstance(m, protocol.WorkerEvent) else "step" for m in messages]
    assert types == ["hello", "step", "step", "phase", "phase", "close"]
    steps = [m for m in messages if isinstance(m, RankStep)]
    assert [(s.rank, s.step, s.loss) for s in steps] == [(1, 1, 2.0), (1, 2, 1.5)]
    assert steps[0].step_time is None and steps[1].step_time is not None


def test_extra_scalars_travel_as_an_event_after_their_step(intake: Intake,
                                                            monkeypatch) -> None:
    monkeypatch.setenv(protocol.ENV_SOCKET, str(intake.path))
    monkeypatch.setenv(protocol.ENV_TOKEN, TOKEN.hex())
    run = attach()
    run.step(loss=2.0)
    run.step(loss=1.9, scalars={"eval_loss": 2.5, "accuracy": 1, "label": "not a number"})
    run.scalars({"eval_loss": 2.4})  # after an eval that followed the step: the same step
    # Too many for one datagram: dropped and counted, never raised into the training loop.
    run.step(loss=1.8, scalars={f"metric_{i}": 1.0 for i in range(1000)})
    assert run.dropped == 1
    run.close()
    messages = intake.drain()
    events = [m for m in messages if isinstance(m, protocol.WorkerEvent) and m.type == "scalars"]
    assert [e.data for e in events] == [{"step": 2, "values": {"eval_loss": 2.5, "accuracy": 1.0}},
                                        {"step": 2, "values": {"eval_loss": 2.4}}]
    assert sum(isinstance(m, RankStep) for m in messages) == 3


def test_injected_telemetry_with_wrong_token_is_rejected(intake: Intake) -> None:
    sender = connect(intake.path)
    forged = RankStep(rank=0, step=1, time=0.0, loss=1e9)
    sender.send(protocol.encode_step(bytes(16), forged))
    sender.send(b"garbage")
    sender.send(b"x" * (protocol.MAX_DATAGRAM + 100))
    assert intake.drain() == []
    assert intake.rejected == {"token": 1, "short": 1, "too_big": 1}


def test_socket_sits_in_a_private_directory(intake: Intake) -> None:
    assert os.stat(intake.path.parent).st_mode & 0o077 == 0


def test_full_queue_drops_instead_of_blocking(intake: Intake) -> None:
    sender = connect(intake.path)
    sender.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    run = Run(rank=0, world_size=1, directive=Directive(), sock=sender, token=TOKEN)
    for _ in range(20_000):  # nobody drains: the queue must fill and step() must not block
        run.step(loss=1.0)
    assert run.dropped > 0
    assert len(intake.drain()) + run.dropped == 20_000


def test_a_briefly_busy_supervisor_loses_nothing(intake: Intake) -> None:
    # Ten seconds of a fast job (100 steps/s) while the supervisor reads nothing.
    run = Run(rank=0, world_size=1, directive=Directive(), sock=connect(intake.path), token=TOKEN)
    for _ in range(1000):
        run.step(loss=1.0)
    assert run.dropped == 0
    assert len(intake.drain()) == 1000


def test_ranks_disconnecting_are_forgotten(intake: Intake) -> None:
    sender = connect(intake.path)
    sender.send(protocol.encode_event(TOKEN, 0, "hello", 0.0))
    assert len(intake.drain()) == 1 and intake.connections == 1
    sender.close()
    assert intake.drain() == [] and intake.connections == 0


def test_long_run_dir_falls_back_to_private_temp_socket(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    it = Intake(deep / "telemetry.sock", TOKEN).open()
    try:
        assert len(str(it.path)) < 108
        assert os.stat(it.path.parent).st_mode & 0o077 == 0
        connect(it.path).send(protocol.encode_event(TOKEN, 0, "hello", 0.0))
        assert [m.type for m in it.drain()] == ["hello"]  # type: ignore[union-attr]
    finally:
        it.close()


def test_noop_run_without_babysit(monkeypatch) -> None:
    monkeypatch.delenv(protocol.ENV_SOCKET, raising=False)
    run = attach()
    assert not run.active
    assert list(run.batches(range(3))) == [0, 1, 2]
    assert run.step(loss=float("nan")) is True
    assert run.cursor == 3 and run.step_count == 1


class Seekable:
    """A loader that can start at any global batch, like a sampler with an offset."""

    def __init__(self, n: int) -> None:
        self.n, self.start, self.seeks = n, 0, []

    def seek(self, cursor: int) -> None:
        self.start = cursor
        self.seeks.append(cursor)

    def __iter__(self):
        return iter(range(self.start, self.n))


@pytest.mark.parametrize("seekable", [True, False])
def test_batches_resume_and_skip_in_cursor_space(seekable: bool) -> None:
    from babysit.supervisor.contract.directive import Resume

    directive = Directive(resume=Resume(path="x", step=3, cursor=3),
                          skip=(SkipRange(5, 7), SkipRange(9, 10)))
    run = Run(rank=0, world_size=1, directive=directive, sock=None, token=b"")
    loader = Seekable(12) if seekable else range(12)
    assert list(run.batches(loader)) == [3, 4, 7, 8, 10, 11]
    assert run.cursor == 12
    if seekable:
        assert loader.seeks == [3, 7, 10]


def test_a_plain_loader_skips_a_range_given_in_samples_by_its_batches() -> None:
    """Without an ElasticSampler there is no stream to place samples in: the batches stand."""
    directive = Directive(skip=(SkipRange(2, 4, (16, 32)),))
    run = Run(rank=0, world_size=1, directive=directive, sock=None, token=b"")
    assert list(run.batches(range(6))) == [0, 1, 4, 5]


def test_skips_merge_by_batches_and_by_samples_and_survive_json() -> None:
    from babysit.supervisor.contract.directive import merge_skips

    merged = merge_skips([SkipRange(10, 20, (80, 160)), SkipRange(1, 3), SkipRange(2, 5),
                          SkipRange(15, 30, (120, 240)), SkipRange(25, 40),
                          SkipRange(50, 60, (400, 480)), SkipRange(55, 70, (900, 1000))])
    assert merged == (SkipRange(1, 5), SkipRange(10, 30, (80, 240)), SkipRange(25, 40),
                      SkipRange(50, 60, (400, 480)), SkipRange(55, 70, (900, 1000)))
    directive = Directive(skip=merged)
    assert Directive.from_json(json.loads(json.dumps(directive.to_json()))) == directive
    # A rank walks them by batches alone: ranges that overlap are one jump, whatever their
    # units (no batch of 25-39 is trained after the jump from 10 to 30).
    run = Run(rank=0, world_size=1, directive=directive, sock=None, token=b"")
    assert list(run.batches(range(75))) == [0, 5, 6, 7, 8, 9, *range(40, 50), *range(70, 75)]


def test_lr_scale_applies_only_inside_optimizer_step() -> None:
    torch = pytest.importorskip("torch")
    param = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([param], lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    run = Run(rank=0, world_size=1, directive=Directive(lr_scale=0.1), sock=None, token=b"",
              optimizer=opt)
    param.grad = torch.ones(1)
    opt.step()
    assert param.item() == pytest.approx(0.9)  # lr 1.0 x scale 0.1
    assert opt.param_groups[0]["lr"] == 1.0  # the scheduler never sees the scale
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.5
    run.close()
    opt.step()
    assert param.item() == pytest.approx(0.4)  # hooks removed with close()


def test_journal_evidence_may_carry_any_key(tmp_path: Path) -> None:
    from babysit.supervisor.run.journal import Journal, read

    journal = Journal(tmp_path / "events.jsonl").open()
    journal.write("digest", 1.0, 2, 7, attempt=9, time="x", loss=float("nan"))
    journal.close()
    (entry,) = read(tmp_path / "events.jsonl")
    assert entry == {"time": 1.0, "event": "digest", "attempt": 2, "step": 7,
                     "evidence_attempt": 9, "evidence_time": "x", "loss": "nan"}


def test_prior_run_reads_what_a_killed_supervisor_left() -> None:
    from babysit.supervisor.run.journal import prior_run

    assert prior_run([]) is None
    directive = {"skip": [{"start": 3, "end": 9}], "lr_scale": 0.5}
    entries = [
        {"event": "run_started", "attempt": 0},
        {"event": "launch", "attempt": 0, "pid": 100, "directive": {}},
        {"event": "worker_hello", "attempt": 0, "rank": 0, "data": {"pid": 101}},
        {"event": "worker_stream", "attempt": 0, "rank": 0, "data": {"cursor": 0}},
        {"event": "standby_started", "attempt": 0, "for_attempt": 1, "pid": 200},
        {"event": "launch", "attempt": 1, "pid": 200, "directive": directive, "standby": True},
        {"event": "worker_hello", "attempt": 1, "rank": 0, "data": {"pid": 201}},
        {"event": "worker_stream", "attempt": 1, "rank": 0, "data": {
            "cursor": 5, "samples": 40, "global_batch": 8}},
        {"event": "worker_hello", "attempt": 1, "rank": 1, "data": {"pid": "bogus"}},
        {"event": "standby_started", "attempt": 1, "for_attempt": 2, "pid": 300},
    ]
    prior = prior_run(entries)
    assert prior is not None and prior.unfinished and prior.last_attempt == 1
    # The attempt's torchrun and ranks, and the warm standby waiting to be the next attempt.
    assert prior.pids == (200, 201, 300) and prior.directive == directive
    # Where the data stream was, each attempt's report in order.
    assert prior.streams == ({"cursor": 0}, {"cursor": 5, "samples": 40, "global_batch": 8})
    finished = prior_run([*entries, {"event": "run_finished", "attempt": 1, "state": "failed"}])
    assert finished is not None and not finished.unfinished
    preempted = prior_run([*entries, {"event": "run_finished", "attempt": 1, "state": "stopped"}])
    assert preempted is not None and preempted.unfinished  # SIGTERM'd runs are resumed
    requeued = prior_run([*entries, {"event": "run_finished", "attempt": 1, "state": "failed",
                                     "exit_code": 75}])
    assert requeued is not None and requeued.unfinished  # so are requeued ones, elsewhere


def test_prior_run_finds_a_remedy_decided_but_never_launched() -> None:
    from babysit.supervisor.run.journal import prior_run

    finding = {"event": "finding", "attempt": 0, "finding": {"incident": "loss_spike"},
               "remedy": {"action": "rollback"}}
    entries = [{"event": "run_started", "attempt": 0},
               {"event": "launch", "attempt": 0, "pid": 1, "directive": {}},
               {"event": "watch_state", "attempt": 0, "state": {"lr_scale": 1.0}},
               finding, {"event": "watch_state", "attempt": 0, "state": {"lr_scale": 0.5}}]
    prior = prior_run(entries)
    assert prior is not None and prior.pending == finding  # killed between decision and launch
    assert prior.watch_state == {"lr_scale": 0.5}
    relaunched = prior_run([*entries, {"event": "launch", "attempt": 1, "pid": 2}])
    assert relaunched is not None and relaunched.pending is None  # applied once, not twice


def test_watch_state_round_trips_through_json() -> None:
    import json

    from babysit.policies.loader import load_policy
    from babysit.policies.types import Finding, Incident, Severity
    from babysit.supervisor.run.watch import Watch

    watch = Watch(load_policy("default"))
    crash = Finding(Incident.CRASH, "crash", Severity.CRITICAL, step=7, onset_step=7,
                    message="boom", evidence={"class": "user_code", "signature": "E: x",
                                              "deterministic": False})
    watch.rules.on_finding(crash, now=100.0)
    watch.classify_crash(1, {0: "ValueError: x"}, 7)  # remembered for the deterministic check
    assert len(watch.crashes) == 1
    watch.lr_scale = 0.25
    from babysit.policies.types import RankStep, StepRecord

    def record(step: int, loss: float) -> StepRecord:
        ranks = tuple(RankStep(rank=r, step=step, time=float(step), cursor=step, loss=loss,
                               step_time=0.1) for r in range(2))
        return StepRecord(step=step, time=float(step), ranks=ranks, world_size=2)

    for step in range(1, 40):  # a baseline worth keeping
        watch.observe_record(record(step, 2.0 + 0.01 * (step % 3)))
    state = json.loads(json.dumps(watch.state_dict()))
    other = Watch(load_policy("default"))
    other.load_state_dict(state)
    assert other.state_dict() == watch.state_dict()
    # The taken-over watch judges the next spike at once, exactly as the original would.
    spike = [w.observe_record(record(40, 9.0)) for w in (watch, other)]
    assert spike[0] == spike[1] and [f.incident.value for f in spike[1]] == ["loss_spike"]


def test_the_worker_packs_every_field_where_the_decoder_reads_it(intake: Intake,
                                                                  monkeypatch) -> None:
    """The worker inlines the step message for speed: each optional field it sends must come
    back as that field (a distinct value per field catches any two swapped)."""
    monkeypatch.setenv(protocol.ENV_SOCKET, str(intake.path))
    monkeypatch.setenv(protocol.ENV_TOKEN, TOKEN.hex())
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    run = attach()
    for _ in run.batches(range(2)):
        run.step(loss=1.5, grad_norm=2.5, lr=0.125, tokens=4096, samples=8)
    run.close()
    steps = [m for m in intake.drain() if isinstance(m, RankStep)]
    last = steps[-1]
    assert (last.rank, last.step, last.cursor) == (3, 2, 2)
    assert (last.loss, last.grad_norm, last.lr, last.tokens, last.samples) == \
        (1.5, 2.5, 0.125, 4096.0, 8.0)
    assert last.step_time is not None and last.data_wait is not None and not last.skipped
