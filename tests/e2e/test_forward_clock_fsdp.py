"""A rank's own compute under FSDP2 (``fully_shard``): two real gloo ranks, rank 1 slower at
the work before a sharded layer. Rank 0 waits for it inside that layer's all-gather, so its
forward takes as long as rank 1's; the clock leaves the all-gather's wait out and tells the two
apart (``supervisor/rank/forward_clock.py``)."""

from __future__ import annotations

import contextlib
import datetime
import time

import pytest
import torch.multiprocessing as mp

from babysit.supervisor.node.launcher import free_port

pytestmark = pytest.mark.e2e

SLOW_S = 0.05
"""Rank 1's extra work per forward."""
STEPS = 6


def _rank(rank: int, port: int, out: mp.SimpleQueue) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from babysit.supervisor.rank.forward_clock import forward_clock

    class Busy(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if rank == 1:
                time.sleep(SLOW_S)
            return x

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=30))
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(Busy(), torch.nn.Linear(8, 8), torch.nn.ReLU(),
                                    torch.nn.Linear(8, 1))
        mesh = init_device_mesh("cpu", (2,))
        for layer in (model[1], model[3]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        clock = forward_clock(model)
        assert clock is not None
        walls, clocked = [], []
        for _ in range(STEPS):
            dist.barrier()
            started = time.perf_counter()
            loss = model(torch.ones(4, 8)).sum()
            walls.append(time.perf_counter() - started)
            loss.backward()
            taken = clock.take()
            assert taken is not None
            clocked.append(taken)
        out.put((rank, sorted(walls)[STEPS // 2], sorted(clocked)[STEPS // 2], None))
    except Exception as exc:  # the parent reports what went wrong
        out.put((rank, 0.0, 0.0, f"{type(exc).__name__}: {exc}"))
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def test_under_fsdp2_the_all_gather_wait_is_left_out_and_the_slow_rank_stands_out() -> None:
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(rank, port, out)) for rank in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=120)
    got = {}
    while not out.empty():
        rank, wall, clocked, error = out.get()
        assert error is None, (rank, error)
        got[rank] = (wall, clocked)
    assert sorted(got) == [0, 1], got
    (wall0, fast), (_, slow) = got[0], got[1]
    assert wall0 > SLOW_S * 0.8, got  # rank 0's forward waited for rank 1 ...
    assert fast < SLOW_S * 0.4, got  # ... and its clock left that wait out
    assert slow > SLOW_S * 0.9, got  # rank 1's own work is all there
