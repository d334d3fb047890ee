"""A nanoGPT-shaped gloo job that knows nothing of babysit: it only prints, and saves its own
checkpoints. For stdout mode's end-to-end tests.

Like nanoGPT's ``train.py``: only rank 0 prints ``iter N: loss X, time Yms, mfu Z%``; rank 0
saves ``out_dir/ckpt.pt`` (overwritten in place) at every ``save_every``-th iteration, before
training it; ``--init_from=resume`` continues from there; and the data stream restarts with the
process (nanoGPT re-seeds its sampler with the same seed on resume), so a resumed run draws
stream positions 0, 1, 2... again from its resumed iteration on.

    --poison START:END   stream positions START <= p < END carry poisoned labels (a loss spike)
    --sleep S            seconds per iteration beyond the compute (so a save holds still)
    --die_at N           rank 0 SIGKILLs itself at iteration N (a fresh start only: a machine
                         fault a relaunch cures)
    --forget_weights     on a resume, the iteration and optimizer come back but the model is
                         re-initialised: a "load pretrained" line after the restore
"""

import argparse
import os
import time

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--init_from", default="scratch", choices=["scratch", "resume"])
parser.add_argument("--out_dir", default="out")
parser.add_argument("--max_iters", type=int, default=40)
parser.add_argument("--save_every", type=int, default=10)
parser.add_argument("--poison", default=None)
parser.add_argument("--sleep", type=float, default=0.05)
parser.add_argument("--die_at", type=int, default=None)
parser.add_argument("--forget_weights", action="store_true")
args = parser.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(1337)
model = torch.nn.Linear(16, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
iter_num = 0
ckpt_path = os.path.join(args.out_dir, "ckpt.pt")
if args.init_from == "resume":
    checkpoint = torch.load(ckpt_path)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    iter_num = checkpoint["iter_num"]
    if args.forget_weights:
        torch.manual_seed(7)
        model = torch.nn.Linear(16, 1)  # the restored weights lost; the optimizer's still there
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    if rank == 0:
        print(f"resuming from iteration {iter_num}", flush=True)
poison = tuple(int(v) for v in args.poison.split(":")) if args.poison else None

position = 0
while iter_num < args.max_iters:
    if iter_num > 0 and iter_num % args.save_every == 0 and rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "iter_num": iter_num}, ckpt_path)
        print(f"saving checkpoint to {args.out_dir}", flush=True)
    if args.die_at == iter_num and args.init_from == "scratch" and rank == 0:
        os.kill(os.getpid(), 9)
    t0 = time.time()
    g = torch.Generator().manual_seed(position * world + rank)
    x = torch.randn(8, 16, generator=g)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(8, 1, generator=g)
    if poison and poison[0] <= position < poison[1]:
        y = y * 40.0
    position += 1
    loss = torch.nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    for p in model.parameters():
        assert p.grad is not None
        dist.all_reduce(p.grad)
        p.grad /= world
    optimizer.step()
    reduced = loss.detach().clone()
    dist.all_reduce(reduced)
    if rank == 0:
        dt = time.time() - t0
        print(f"iter {iter_num}: loss {reduced.item() / world:.4f}, time {dt * 1000:.2f}ms, "
              f"mfu -100.00%", flush=True)
    iter_num += 1
    time.sleep(args.sleep)
dist.destroy_process_group()
