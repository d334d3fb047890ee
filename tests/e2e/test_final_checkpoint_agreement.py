"""The final checkpoint before a preemption: every rank saves it at the same step, even when
the ranks read the request steps apart (on several nodes, each node's control file is written
when its babysitter hears of it). Two real gloo ranks, each with a control file of its own;
rank 1's request arrives 6 steps after rank 0's. A save out of step would pair rank 0's
checkpoint collectives with rank 1's gradient all-reduce: a hang (here: gloo's timeout)."""

from __future__ import annotations

import contextlib
import datetime
import json
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from babysit.supervisor.node.launcher import free_port

pytestmark = pytest.mark.e2e

STEPS = 20
SEEN_AT = {0: 3, 1: 9}
"""The step before which each rank's control file gets the request."""


def _rank(rank: int, port: int, tmp: str, out: mp.SimpleQueue) -> None:
    import torch
    import torch.distributed as dist

    from babysit.supervisor.contract.directive import Directive
    from babysit.supervisor.rank.saving import Checkpointer

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=20))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    events: list[tuple[str, dict]] = []
    directive = Directive(attempt=0, checkpoint_dir=f"{tmp}/ckpt", checkpoint_every=1000)
    saver = Checkpointer(directive, rank, model, opt, None,
                         lambda kind, **fields: events.append((kind, fields)))
    saver.control = Path(tmp) / f"control-{rank}.json"
    try:
        for step in range(1, STEPS + 1):
            if step == SEEN_AT[rank]:
                saver.control.write_text(json.dumps({"final_checkpoint": "sigterm-1"}))
            saver.maybe_save(step - 1, step - 1, 1.0, lambda name: contextlib.nullcontext())
            loss = model(torch.ones(2, 4)).sum()
            loss.backward()
            for p in model.parameters():  # what DDP does in backward
                assert p.grad is not None
                dist.all_reduce(p.grad)
            opt.step()
            opt.zero_grad()
        out.put((rank, [f["step"] for kind, f in events if kind == "checkpoint" and f.get("final")],
                 None))
    except Exception as exc:  # the parent reports what went wrong
        out.put((rank, [], f"{type(exc).__name__}: {exc}"))
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def test_ranks_that_read_the_request_steps_apart_save_at_the_same_step(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, str(tmp_path), out)) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    results = {}
    while not out.empty():
        rank, saved, error = out.get()
        results[rank] = (saved, error)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert results.get(0, (None, None))[1] is None and results.get(1, (None, None))[1] is None, \
        results
    # Only rank 0 announces saves: one final checkpoint, once the late rank read the request
    # (at the boundary after step SEEN_AT[1] - 1).
    (saved,) = results[0][0]
    assert SEEN_AT[1] - 1 <= saved < STEPS
    assert (tmp_path / "ckpt" / f"step_{saved:08d}").is_dir()
