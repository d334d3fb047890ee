"""What the silent-data-corruption check costs, beside the training step it rides on.

    .venv/bin/python benchmarks/sdc_cost.py [--repeats 50]

For the demo's model at a few widths (``configs/demo_train.py``'s GPT), one process, one
thread (as under torchrun with ``OMP_NUM_THREADS=1``): the median time of a full training step
(forward, backward, AdamW) on a demo batch, of ``param_digest``, of ``probe_digest``, and of
``Fingerprinter.digests()`` (both). The check runs once every ``sdc.every_steps`` steps, so its
share of training time is ``digests / (every_steps x step)``; the last column says it for
every_steps = 100. Medians, measured side by side in one run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "configs"))

from demo_train import GPT

from babysit.supervisor.rank.fingerprint import Fingerprinter, param_digest, probe_digest


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def measure(layers: int, width: int, repeats: int) -> str:
    """One table row: the demo GPT with ``layers`` blocks of ``width``."""
    torch.manual_seed(0)
    model = GPT(64, layers, width, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(256, (16, 64))
    y = torch.randint(256, (16, 64))

    def step() -> None:
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    fp = Fingerprinter(100, model)
    params = sum(q.numel() for q in model.parameters())
    step_ms = median_ms(step, repeats)
    digest_ms = median_ms(lambda: param_digest(model), repeats)
    probe_ms = median_ms(lambda: probe_digest(torch.device("cpu")), repeats)
    both_ms = median_ms(fp.digests, repeats)
    return (f"| {layers} x {width} | {params / 1e6:.2f}M | {step_ms:.1f} | {digest_ms:.2f} | "
            f"{probe_ms:.2f} | {both_ms:.2f} | {100 * both_ms / (100 * step_ms):.3f}% |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=50)
    args = p.parse_args()
    torch.set_num_threads(1)
    print("| model | params | step ms | param_digest ms | probe ms | digests() ms "
          "| share at every 100 steps |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for layers, width in ((2, 128), (4, 256), (6, 512)):
        print(measure(layers, width, args.repeats), flush=True)


if __name__ == "__main__":
    main()
