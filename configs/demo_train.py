"""babysit's demo: a tiny byte-level transformer trained on the Python standard library's source.

    torchrun --nproc-per-node 2 configs/demo_train.py             # about a minute on 2 CPU cores
    babysit  --nproc-per-node 2 configs/demo_train.py --corrupt 300:320
    babysit  --nproc-per-node 1 configs/demo_train.py --device cuda   # one GPU per rank, NCCL

The text ships with every Python; the vocabulary is the 256 byte values, so the loss starts near
ln 256 = 5.5. Global batch ``i`` is a pure function of ``(seed, i)`` and each rank takes its slice,
so the loader can ``seek()`` to any data cursor: resuming and skipping batches are exact and free.
The faults (``--corrupt``, ``--nan-at``, ``--hang``, ``--crash``, ``--slow``) are for babysit's
tests and demos; the training loop only calls them.
"""

import argparse
import math
import os
import sys
import sysconfig
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

# Let a checkout run this file without installing babysit (harmless once it is installed).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from babysit import attach

# -- model: nanoGPT, shrunk ---------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(n_embd)
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(),
                                 nn.Linear(4 * n_embd, n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, block_size: int, n_layer: int, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(256, n_embd)
        self.pos = nn.Embedding(block_size, n_embd)
        self.blocks = nn.Sequential(*[Block(n_embd, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, 256, bias=False)
        self.head.weight = self.tok.weight  # weight tying, as in GPT-2
        for emb in (self.tok, self.pos):
            nn.init.normal_(emb.weight, std=0.02)  # N(0, 1) would start the loss near 18

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy (nats per byte) of predicting ``targets`` from ``idx``."""
        x = self.tok(idx) + self.pos(torch.arange(idx.size(1), device=idx.device))
        logits = self.head(self.ln_f(self.blocks(x)))
        return F.cross_entropy(logits.view(-1, 256), targets.reshape(-1))


# -- data: the standard library's source, indexed by the global data cursor ---------------------


def stdlib_bytes(max_bytes: int = 4 << 20) -> torch.Tensor:
    """The standard library's top-level ``*.py`` files, sorted, as one tensor of bytes."""
    text = bytearray()
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text += path.read_bytes()
        if len(text) >= max_bytes:
            break
    return torch.frombuffer(text[:max_bytes], dtype=torch.uint8)


class Batches:
    """Rank ``rank``'s shard of global batch ``i``: ``batch_size`` random windows of the text.

    ``self[i]`` depends only on ``(seed, i, rank)``; ``seek(cursor)`` makes the next ``iter()``
    yield batches ``cursor, cursor + 1, ...`` without end. Batches in ``corrupt`` (a range of
    global indices) get random targets: a data fault that only skipping those batches cures.
    From global batch ``bad_from`` on, this rank's shard has random targets: one bad shard.
    """

    def __init__(self, data: torch.Tensor, batch_size: int, block_size: int, seed: int,
                 rank: int = 0, world_size: int = 1, corrupt: range = range(0),
                 bad_from: int | None = None) -> None:
        self.data, self.batch_size, self.block_size = data, batch_size, block_size
        self.seed, self.rank, self.world_size, self.corrupt = seed, rank, world_size, corrupt
        self.bad_from = bad_from
        self.cursor = 0

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        n = len(self.data) - self.block_size - 1
        starts = torch.randint(n, (self.world_size * self.batch_size,), generator=g)
        starts = starts[self.rank * self.batch_size:(self.rank + 1) * self.batch_size]
        windows = self.data[starts[:, None] + torch.arange(self.block_size + 1)].long()
        x, y = windows[:, :-1], windows[:, 1:]
        if i in self.corrupt or (self.bad_from is not None and i >= self.bad_from):
            y = torch.randint(256, y.shape, generator=g)
        return x, y

    def seek(self, cursor: int) -> None:
        self.cursor = cursor

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        i = self.cursor
        while True:
            yield self[i]
            i += 1


# -- faults, for babysit's tests and demos -------------------------------------------------------


class Faults:
    """Failures injected at a data cursor or at a (rank, step); a step is ``run.step_count``,
    so ``--crash 1:10`` fires on rank 1 after 10 completed steps.

    Data faults (``--corrupt``, ``--nan-at``) live in the data and come back on every attempt
    until babysit skips those batches. Process faults (``--hang``, ``--crash``) strike on the
    first attempt only, like a machine fault that a relaunch cures; ``--slow`` never goes away.
    """

    def __init__(self, args: argparse.Namespace, rank: int, attempt: int) -> None:
        self.rank, self.nan_at, self.slow = rank, args.nan_at, args.slow
        self.hang = args.hang if attempt == 0 else None
        self.crash = args.crash if attempt == 0 else None

    def before_backward(self, loss: torch.Tensor, step: int, cursor: int) -> torch.Tensor:
        if cursor == self.nan_at:
            loss = loss * float("nan")
        if self.crash == (self.rank, step):
            raise RuntimeError(f"injected crash on rank {self.rank} at step {step}")
        if self.hang == (self.rank, step):
            # Outside any collective: the other ranks block in this step's all-reduce.
            print(f"rank {self.rank}: injected hang at step {step}", file=sys.stderr, flush=True)
            while True:
                time.sleep(3600)
        return loss

    def throttle(self, step_start: float) -> None:
        if self.slow and self.slow[0] == self.rank:
            time.sleep((self.slow[1] - 1) * (time.perf_counter() - step_start))


def pair_of(kind: type) -> Callable[[str], tuple]:
    """An argparse type for ``A:B``, parsed as ``(int(A), kind(B))``."""
    def pair(text: str) -> tuple:
        a, b = text.split(":")
        return int(a), kind(b)
    return pair


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=800, help="optimizer steps to train")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per rank per step")
    p.add_argument("--block-size", type=int, default=64, help="context length in bytes")
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3, help="peak LR (warmup, then cosine)")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--eval-every", type=int, default=100, help="steps between evals")
    p.add_argument("--eval-batches", type=int, default=4, help="held-out batches per rank")
    f = p.add_argument_group("faults")
    f.add_argument("--corrupt", type=pair_of(int), metavar="START:END",
                   help="global batches START <= i < END get random targets (a loss spike)")
    f.add_argument("--nan-at", type=int, metavar="CURSOR", help="NaN loss at global batch CURSOR")
    f.add_argument("--hang", type=pair_of(int), metavar="RANK:STEP", help="RANK sleeps forever")
    f.add_argument("--crash", type=pair_of(int), metavar="RANK:STEP", help="RANK raises")
    f.add_argument("--slow", type=pair_of(float), metavar="RANK:FACTOR",
                   help="RANK takes FACTOR times as long per step")
    f.add_argument("--bad-shard", type=pair_of(int), metavar="RANK:CURSOR",
                   help="from global batch CURSOR on, RANK's shard has random targets")
    p.add_argument("--peak-flops", type=float, metavar="FLOP/S",
                   help="one device's peak FLOP/s, for babysit's MFU (none: no MFU)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: one GPU per rank (LOCAL_RANK's) and NCCL; cpu: gloo")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    device = torch.device(args.device)
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if world_size > 1:
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")

    data = stdlib_bytes()
    split = int(0.9 * len(data))
    corrupt = range(*args.corrupt) if args.corrupt else range(0)
    shard = dict(rank=rank, world_size=world_size)
    bad = args.bad_shard
    train = Batches(data[:split], args.batch_size, args.block_size, args.seed, **shard,
                    corrupt=corrupt, bad_from=bad[1] if bad and bad[0] == rank else None)
    val = Batches(data[split:], args.batch_size, args.block_size, args.seed + 1, **shard)

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    raw = GPT(args.block_size, args.n_layer, args.n_embd, args.n_head).to(device)
    model = DDP(raw, device_ids=[device.index] if device.type == "cuda" else None) \
        if world_size > 1 else raw
    opt = torch.optim.AdamW(raw.parameters(), lr=args.lr, weight_decay=0.1)
    warmup = max(1, args.steps // 20)

    def lr_factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, args.steps - warmup))
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)

    @torch.no_grad()
    def evaluate() -> float:
        raw.eval()
        loss = torch.stack([raw(*(t.to(device) for t in val[i]))
                            for i in range(args.eval_batches)]).mean()
        raw.train()
        if world_size > 1:
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        return loss.item()

    params = sum(p.numel() for p in raw.parameters())
    # MFU by the 6 x parameters rule; the peak is the hardware's, so only when given.
    run = attach(model=raw, optimizer=opt, scheduler=sched, param_count=params,
                 peak_flops=args.peak_flops)
    faults = Faults(args, rank, run.directive.attempt)
    tokens = args.batch_size * args.block_size  # per rank per step
    if rank == 0:
        print(f"{params / 1e6:.2f}M params, {len(data) / 1e6:.1f} MB of text, "
              f"{world_size} rank(s), {args.steps} steps", flush=True)

    t_start = t_log = time.perf_counter()
    step_log = run.step_count
    loss_log: list[float] = []
    eval_loss = float("nan")
    for x, y in run.batches(train):
        t0 = time.perf_counter()
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = model(x, y)
        loss = faults.before_backward(loss, run.step_count, run.cursor - 1)
        loss.backward()
        gnorm = nn.utils.clip_grad_norm_(raw.parameters(), 1.0)
        loss_log.append(loss.item())
        if run.step(loss=loss_log[-1], grad_norm=float(gnorm), tokens=tokens):
            opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        faults.throttle(t0)

        step = run.step_count
        if rank == 0 and step % 20 == 0:
            now = time.perf_counter()
            tok_per_s = (step - step_log) * tokens * world_size / (now - t_log)
            recent = sum(loss_log[-20:]) / len(loss_log[-20:])
            print(f"step {step:5d} | loss {recent:.3f} | {tok_per_s:,.0f} tok/s", flush=True)
            t_log, step_log = now, step
        if step % args.eval_every == 0 or step >= args.steps:
            with run.phase("eval"):
                eval_loss = evaluate()
            if rank == 0:
                run.scalars({"eval_loss": eval_loss})  # plotted by babysit report
                print(f"step {step:5d} | eval loss {eval_loss:.3f}", flush=True)
        if step >= args.steps:
            break

    if rank == 0:
        final = sum(loss_log[-20:]) / max(1, len(loss_log[-20:]))
        print(f"done: {run.step_count} steps in {time.perf_counter() - t_start:.1f}s | "
              f"train loss {final:.3f} | eval loss {eval_loss:.3f}", flush=True)
    run.close()
    if world_size > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
