"""A tiny Lightning job (a linear regression, 2 gloo ranks on CPU) for the integration test.
With ``--babysit`` it fits through ``lightning_fit(trainer, model)``; without, ``trainer.fit``.

Global batch ``i`` is a pure function of ``i``; each rank takes its half. The loader is
resumable (Lightning's ``state_dict``/``load_state_dict``), so a mid-epoch checkpoint resumes
at the right batch. ``--poison A:B`` multiplies the labels of global batches ``A <= i < B`` by
40: a loss spike. ``--at ATTEMPT:RANK:STEP:WHAT`` (repeatable): on that attempt, just before
that optimizer step (``on_train_batch_start``), that rank sends itself the signal ``WHAT``
(``SIGKILL``, ``SIGSEGV``...).
"""

import argparse
import json
import os
import signal
import time
from pathlib import Path

import lightning.pytorch as pl
import torch

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--steps", type=int, default=70)
parser.add_argument("--poison", default=None)
parser.add_argument("--babysit", action="store_true")
parser.add_argument("--at", action="append", default=[])
args = parser.parse_args()
poison = tuple(int(v) for v in args.poison.split(":")) if args.poison else None
rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


class Batches:
    """This rank's rows of global batches 0, 1, 2, ...; remembers where it is."""

    def __init__(self, total: int) -> None:
        self.total, self.next = total, 0

    def __len__(self) -> int:
        return self.total

    def __iter__(self):
        while self.next < self.total:
            i = self.next
            self.next += 1
            g = torch.Generator().manual_seed(1000 + i)
            x = torch.randn(4 * world, 16, generator=g)[rank * 4:(rank + 1) * 4]
            y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(4, 1, generator=g)
            if poison and poison[0] <= i < poison[1]:
                y = y * 40.0
            yield x, y
        self.next = 0

    def state_dict(self) -> dict:
        return {"next": self.next}

    def load_state_dict(self, state: dict) -> None:
        self.next = int(state["next"])


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(16, 1)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.losses.append(float(loss))
        time.sleep(0.02)  # a step takes a moment, so babysit acts while the job still runs
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        return Batches(args.steps + 30)  # room for the batches a rollback skips


class Faults(pl.Callback):
    """``--at``: this rank's faults of this attempt, by step (babysit's directive says which
    attempt this is: read once training runs, as a warm standby's is written at promotion)."""

    def on_train_start(self, trainer, pl_module) -> None:
        directive = os.environ.get("BABYSIT_DIRECTIVE")
        attempt = json.loads(Path(directive).read_text())["attempt"] if directive else 0
        self.at = {int(s): what for a, r, s, what in (f.split(":") for f in args.at)
                   if int(a) == attempt and int(r) == rank}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        what = self.at.get(trainer.global_step + 1)
        if what is not None:
            print(f"rank {rank}: injected {what} at step {trainer.global_step + 1}", flush=True)
            os.kill(os.getpid(), getattr(signal, what))


torch.manual_seed(0)
model = Regression()
trainer = pl.Trainer(
    accelerator="cpu", devices=world, strategy="ddp" if world > 1 else "auto",
    max_steps=args.steps, max_epochs=1, use_distributed_sampler=False, logger=False,
    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    default_root_dir=args.out, callbacks=[Faults()] if args.at else [])
if args.babysit:
    from babysit.integrations import lightning_fit

    lightning_fit(trainer, model)
else:
    trainer.fit(model)
if rank == 0:
    print("FINAL " + json.dumps({"loss": sum(model.losses[-5:]) / 5,
                                 "step": trainer.global_step}), flush=True)
