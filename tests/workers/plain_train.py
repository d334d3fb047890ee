"""A 2-rank gloo job that knows nothing of babysit: it must run exactly as under torchrun."""

import sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(t)
print(f"rank {dist.get_rank()} sum {t.item():.0f} args {sys.argv[1:]}", flush=True)
dist.destroy_process_group()
