"""karpathy's nanoGPT ``train.py`` loop as it is, run under babysit with the few lines a new user
adds (each marked ``# babysit``), for end-to-end tests. Seconds, not minutes.

What makes its shape hard to resume exactly, all kept:

- the next step's batch is drawn **inside the last micro-step**, right after its forward and
  before its backward (``X, Y = get_batch('train')``), so before ``optimizer.step()``; the first
  batch is drawn once before the loop, on a resume too;
- ``get_batch`` draws from torch's **global generator** (``torch.randint``), seeded per rank;
- **dropout** (0.1) draws from that same generator inside each training forward;
- gradient accumulation over DDP (``require_backward_grad_sync`` on the last micro-step only),
  a ``GradScaler`` (disabled, as nanoGPT's is outside float16: ``scaler.step`` is
  ``optimizer.step``), gradient clipping, AdamW, the LR set by hand from ``iter_num`` each
  iteration (no scheduler);
- on rank 0 only, every ``--eval-interval`` iterations, ``estimate_loss()`` at the top of the
  iteration: more draws from the global generator, in ``model.eval()`` under ``no_grad``.

The babysit lines: ``attach``, ``iter_num = run.step_count``, ``run.step()`` before
``scaler.step(optimizer)``, ``run.phase("eval")``, ``run.close()``.

    --max-iters N          nanoGPT's max_iters (it trains N + 1 iterations: 0..N)
    --at ATTEMPT:RANK:STEP:WHAT   on that attempt, in iteration STEP - 1 (the one whose
                           completion makes ``run.step_count`` STEP), right after the first
                           micro-step's ``get_batch`` (mid-step, the next batch drawn), that
                           rank strikes as ``tiny_train.py``'s ``--at`` does (``SIGKILL``,
                           ``SIGSEGV``, ``SIGSTOP``, ``hang``). Repeatable
    --digest PATH          rank 0 writes the SHA-256 of its final weights' bytes there

Each eval's losses go to babysit as scalars (``val_loss``, ``train_eval_loss``); after the loop
rank 0 reports a held-out ``eval_loss``.
"""

import argparse
import hashlib
import math
from pathlib import Path

import torch
import torch.distributed as dist
from tiny_train import strike
from torch import nn
from torch.nn import functional as F

from babysit import attach  # babysit

VOCAB, BLOCK, BATCH, EMBD = 64, 16, 4, 32
GRAD_ACCUM = 2
LEARNING_RATE, MIN_LR, WARMUP, DECAY = 1e-2, 1e-3, 5, 60


class TinyGPT(nn.Module):
    """nanoGPT's interface (``logits, loss = model(idx, targets)``) with dropout on the
    embeddings and in the block; small enough for a CPU test."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, EMBD)
        self.wpe = nn.Embedding(BLOCK, EMBD)
        self.drop = nn.Dropout(0.1)
        self.ln = nn.LayerNorm(EMBD)
        self.mlp = nn.Sequential(nn.Linear(EMBD, 4 * EMBD), nn.GELU(), nn.Linear(4 * EMBD, EMBD),
                                 nn.Dropout(0.1))
        self.head = nn.Linear(EMBD, VOCAB)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        pos = torch.arange(idx.size(1))
        x = self.drop(self.wte(idx) + self.wpe(pos))
        x = x + self.mlp(self.ln(x))
        logits = self.head(x)
        loss = None if targets is None else \
            F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))
        return logits, loss


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--max-iters", type=int, default=60)
    p.add_argument("--eval-interval", type=int, default=10)
    p.add_argument("--eval-iters", type=int, default=2)
    p.add_argument("--at", action="append", default=[], type=lambda t: t.split(":", 3))
    p.add_argument("--digest", type=Path)
    args = p.parse_args()

    dist.init_process_group("gloo")
    ddp_rank = dist.get_rank()
    master_process = ddp_rank == 0
    seed_offset = ddp_rank
    torch.manual_seed(1337 + seed_offset)

    # The data set: nanoGPT's train.bin and val.bin, the same tokens on every rank.
    tokens = torch.randint(VOCAB, (4096,), generator=torch.Generator().manual_seed(5))
    train_data, val_data = tokens[:3584], tokens[3584:]

    def get_batch(split: str) -> tuple[torch.Tensor, torch.Tensor]:
        data = train_data if split == "train" else val_data
        ix = torch.randint(len(data) - BLOCK, (BATCH,))
        x = torch.stack([data[i:i + BLOCK] for i in ix])
        y = torch.stack([data[i + 1:i + 1 + BLOCK] for i in ix])
        return x, y

    model = TinyGPT()
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.1,
                                  betas=(0.9, 0.95))
    model = nn.parallel.DistributedDataParallel(model)
    run = attach(model=model, optimizer=optimizer)  # babysit
    attempt = run.directive.attempt

    @torch.no_grad()
    def estimate_loss() -> dict[str, float]:
        out = {}
        model.eval()
        for split in ["train", "val"]:
            losses = torch.zeros(args.eval_iters)
            for k in range(args.eval_iters):
                X, Y = get_batch(split)
                _, loss = model(X, Y)
                losses[k] = loss.item()
            out[split] = losses.mean().item()
        model.train()
        return out

    def get_lr(it: int) -> float:
        if it < WARMUP:
            return LEARNING_RATE * (it + 1) / (WARMUP + 1)
        if it > DECAY:
            return MIN_LR
        ratio = (it - WARMUP) / (DECAY - WARMUP)
        return MIN_LR + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (LEARNING_RATE - MIN_LR)

    X, Y = get_batch("train")  # fetch the very first batch
    iter_num = run.step_count  # babysit
    while True:
        lr = get_lr(iter_num)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        if iter_num % args.eval_interval == 0 and master_process:
            with run.phase("eval"):  # babysit
                losses = estimate_loss()
            run.scalars({"train_eval_loss": losses["train"], "val_loss": losses["val"]})
        for micro_step in range(GRAD_ACCUM):
            model.require_backward_grad_sync = (micro_step == GRAD_ACCUM - 1)
            _logits, loss = model(X, Y)
            loss = loss / GRAD_ACCUM
            # immediately async prefetch next batch while model is doing the forward pass
            X, Y = get_batch("train")
            if micro_step == 0:
                for at_attempt, at_rank, at_step, what in args.at:
                    if (int(at_attempt), int(at_rank), int(at_step)) == \
                            (attempt, ddp_rank, iter_num + 1):
                        strike(what, ddp_rank, iter_num + 1)
            scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        run.step(loss=loss.item() * GRAD_ACCUM)  # babysit
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        iter_num += 1
        if iter_num > args.max_iters:
            break

    model.eval()
    with torch.no_grad():
        g = torch.Generator().manual_seed(7)
        ix = torch.randint(len(val_data) - BLOCK, (8,), generator=g)
        x = torch.stack([val_data[i:i + BLOCK] for i in ix])
        y = torch.stack([val_data[i + 1:i + 1 + BLOCK] for i in ix])
        _, held_out = model(x, y)
    run.scalars({"eval_loss": held_out.item()})
    if master_process and args.digest is not None:
        weights = hashlib.sha256()
        for name, tensor in sorted(model.module.state_dict().items()):
            weights.update(name.encode())
            weights.update(tensor.detach().numpy().tobytes())
        args.digest.write_text(weights.hexdigest())
    print(f"rank {ddp_rank} done at step {run.step_count}", flush=True)
    run.close()  # babysit
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
