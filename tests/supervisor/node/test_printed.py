"""Stdout mode's node-side state: which rank is read, when it stops, the script's checkpoint
copies (real files), and what a rollback it cannot perform becomes."""

from __future__ import annotations

import io
import os
from pathlib import Path

import torch

from babysit.policies.types import Action, Finding, Incident, RankStep, Remedy, Severity
from babysit.supervisor.config.schema import StdoutConfig
from babysit.supervisor.contract.protocol import WorkerEvent
from babysit.supervisor.node.printed import PrintedProgress
from babysit.supervisor.node.script_checkpoints import POLL_S, ScriptCheckpoints


def take(printed: PrintedProgress, messages: list = (), t: float = 0.0) -> list:
    return printed.take(list(messages), now=100.0 + t, monotonic=t, pid_of=lambda r: 4242)


def test_the_lowest_printing_rank_is_read_and_announced_once(tmp_path: Path) -> None:
    printed = PrintedProgress(StdoutConfig(), tmp_path)
    printed.line(1, "step 1 loss 2.0", now=1.0)
    printed.line(None, "step 1 loss 2.0", now=1.0)  # torchrun's own output: never progress
    printed.line(0, "I/O warning", now=1.0)
    printed.line(0, "step 1 loss 2.5", now=1.0)
    printed.line(1, "step 2 loss 1.5", now=2.0)  # rank 1 is no longer read
    printed.line(0, "step 2 loss 1.9", now=2.0)
    out = take(printed)
    hello, *steps = out
    assert isinstance(hello, WorkerEvent) and hello.type == "hello" and hello.rank == 0
    assert hello.data == {"source": "output", "world_size": 1, "format": "plain", "pid": 4242}
    assert [(s.rank, s.step, s.loss) for s in steps] == [(0, 1, 2.5), (0, 2, 1.9)]
    printed.line(0, "step 3 loss 1.7", now=3.0)
    assert [type(m).__name__ for m in take(printed)] == ["RankStep"]


def test_a_rank_that_attaches_ends_stdout_mode(tmp_path: Path) -> None:
    printed = PrintedProgress(StdoutConfig(), tmp_path)
    printed.line(0, "step 1 loss 2.5", now=1.0)
    socket_step = RankStep(rank=0, step=1, time=1.0, loss=2.5)
    hello = WorkerEvent(rank=0, type="hello", time=1.0, data={"pid": 7})
    assert take(printed, [hello, socket_step]) == [hello, socket_step]
    printed.line(0, "step 2 loss 2.4", now=2.0)
    assert take(printed) == []
    assert not printed.active


def test_progress_off_reads_nothing(tmp_path: Path) -> None:
    printed = PrintedProgress(StdoutConfig(progress="off"), tmp_path)
    printed.line(0, "iter 3: loss 2.5", now=1.0)
    assert take(printed) == []


def _remedy(action: Action) -> Remedy:
    finding = Finding(Incident.LOSS_SPIKE, "loss_spike", Severity.CRITICAL, step=30,
                      onset_step=25, message="loss 1e4 at step 30")
    return Remedy(action, finding, "ladder rung 1/4: rollback")


def test_without_checkpoint_keys_a_rollback_alerts_and_says_what_would_enable_it(
        tmp_path: Path) -> None:
    printed = PrintedProgress(StdoutConfig(), tmp_path)
    printed.line(0, "iter 3: loss 2.5", now=1.0)
    take(printed)
    assert printed.can_roll_back(_remedy(Action.ROLLBACK).finding)  # so remedy() can explain
    remedy = printed.remedy(_remedy(Action.ROLLBACK))
    assert remedy.action is Action.ALERT
    assert "stdout.checkpoint_dir" in remedy.reason and "resume_args" in remedy.reason
    assert printed.remedy(_remedy(Action.RELAUNCH)).action is Action.RELAUNCH


def _save(folder: Path, content: bytes, mtime: int) -> None:
    folder.mkdir(exist_ok=True)
    (folder / "ckpt.pt").write_bytes(content)
    os.utime(folder / "ckpt.pt", ns=(mtime, mtime))


def test_script_checkpoints_are_copied_once_still_and_put_back_before_the_onset(
        tmp_path: Path) -> None:
    folder, store = tmp_path / "out", tmp_path / "run" / "script_checkpoints"
    _save(folder, b"from an earlier run", 1)
    ckpts = ScriptCheckpoints(folder, store, keep=2)
    ckpts.start()
    t = 0.0

    def poll(step: int) -> object:
        nonlocal t
        t += POLL_S
        return ckpts.poll(t, step)

    assert poll(5) is None  # what was there before the run is not a copy of this run
    for step, content in [(10, b"a"), (20, b"b"), (30, b"c")]:
        _save(folder, content, step)
        assert poll(step) is None  # changed: wait until it holds still
        copy = poll(step + 1)
        assert copy is not None and copy.step == step  # named by the first sighting
        assert (copy.path / "ckpt.pt").read_bytes() == content
    assert [s.step for s in ckpts.snapshots()] == [20, 30]  # keep=2
    _save(folder, b"poisoned", 40)
    chosen = ckpts.restore(before=30, aside=tmp_path / "aside")
    assert chosen is not None and chosen.step == 20
    assert (folder / "ckpt.pt").read_bytes() == b"b"
    assert (tmp_path / "aside" / "ckpt.pt").read_bytes() == b"poisoned"
    assert poll(41) is None  # the restored folder is not a new save
    assert ckpts.restore(before=20, aside=tmp_path / "aside2") is None


def test_saves_the_polls_did_not_see_apart_are_one_copy_named_by_the_newest_sighting(
        tmp_path: Path) -> None:
    """On a loaded machine ``ckpt.pt`` was overwritten at 20, 30 and 40 with no poll between
    saves seeing it hold still (a CI run's babysitter: first seen at step 21, copied at 43). The
    copy holds step 40's state: named 21 it would pass for older than the onset of a spike at
    30, and a rollback would put the poisoned state back."""
    folder, store = tmp_path / "out", tmp_path / "run" / "script_checkpoints"
    ckpts = ScriptCheckpoints(folder, store, keep=3)
    ckpts.start()
    for step, content in [(20, b"20"), (30, b"30"), (40, b"40")]:
        _save(folder, content, step)
        assert ckpts.poll(step / 10 * POLL_S, step + 1) is None  # changed again: not still
    copy = ckpts.poll(5 * POLL_S, 43)
    assert copy is not None and copy.step == 41 and (copy.path / "ckpt.pt").read_bytes() == b"40"
    assert ckpts.restore(before=35, aside=tmp_path / "aside") is None
    # Stopped while still changing: named by the newest sighting too, or the newest step.
    _save(folder, b"50", 50)
    assert ckpts.poll(6 * POLL_S, 51) is None
    _save(folder, b"60", 60)
    late = ckpts.settle(62)
    assert late is not None and late.step == 62 and (late.path / "ckpt.pt").read_bytes() == b"60"


def test_a_save_no_poll_copied_yet_is_copied_once_the_workers_stopped(tmp_path: Path) -> None:
    folder, store = tmp_path / "out", tmp_path / "run" / "script_checkpoints"
    ckpts = ScriptCheckpoints(folder, store, keep=3)
    ckpts.start()
    assert ckpts.settle(5) is None  # nothing there, nothing to copy
    _save(folder, b"a", 1)
    assert ckpts.poll(POLL_S, 21) is None  # seen once at step 21; the stop comes before another
    late = ckpts.settle(25)
    assert late is not None and late.step == 21  # named by its first sighting
    assert (late.path / "ckpt.pt").read_bytes() == b"a"
    assert ckpts.settle(26) is None  # copied: settled
    _save(folder, b"b", 2)  # saved after the last look: named by the newest step, never earlier
    late = ckpts.settle(30)
    assert late is not None and late.step == 30
    chosen = ckpts.restore(before=25, aside=tmp_path / "aside")
    assert chosen is not None and chosen.step == 21 and (folder / "ckpt.pt").read_bytes() == b"a"


def test_a_torch_save_cut_short_is_never_copied_and_a_whole_one_is(tmp_path: Path) -> None:
    """torch.save writes a zip in place: a writer paused, or killed, before the archive's
    closing directory leaves a file the script cannot load. Real torch.save bytes."""
    buf = io.BytesIO()
    torch.save({"w": torch.arange(4096.0)}, buf)
    whole = buf.getvalue()
    folder, store = tmp_path / "out", tmp_path / "run" / "script_checkpoints"
    ckpts = ScriptCheckpoints(folder, store, keep=3)
    ckpts.start()
    _save(folder, whole[: len(whole) // 2], 1)  # the writer paused (or died) halfway
    assert ckpts.poll(POLL_S, 10) is None
    assert ckpts.poll(2 * POLL_S, 11) is None  # held still, but cut short: not a checkpoint
    assert ckpts.settle(12) is None  # the workers stopped with it torn: never copied
    _save(folder, whole, 2)
    assert ckpts.poll(3 * POLL_S, 20) is None
    copied = ckpts.poll(4 * POLL_S, 21)
    assert copied is not None and (copied.path / "ckpt.pt").read_bytes() == whole
    assert torch.load(copied.path / "ckpt.pt")["w"].shape == (4096,)


def test_a_rollback_with_checkpoint_keys_restores_and_resumes(tmp_path: Path) -> None:
    folder = tmp_path / "out"
    config = StdoutConfig(checkpoint_dir=str(folder), resume_args=["--init_from=resume"])
    printed = PrintedProgress(config, tmp_path / "run")
    printed.start()
    printed.line(0, "iter 10: loss 2.0", now=1.0)
    take(printed, t=0.0)
    assert not printed.can_roll_back(_remedy(Action.ROLLBACK).finding)  # no copy yet
    _save(folder, b"iter 10", 10)
    take(printed, t=1.0)
    printed.line(0, "iter 11: loss 2.0", now=2.0)
    out = take(printed, t=2.0)
    saved = [m for m in out if isinstance(m, WorkerEvent) and m.type == "checkpoint"]
    assert saved and saved[0].data["step"] == 10 and saved[0].data["source"] == "output"
    assert printed.can_roll_back(_remedy(Action.ROLLBACK).finding)  # 10 < the onset, 25
    assert printed.remedy(_remedy(Action.ROLLBACK)).action is Action.ROLLBACK
    entries = printed.restore(_remedy(Action.ROLLBACK), tmp_path / "aside")
    assert entries[0][1]["checkpoint_step"] == 10
    assert printed.resume_args == ["--init_from=resume"]
    assert printed.restore(None, tmp_path / "aside2") == [] and printed.resume_args == []
