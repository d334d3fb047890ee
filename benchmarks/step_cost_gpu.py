"""What ``run.step()`` costs a GPU training loop: reporting a CUDA loss tensor against ``.item()``.

    .venv/bin/python benchmarks/step_cost_gpu.py [--steps 300] [--n-embd 512] [--device cuda]

``step()`` turns each value into a Python float, so a CUDA tensor passed as ``loss`` makes the
host wait for the GPU at that point: a synchronisation per step, the same one ``loss.item()``
makes in the script. This measures what that costs beside a loop that never synchronises, on
the demo's GPT (``configs/demo_train.py``) with AdamW, one process, reports going to a real
intake (the supervisor's socket code) in another process:

    no report           the loop alone; it synchronises once, at the end
    step(loss=t)        the CUDA loss tensor handed to step() (float() inside synchronises)
    step(loss=t.item()) the script's own .item(), then step() with plain floats
    step(.item()) only  the same floats reported after the loop already synchronised: step()'s
                        own cost, without the wait

Prints ms per step (wall time over ``--steps`` steps, median of 5 interleaved rounds) and the
difference to the loop alone. Without CUDA it says so and exits 0 (``--device cpu`` runs the
same rows on the CPU, to check the script itself).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "configs"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from demo_train import GPT
from report_cost import TOKEN, start_drainer

from babysit.supervisor.contract import protocol
from babysit.supervisor.rank.api import Run, attach


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300, help="steps per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--n-embd", type=int, default=512)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"skipped: CUDA not available (torch {torch.__version__}); run this on a GPU "
              "machine, or pass --device cpu to check the script")
        return
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    sock, stop, received, drainer = start_drainer()
    os.environ[protocol.ENV_SOCKET] = sock
    os.environ[protocol.ENV_TOKEN] = TOKEN.hex()

    torch.manual_seed(0)
    model = GPT(args.block_size, args.n_layer, args.n_embd, max(1, args.n_embd // 64)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    run = attach(model=model, optimizer=opt)
    x = torch.randint(256, (args.batch_size, args.block_size), device=device)
    y = torch.randint(256, (args.batch_size, args.block_size), device=device)
    tokens = args.batch_size * args.block_size

    def train_step() -> torch.Tensor:
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    def report_tensor(r: Run, loss: torch.Tensor) -> None:
        r.step(loss=loss, tokens=tokens)

    def report_item(r: Run, loss: torch.Tensor) -> None:
        r.step(loss=loss.item(), tokens=tokens)

    rows: dict[str, Callable[[Run, torch.Tensor], None] | None] = {
        "no report": None,
        "step(loss=t), t on the device": report_tensor,
        "step(loss=t.item())": report_item,
    }

    def one_round(report: Callable[[Run, torch.Tensor], None] | None) -> float:
        sync()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            loss = train_step()
            if report is not None:
                report(run, loss)
        sync()
        return (time.perf_counter() - t0) / args.steps

    for _ in range(3):
        train_step()  # warm up: CUDA context, kernels, the allocator's pool
    results: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(args.rounds):
        for name, report in rows.items():
            results[name].append(one_round(report))

    # step()'s own cost once the values are host floats (the wait excluded).
    own: list[int] = []
    for _ in range(10_000):
        t0 = time.perf_counter_ns()
        run.step(loss=2.5, tokens=tokens)
        own.append(time.perf_counter_ns() - t0)

    stop.set()
    drainer.join(10)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    params = sum(q.numel() for q in model.parameters())
    print(f"{name}, torch {torch.__version__}, demo GPT {params / 1e6:.1f}M params, "
          f"batch {args.batch_size}x{args.block_size}, {args.steps} steps x {args.rounds} "
          "rounds (median)")
    base = statistics.median(results["no report"])
    print(f"{'loop':34s} {'ms/step':>9s} {'vs no report':>13s}")
    for row, times in results.items():
        median = statistics.median(times)
        print(f"{row:34s} {1e3 * median:9.3f} {1e3 * (median - base):+13.3f}")
    print(f"{'step() with host floats, alone':34s} {statistics.median(own) / 1e6:9.4f} "
          "(ms per call, no training)")
    print(f"reports received by the intake: {received.value}; dropped: {run.dropped}")


if __name__ == "__main__":
    main()
