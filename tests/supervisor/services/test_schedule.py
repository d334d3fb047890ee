"""The background jobs on a real apscheduler at sub-second intervals, sampling real child
processes and deleting real checkpoints; the digest text exhaustively as a pure function."""

from __future__ import annotations

import contextlib
import math
import os
import queue
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from babysit.checkpoints import Catalog, step_dir
from babysit.checkpoints.layout import rank_state_name
from babysit.checkpoints.save import commit, hash_part
from babysit.supervisor.services.health import HealthConfig, HealthKind, HealthWarning
from babysit.supervisor.services.schedule import (
    Digest,
    DigestSnapshot,
    HealthReport,
    JobFailed,
    Jobs,
    Message,
    RetentionDone,
    ScheduleConfig,
    digest,
)

FAST = 0.2  # seconds between runs of every job under test
OFF = ScheduleConfig(health_every_s=None, digest_every_s=None, retention_every_s=None)


def collect(outbox: queue.Queue[Message], until: Callable[[list[Message]], bool],
            timeout: float = 3.0) -> list[Message]:
    """Drain the outbox like the control loop does, until ``until(messages)`` or the timeout."""
    got: list[Message] = []
    deadline = time.monotonic() + timeout
    while not until(got) and time.monotonic() < deadline:
        with contextlib.suppress(queue.Empty):
            got.append(outbox.get(timeout=0.05))
    return got


def of(kind: type[Message], messages: list[Message]) -> list[Message]:
    return [m for m in messages if isinstance(m, kind)]


class Loop:
    """The loop's side of the contract: immutable snapshots swapped in whole."""

    def __init__(self) -> None:
        self.snap = DigestSnapshot("running", attempt=0, step=0)
        self.pids: tuple[int, ...] = ()


@pytest.fixture
def jobs_factory(tmp_path: Path) -> Iterator[Callable[..., tuple[Jobs, queue.Queue[Message]]]]:
    started: list[Jobs] = []

    def make(config: ScheduleConfig, loop: Loop, outbox_size: int = 0,
             **kw: object) -> tuple[Jobs, queue.Queue[Message]]:
        outbox: queue.Queue[Message] = queue.Queue(maxsize=outbox_size)
        kw.setdefault("snapshot", lambda: loop.snap)
        jobs = Jobs(config, outbox, pids=lambda: loop.pids, checkpoint_dir=tmp_path / "ckpt",
                    **kw)  # type: ignore[arg-type]
        jobs.start()
        started.append(jobs)
        return jobs, outbox

    yield make
    for jobs in started:
        jobs.shutdown()


@pytest.fixture
def sleepers() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs = [subprocess.Popen(["sleep", "30"]) for _ in range(2)]
    yield procs
    for p in procs:
        p.kill()
        p.wait()


def test_health_reports_sample_the_workers_and_warn_once(
        jobs_factory: Callable[..., tuple[Jobs, queue.Queue[Message]]],
        sleepers: list[subprocess.Popen[bytes]]) -> None:
    loop = Loop()
    loop.pids = tuple(p.pid for p in sleepers)
    t0 = time.monotonic()
    every = 0.5  # long enough that a first report well before it can only come from the start
    _, outbox = jobs_factory(OFF.model_copy(update={"health_every_s": every}), loop,
                             health=HealthConfig(min_free_disk_gib=1e9))  # every disk is "low"
    first = collect(outbox, lambda got: len(got) >= 1)
    assert time.monotonic() - t0 < every
    sleepers[0].kill()
    sleepers[0].wait()
    reports = first + collect(outbox, lambda got: len(got) >= 2)
    assert all(isinstance(r, HealthReport) for r in reports)
    health = [r for r in reports if isinstance(r, HealthReport)]
    assert {w.pid for w in health[0].sample.workers} == set(loop.pids)
    assert {w.pid for w in health[-1].sample.workers} == {sleepers[1].pid}
    assert [w.kind for r in health for w in r.warnings] == [HealthKind.DISK_LOW]


def test_digest_reports_progress_and_interventions_since_the_last_one(
        jobs_factory: Callable[..., tuple[Jobs, queue.Queue[Message]]]) -> None:
    loop = Loop()
    loop.snap = DigestSnapshot("running", attempt=1, step=100, loss=2.5, steps_per_second=4.0,
                               interventions=2, last_incident="loss_spike@90")
    _, outbox = jobs_factory(OFF.model_copy(update={"digest_every_s": FAST}), loop)
    (d1,) = collect(outbox, lambda got: len(got) >= 1)
    loop.snap = DigestSnapshot("running", attempt=1, step=150, loss=2.4, steps_per_second=5.0,
                               interventions=5, last_incident="hang@140")
    (d2,) = collect(outbox, lambda got: len(got) >= 1)
    assert isinstance(d1, Digest) and isinstance(d2, Digest)
    assert d1.fields["interventions_since"] == 2 and d1.fields["steps_since"] is None
    assert d2.fields["interventions_since"] == 3 and d2.fields["steps_since"] == 50
    assert "step 150 (+50)" in d2.text and "3 intervention(s) (last: hang@140)" in d2.text
    assert 0.1 < d2.fields["period_s"] < 1.0


def make_ckpt(root: Path, step: int) -> None:
    """A committed checkpoint through the real commit path (two ranks' parts, a manifest)."""
    path = step_dir(root, step)
    path.mkdir(parents=True)
    for rank in range(2):
        (path / rank_state_name(rank)).write_bytes(os.urandom(100))
    commit(path, [hash_part(path, r) for r in range(2)],
           {"step": step, "cursor": step, "lr_scale": 1.0, "world_size": 2})


def test_retention_deletes_old_checkpoints_through_the_catalog(
        tmp_path: Path, jobs_factory: Callable[..., tuple[Jobs, queue.Queue[Message]]]) -> None:
    root = tmp_path / "ckpt"
    for step in (10, 20, 30, 40):
        make_ckpt(root, step)
    catalog = Catalog(root)
    _, outbox = jobs_factory(OFF.model_copy(update={"retention_every_s": FAST}), Loop(),
                             retain=lambda: catalog.retain(keep_last=2))
    got = collect(outbox, lambda got: len(got) >= 1)
    assert got == [RetentionDone((step_dir(root, 10), step_dir(root, 20)))]
    # Nothing more to delete: no further messages.
    assert collect(outbox, lambda got: False, timeout=2.5 * FAST) == []
    assert [c.step for c in catalog.checkpoints()] == [30, 40]


def test_a_failing_job_is_reported_once_and_the_others_keep_running(
        jobs_factory: Callable[..., tuple[Jobs, queue.Queue[Message]]]) -> None:
    loop = Loop()
    broken = True

    def snapshot() -> DigestSnapshot:
        if broken:
            raise RuntimeError("snapshot exploded")
        return loop.snap

    config = OFF.model_copy(update={"health_every_s": FAST / 2, "digest_every_s": FAST / 2})
    _, outbox = jobs_factory(config, loop, snapshot=snapshot)
    got = collect(outbox, lambda got: len(of(HealthReport, got)) >= 6)
    (failure,) = of(JobFailed, got)  # failed ~5 times, reported once
    assert isinstance(failure, JobFailed)
    assert failure.job == "digest" and failure.error == "RuntimeError: snapshot exploded"
    assert "snapshot exploded" in failure.traceback
    broken = False
    assert of(Digest, collect(outbox, lambda got: bool(of(Digest, got))))
    broken = True  # a new streak of failures is news again
    assert of(JobFailed, collect(outbox, lambda got: bool(of(JobFailed, got))))


def test_a_full_outbox_drops_and_counts_and_never_blocks_a_job(
        jobs_factory: Callable[..., tuple[Jobs, queue.Queue[Message]]]) -> None:
    jobs, outbox = jobs_factory(OFF.model_copy(update={"health_every_s": FAST / 4}), Loop(),
                                outbox_size=1)
    deadline = time.monotonic() + 3
    while jobs.dropped < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert jobs.dropped >= 2 and outbox.qsize() == 1


def test_shutdown_is_clean_and_leaves_no_thread(tmp_path: Path) -> None:
    before = set(threading.enumerate())
    outbox: queue.Queue[Message] = queue.Queue()
    all_on = ScheduleConfig(health_every_s=FAST, digest_every_s=FAST, retention_every_s=FAST)
    jobs = Jobs(all_on, outbox, pids=lambda: [os.getpid()], checkpoint_dir=tmp_path,
                snapshot=lambda: DigestSnapshot("running", 0), retain=lambda: [])
    jobs.start()
    collect(outbox, lambda got: bool(of(Digest, got)))
    assert set(threading.enumerate()) - before  # it did run on threads of its own
    jobs.shutdown()
    jobs.shutdown()  # idempotent
    assert set(threading.enumerate()) - before == set()
    size = outbox.qsize()
    time.sleep(2 * FAST)
    assert outbox.qsize() == size  # and nothing runs any more


# -- the digest text (pure) ------------------------------------------------------------------------


def test_first_digest_counts_from_the_start() -> None:
    d = digest(DigestSnapshot("running", 0, step=1200, loss=2.31456, steps_per_second=4.2,
                              tokens_per_second=86_000, interventions=1,
                              last_incident="loss_spike@1100"), None, 1800)
    assert d.text == ("babysit digest, last 30 min: running, attempt 0, step 1,200, loss 2.315, "
                      "4.20 steps/s, 86,000 tokens/s, 1 intervention(s) (last: loss_spike@1100), "
                      "health: ok")
    assert d.fields["interventions_since"] == 1 and d.fields["steps_since"] is None


def test_digest_after_a_relaunch_and_with_health_warnings() -> None:
    before = DigestSnapshot("running", 1, step=900, interventions=4)
    now = DigestSnapshot("relaunching", 2, step=400, loss=math.nan, interventions=4)
    warning = HealthWarning(HealthKind.DISK_LOW, "/ckpt", "low")
    d = digest(now, before, 90, [warning, warning])
    # Steps restart with a rollback: a difference across attempts would be meaningless.
    assert d.text == ("babysit digest, last 90 s: relaunching, attempt 2, step 400, loss nan, "
                      "0 intervention(s), health: disk_low")
    assert d.fields["steps_since"] is None and d.fields["health_warnings"] == ["disk_low"]


def test_digest_before_any_step() -> None:
    d = digest(DigestSnapshot("starting", 0), None, 3 * 3600)
    assert d.text == ("babysit digest, last 3.0 h: starting, attempt 0, 0 intervention(s), "
                      "health: ok")


def test_digest_says_the_goodput_so_far() -> None:
    d = digest(DigestSnapshot("running", 1, step=50, goodput=0.912), None, 600)
    assert "goodput 91.2%" in d.text and d.fields["goodput"] == 0.912
