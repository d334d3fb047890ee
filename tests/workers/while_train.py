"""Training loops of the shapes written from the worker-API page without a ``for`` over
``run.batches()``, for end-to-end tests: babysit finds the point between their steps from the
optimizer's hooks (``supervisor/rank/boundary.py``), or from ``run.batches()`` drawn with
``next()``. Seconds, not minutes.

    --shape while          nanoGPT's: ``while run.step_count < steps:``, each rank's batch drawn
                           from torch's global generator at the top of the step (so a resume
                           is exact only if every rank's random streams come back as they were
                           when the step started), ``run.step()`` before ``opt.step()``
    --shape batches-next   torchtitan's, with babysit's loader: ``data_iter =
                           run.batches(loader)``, drawn with ``next(data_iter)`` inside
                           ``train_step(data_iter)``
    --shape iterator       torchtitan's, with a plain iterator of its own that the script
                           fast-forwards itself from ``run.step_count`` (one batch a step),
                           drawn with ``next()`` inside ``train_step``; the step reported after
                           ``opt.step()`` and ``sched.step()``, where torchtitan logs its metrics

The iterator shapes draw the same batches (global batch ``i`` a pure function of ``i``, 4 rows
a rank), so they compute the same numbers. Every shape: dropout, Adam, StepLR, DDP over gloo;
after the last step an evaluation on a held-out batch is reported as ``eval_loss``.

    --at ATTEMPT:RANK:STEP:WHAT   on that attempt, just before that step (before its batch is
                           drawn), that rank strikes as ``tiny_train.py``'s ``--at`` does
                           (``SIGSEGV``, ``SIGKILL``, ``SIGSTOP``, ``hang``, ...). Repeatable
    --no-optimizer         ``attach()`` gets the model but not the optimizer: in a loop without
                           ``run.batches()`` babysit cannot see where a step ends
"""

import argparse
import itertools
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
from tiny_train import strike

from babysit import attach


def batch(i: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s 4 rows of global batch ``i``."""
    g = torch.Generator().manual_seed(1000 + i)
    x = torch.randn(4 * world_size, 16, generator=g)[4 * rank:4 * (rank + 1)]
    return x, x.sum(dim=1, keepdim=True)


class Loader:
    """Global batches from 0 on, endlessly; ``seek`` moves the start (``run.batches()`` uses it
    on a resume)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size, self.start = rank, world_size, 0

    def seek(self, cursor: int) -> None:
        self.start = cursor

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for i in itertools.count(self.start):
            yield batch(i, self.rank, self.world_size)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", choices=["while", "batches-next", "iterator"], required=True)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--step-sleep", type=float, default=0.02)
    p.add_argument("--at", action="append", default=[], type=lambda t: t.split(":", 3))
    p.add_argument("--no-optimizer", action="store_true")
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(32, 1))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.99)
    torch.manual_seed(100 + rank)  # each rank's own stream: its batches (while) and dropout
    run = attach(model=model, optimizer=None if args.no_optimizer else opt, scheduler=sched)
    attempt = run.directive.attempt

    def faults() -> None:
        upcoming = run.step_count + 1
        for at_attempt, at_rank, at_step, what in args.at:
            if (int(at_attempt), int(at_rank), int(at_step)) == (attempt, rank, upcoming):
                strike(what, rank, upcoming)
        time.sleep(args.step_sleep)

    if args.shape == "while":
        while run.step_count < args.steps:
            faults()
            x = torch.randn(4, 16)
            y = x.sum(dim=1, keepdim=True)
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            loss.backward()
            if run.step(loss=loss.item()):
                opt.step()
            opt.zero_grad()
            sched.step()
    else:
        if args.shape == "batches-next":
            data_iter = run.batches(Loader(rank, world_size))
        else:  # the script's own iterator, fast-forwarded by the script
            data_iter = itertools.islice(iter(Loader(rank, world_size)), run.step_count, None)
        report_after = args.shape == "iterator"

        def train_step(data_iter: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> None:
            x, y = next(data_iter)
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            loss.backward()
            if report_after:
                opt.step()
                sched.step()
                run.step(loss=loss.item())
            else:
                if run.step(loss=loss.item()):
                    opt.step()
                sched.step()
            opt.zero_grad()

        while run.step_count < args.steps:
            faults()
            train_step(data_iter)

    model.eval()  # no dropout: no draw from the training stream
    with torch.no_grad():
        ex = torch.randn(16, 16, generator=torch.Generator().manual_seed(7))
        held_out = torch.nn.functional.mse_loss(model(ex), ex.sum(dim=1, keepdim=True))
    run.scalars({"eval_loss": held_out.item()})
    print(f"rank {rank} done at step {run.step_count}", flush=True)
    run.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
