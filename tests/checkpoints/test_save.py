"""Save and load in one process, no torchrun: the mistakes a user can make, and an async save
committed on poll. Real 2-rank jobs saving and resuming bit for bit:
``tests/e2e/test_checkpoints_torchrun.py``."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from babysit.checkpoints import CheckpointError, read_manifest, step_dir

# DCP warns when it runs without a process group; these tests do that on purpose.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def tiny(extra_layer: bool = False) -> tuple[Any, Any, Any]:
    import torch

    layers = [torch.nn.Linear(4, 4)] + ([torch.nn.Linear(4, 2)] if extra_layer else [])
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    return model, opt, sched


def test_load_names_a_missing_key(tmp_path: Path) -> None:
    from babysit.checkpoints import load, save

    model, opt, sched = tiny()
    save(tmp_path, 1, cursor=1, lr_scale=1.0, model=model, optimizer=opt, scheduler=sched)
    bigger, bigger_opt, _ = tiny(extra_layer=True)
    with pytest.raises(CheckpointError, match=r"Missing key.*1\.weight.*Build them as the saving"):
        load(step_dir(tmp_path, 1), bigger, bigger_opt)
    with pytest.raises(CheckpointError, match="saved without a scheduler"):
        save(tmp_path, 2, cursor=2, lr_scale=1.0, model=model, optimizer=opt)
        load(step_dir(tmp_path, 2), model, opt, sched)


def test_save_to_an_unwritable_root_says_where(tmp_path: Path) -> None:
    from babysit.checkpoints import save

    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")
    model, _, _ = tiny()
    with pytest.raises(CheckpointError, match=r"cannot create the checkpoint directory .*writable"):
        save(blocker / "ckpts", 3, cursor=3, lr_scale=1.0, model=model)


def test_single_process_async_save_commits_on_poll_and_round_trips(tmp_path: Path) -> None:
    import torch

    from babysit.checkpoints import load, save, wait_pending

    model, opt, sched = tiny()
    handle = save(tmp_path, 7, cursor=70, lr_scale=0.5, model=model, optimizer=opt,
                  scheduler=sched, extra={"k": 1}, async_save=True, samples=560)  # fmt: skip
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    deadline = time.monotonic() + 30
    while not handle.poll():  # what the worker API does once per step
        assert time.monotonic() < deadline
        time.sleep(0.01)
    wait_pending()
    assert handle.committed and read_manifest(handle.path).lr_scale == 0.5
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    restored = load(handle.path, model, opt, sched)
    assert (restored.step, restored.cursor, restored.lr_scale, restored.extra) == (
        7,
        70,
        0.5,
        {"k": 1},
    )
    assert restored.samples == 560 == read_manifest(handle.path).samples
    assert all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())


def test_a_dcp_failure_gathered_from_the_ranks_is_said_in_one_line() -> None:
    """DCP raises one ``CheckpointException`` on every rank with every rank's traceback in its
    text; the save's error (journaled, and the title of its alert) names each error once with
    the ranks it struck. The real disk-full run: ``tests/e2e/test_storage.py``."""
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    from babysit.checkpoints.save import _said

    def raised(error: BaseException) -> BaseException:
        try:
            raise error
        except BaseException as e:  # with its traceback, as DCP wraps it
            return e

    full = raised(OSError(28, "No space left on device"))
    gathered = CheckpointException("write failed", {0: _wrap_exception(full),
                                                    1: _wrap_exception(full)})
    assert "Traceback" in str(gathered)
    assert _said(gathered) == "OSError: [Errno 28] No space left on device (on ranks 0 and 1)"
    assert _said(ValueError("bad")) == "ValueError: bad"


def test_given_random_streams_are_saved_instead_of_the_current_ones(tmp_path: Path) -> None:
    """A loop without ``run.batches()`` has drawn its next batch by the time the ranks save:
    the streams taken at the step's end are the ones a resume must restore."""
    import random

    import torch

    from babysit.checkpoints import load, save
    from babysit.checkpoints.rng import capture_rng

    model, opt, sched = tiny()
    torch.manual_seed(3)
    random.seed(3)
    at_the_end = capture_rng()
    expected = (torch.rand(4), random.random())  # the next step's draws
    save(tmp_path, 5, cursor=5, lr_scale=1.0, model=model, optimizer=opt, scheduler=sched,
         rng=at_the_end)
    load(step_dir(tmp_path, 5), model, opt, sched)
    assert torch.equal(torch.rand(4), expected[0]) and random.random() == expected[1]
