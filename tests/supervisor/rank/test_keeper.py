"""A rank's keeper of its last completed step (``rank/keeper.py``), in one process: when its
state is still the mark's, its socket and token, the part it writes and how it loads back, and
a forked child (a DataLoader worker) that dies by SIGTERM as it would have. The keeper meeting a
real fault in real torchrun jobs is ``tests/e2e/test_just_in_time.py``'s."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from babysit.checkpoints import just_in_time, load
from babysit.checkpoints.manifest import FileEntry
from babysit.supervisor.contract import keeper as contract
from babysit.supervisor.rank.keeper import Keeper

TOKEN = "ab" * 16


@pytest.fixture
def trained(tmp_path: Path) -> Iterator[tuple[Keeper, torch.nn.Module, Any, Any]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    events: list[tuple[str, dict[str, Any]]] = []
    keeper = Keeper(rank=0, attempt=7, token_hex=TOKEN, marks=tmp_path / "marks", hold_s=5.0,
                    model=model, optimizer=opt, scheduler=sched,
                    emit=lambda kind, **data: events.append((kind, data)))
    keeper.start()
    yield keeper, model, opt, sched
    keeper.close()


def train_step(model: torch.nn.Module, opt: Any, sched: Any) -> None:
    loss = model(torch.randn(3, 4)).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()


def test_the_state_is_the_marks_until_the_optimizer_or_the_scheduler_moves(trained: Any) -> None:
    keeper, model, opt, sched = trained
    assert keeper.view()["why"] == "no step started in this attempt"
    train_step(model, opt, sched)
    keeper.mark(1, 1, None, 1.0)
    view = keeper.view()
    assert view["consistent"] and (view["step"], view["cursor"], view["shards"]) == (1, 1, 1)
    model(torch.randn(3, 4)).sum().backward()  # the next step's forward and backward: fine
    assert keeper.view()["consistent"]
    keeper._entering()  # inside optimizer.step(), as its pre-hook says
    assert "inside optimizer.step()" in keeper.view()["why"]
    opt.step()  # the real hooks: it left, and the state is the next step's now
    assert "optimizer.step() ran since" in keeper.view()["why"]
    keeper.mark(2, 2, None, 1.0)
    assert keeper.view()["consistent"]
    sched.step()
    assert "the scheduler stepped" in keeper.view()["why"]


def test_it_answers_on_its_socket_with_the_token_only(trained: Any) -> None:
    keeper = trained[0]
    keeper.mark(0, 0, None, 1.0)
    address = contract.address(TOKEN, 7, 0)
    view = contract.ask(address, TOKEN, contract.STATE, timeout=5.0)
    assert view["consistent"] and view["pid"] == os.getpid()
    with pytest.raises(contract.Unanswered, match="403"):
        contract.ask(address, "cd" * 16, contract.STATE, timeout=5.0)
    with pytest.raises(contract.Unanswered):
        contract.ask(contract.address(TOKEN, 8, 0), TOKEN, contract.STATE, timeout=1.0)


def test_its_part_written_and_committed_loads_back_as_the_marks_state(
        trained: Any, tmp_path: Path) -> None:
    keeper, model, opt, sched = trained
    for step in (1, 2, 3):
        train_step(model, opt, sched)
        keeper.mark(step, step + 10, None, 0.5)
    root = tmp_path / "ckpt"
    plan = just_in_time.Plan(3, 13, None, 0.5, writers=(0,))
    stage = just_in_time.staging_dir(root, 3)
    answer = contract.ask(contract.address(TOKEN, 7, 0), TOKEN, contract.WRITE,
                          {"dir": str(stage), "step": 3, "model": True}, timeout=30.0)
    assert answer["ok"], answer
    refused = keeper.write(str(stage), 2, True)
    assert not refused["ok"] and "of step 3, not 2" in refused["why"]
    files = [FileEntry(f["name"], f["size"], f["crc32"]) for f in answer["files"]]
    assert {"__0_0.distcp", "__0.metadata", "rank_00000.pt"} <= {f.name for f in files}
    path = just_in_time.commit(root, plan, files, world_size=1, fault="hang")

    torch.manual_seed(123)
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.1)
    fresh_sched = torch.optim.lr_scheduler.StepLR(fresh_opt, step_size=1, gamma=0.5)
    with pytest.warns(UserWarning, match="load in a single process"):  # no process group here
        restored = load(path, fresh, fresh_opt, fresh_sched)
    assert (restored.step, restored.cursor, restored.lr_scale) == (3, 13, 0.5)
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)
    assert fresh_sched.last_epoch == sched.last_epoch
    assert fresh_opt.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]


def test_a_forked_child_dies_by_sigterm_at_once(trained: Any) -> None:
    """A DataLoader worker the rank forks inherits the keeper's SIGTERM handler; it must die
    as it would have without babysit, not hold on for the node."""
    pid = os.fork()
    if pid == 0:  # the child: wait to be told to end
        time.sleep(30)
        os._exit(0)
    time.sleep(0.3)
    started = time.monotonic()
    os.kill(pid, signal.SIGTERM)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM
    assert time.monotonic() - started < 2.0


def test_a_mark_holds_until_a_stream_moves_or_a_forward_moves_the_buffers(
        tmp_path: Path) -> None:
    """The top of ``run.batches()`` marks again only where the step's end's mark no longer
    holds what a mark would record there: a draw, or a forward of a model with BatchNorm (an
    eval in the loop's tail) since."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
    keeper = Keeper(rank=0, attempt=7, token_hex=TOKEN, marks=tmp_path / "marks", hold_s=5.0,
                    model=model, optimizer=None, scheduler=None, emit=lambda kind, **data: None)
    keeper.start()
    try:
        keeper.mark(3, 3, None, 1.0, settled=False)
        assert keeper.holds(3, 3, None, 1.0)
        assert not keeper.holds(3, 4, None, 1.0) and not keeper.holds(3, 3, None, 0.5)
        torch.rand(1)
        assert not keeper.holds(3, 3, None, 1.0)
        keeper.mark(3, 3, None, 1.0)
        model.eval()
        with torch.no_grad():
            model(torch.randn(2, 4, generator=torch.Generator().manual_seed(1)))
        assert not keeper.holds(3, 3, None, 1.0)
    finally:
        keeper.close()


HOLDS_THROUGH_SIGTERM = """
import json, signal, sys
import torch
from pathlib import Path
from babysit.supervisor.rank.keeper import Keeper

signal.signal(signal.SIGTERM, lambda *a: None)  # a framework's own handler (Lightning's)
model = torch.nn.Linear(2, 1)
keeper = Keeper(rank=0, attempt=3, token_hex=sys.argv[1], marks=Path(sys.argv[2]), hold_s=60.0,
                model=model, optimizer=None, scheduler=None,
                emit=lambda kind, **data: print(json.dumps([kind, data]), flush=True))
keeper.start()
keeper.mark(1, 1, None, 1.0)
signal.signal(signal.SIGTERM, signal.SIG_DFL)  # its teardown puts the default back
raise RuntimeError("Connection reset by peer")
"""


def test_a_rank_whose_framework_took_its_sigterm_handler_down_holds_on_through_sigterm(
        tmp_path: Path) -> None:
    """Lightning handles SIGTERM itself while it fits, and its teardown at an exception puts the
    default action back: the keeper takes SIGTERM at the exception, so the SIGTERM torchrun
    sends the survivors of a crash waits until the node released the rank, which then ends by
    it as it would have."""
    import subprocess
    import sys

    from tests.conftest import babysit_env

    proc = subprocess.Popen([sys.executable, "-c", HOLDS_THROUGH_SIGTERM, TOKEN,
                             str(tmp_path / "marks")], env=babysit_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith('["holding"'), (line, proc.stderr.read() if proc.stderr else "")
        proc.send_signal(signal.SIGTERM)
        address = contract.address(TOKEN, 3, 0)
        view = contract.ask(address, TOKEN, contract.STATE, timeout=10)  # still there
        assert view["step"] == 1 and view["consistent"]
        contract.ask(address, TOKEN, contract.RELEASE, timeout=10)
        assert proc.wait(timeout=30) == -signal.SIGTERM
    finally:
        proc.kill()
        proc.wait()
