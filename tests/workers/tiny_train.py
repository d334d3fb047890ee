"""A tiny gloo job using the worker API, for end-to-end tests. Seconds, not minutes.

Any world size works (the tests use 2 ranks): each rank takes its 4 rows of a global batch of
``4 * world_size`` rows.

Data parallel by hand by default: after each backward one all-reduce averages every rank's
gradients, which is what DDP does for this model (a replica a rank, gradients averaged before
the optimizer). ``--ddp`` wraps the model in ``DistributedDataParallel`` instead, ``--fsdp``
shards it with FSDP2. Where DDP itself is under test (the just-in-time matrix's DDP rows, the
multi-node DDP jobs) and in the benchmarks, the job is ``--ddp``; elsewhere it is by hand for
the suite's sake: DDP's constructor imports ``torch._dynamo`` at each rank's start, beyond what
the checkpoint code imports anyway, and the suite starts a few hundred ranks on 2 cores (the
cost: ``docs/measured.md#ci``).

The model has dropout and the optimizer is Adam with a StepLR schedule, so a resume is exact
only if weights, optimizer state, scheduler and every RNG stream come back. Global batch ``i``
is a pure function of ``i`` (the loader can ``seek``), so skipping batches is exact too.

Faults, at a rank and step (``run.step_count``, the steps completed) or at a data cursor:
    --crash RANK:STEP      raise just before that step's backward
    --hang RANK:STEP       sleep forever there, outside the all-reduce the other rank waits in
    --oom RANK:STEP        ask the device for 1 PiB there: a real out-of-memory error
    --corrupt RANK:STEP    silent data corruption: right after that step's optimizer update, flip
                           one mantissa bit of the first layer's first weight on that rank only,
                           as a cosmic ray in HBM would. Nothing fails or is logged; that rank's
                           parameters just differ from its peers' from then on (bit 16, a 2**-7
                           relative change: the lowest bit would be rounded away by the next
                           identical update within a step or two, so the fault would heal)
    --glitch RANK:STEP     a transient fault of the machine: right after that step's optimizer
                           update, the largest weight of the first layer on that rank grows
                           2**16-fold (an exponent bit hit). The loss spikes; a rerun of the
                           same steps from a checkpoint does not meet it (first attempt only)
    --bad-shard RANK:CURSOR  from that global batch on, that rank's shard has wrong labels (x3):
                           its loss departs from its peers' while theirs stays normal
    --every-attempt        process faults strike on every attempt (default: the first only,
                           like a machine fault a relaunch cures)
    --spike START:END      global batches START <= i < END are poisoned: a real loss spike
    --spike-rank RANK      ...only on that rank's shard (one node's rank of a multi-node job)
    --nan-at CURSOR        that global batch gives a non-finite loss
    --stuck-batch RANK:CURSOR  that rank's loader blocks forever on that global batch, in every
                           attempt: a file it deadlocks on (the data's fault, not the machine's)
    --bad-batch RANK:CURSOR  that rank's loader segfaults on that global batch, in every
                           attempt: a native decoder meeting a corrupt sample
    --raise-batch RANK:CURSOR  that rank's loader raises ValueError on that global batch, in
                           every attempt: a Python decoder meeting a corrupt sample
    --drop-batch CURSOR    the data set without that global batch (what a person's fix of a bad
                           batch trains on), for a reference run
    --global-batch G       G rows a global batch at any world size (each rank its G / world
                           size), not 4 per rank: a resize resumes on the same samples
    --elastic-data N       N fixed rows drawn by babysit's ElasticSampler, 4 a rank: a resize
                           resumes at the next sample (its global batch changes)
    --index-log DIR        with --elastic-data: each rank appends "attempt step world indices"
                           per step to DIR/<rank>
    --raise-sample I       with --elastic-data: reading sample I raises ValueError, in every
                           attempt, on whichever rank draws it (a corrupt file in the data set)
    --die-in-load ATTEMPT:RANK  that rank SIGKILLs itself inside DCP's load of the attempt's
                           resume (the others wait in its collectives): a crash while a resume
                           loads
    --reinit-after-attach  on a resume, re-initialise the model right after attach() restored
                           it: a "load pretrained" line placed after attach()
    --slow-data RANK:SEC[:START:END]  that rank waits SEC seconds for every batch (a slow
                           loader), or only for global batches START <= i < END
    --loss-every N         rank 0 prints "step S loss L" every N steps (for runs without
                           babysit's metrics: benchmarks/goodput.py under plain torchrun)
    --flood LINES          rank 0 prints LINES lines of junk every step
    --eval-every N         every N steps, report an "eval_loss" scalar with the step
    --at ATTEMPT:RANK:STEP:WHAT  on that attempt, just before that step, that rank: sends itself
                           a signal (WHAT = SIGSEGV, SIGKILL, SIGSTOP, ...), sleeps forever
                           outside the collective (``hang``), or keeps the CPU busy outside any
                           collective and any phase for SEC seconds (``busySEC``: a slow eval,
                           a GC pause, a CPU-bound loader), or (``spin``, on a GPU) launches a
                           kernel that never ends on the compute stream and waits for it, as a
                           rank inside an NCCL collective whose peer never came, or
                           (``memflip``) flips a byte of its shard in the newest memory copy
                           of its node once babysit committed that copy.
                           ``optimizer-WHAT`` strikes inside that step's ``optimizer.step()``
                           instead, half-way through its update (the first layer's weights
                           already moved). Repeatable
    TINY_TRAIN_SEGV_AT=A:S,B:T (environment) this node's local rank 0 segfaults just before
                           step S of attempt A, T of B, ...: a machine that keeps failing, set
                           per node
    TINY_TRAIN_AT=A:S:WHAT,... (environment) as --at, on this node's local rank 0: set per node
                           (which global ranks a node gets is torchrun's rendezvous's say)
    TINY_TRAIN_CORRUPT_AT=STEP (environment) as --corrupt, on this node's local rank 0: set per
                           node (which global ranks a node gets is torchrun's rendezvous's say)
    --nvrx                 also beat NVIDIA's fault-tolerance heartbeat every step (to run the
                           same job under ft_launcher: benchmarks/recovery.py)
    --step-log PATH        rank 0 appends "wall-time attempt step" per step (for benchmarks
                           that run without babysit's journal)
    --pace-file PATH       each step sleeps the seconds PATH holds, read at every step
                           (--step-sleep while it is absent): a test holds a run at a slow pace
                           until what it waits for (a scheduler's signal) has come, then lets it
                           go at full speed. Only the pace: the numbers are the same
    --hold-at STEP --hold-until PATH
                           before STEP (in every attempt), a rank waits until PATH exists, in a
                           declared phase ("held": no hang is suspected): a test holds a run
                           short of its end until what it waits for (a scheduler's warning, a
                           supervisor taking over) has come, however slow the machine. Only
                           the pace: the numbers are the same
    --after-close KIND     rank 0 then aborts (``abort``, as gloo's teardown sometimes does),
                           raises (``raise``) or blocks forever (``hang``, as gloo's teardown
                           sometimes does after a peer aborted) after the run closed cleanly
    --work-after-close S   rank 1 then computes for S seconds before it exits (a script saving
                           or uploading after ``run.close()``)
    --width W              the hidden layer's width (default 32): a state of about 216 bytes
                           a unit with Adam, so that a test can give the job a state that a
                           small /dev/shm cannot hold

On a GPU (the GPU suite): ``--device cuda`` puts the model, optimizer state and batches on
``cuda:LOCAL_RANK`` (modulo the GPUs present, so several ranks may share one GPU), and
``--backend nccl`` uses NCCL (one GPU per rank); the default stays gloo, which also reduces CUDA
tensors.
"""

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from babysit import attach


def pair(text: str) -> tuple[int, float]:
    a, b = text.split(":")
    return int(a), float(b)


def strike(what: str, rank: int, step: int, run: Any = None) -> None:
    """One ``--at`` fault, in this rank, now."""
    print(f"rank {rank}: injected {what} at step {step}", flush=True)
    if what == "memflip":
        flip_memory_copy(run, rank)
    elif what == "hang":
        time.sleep(3600)
    elif what == "spin":  # a kernel that never ends, and the host waiting for it (NCCL's stand-in)
        torch.cuda._sleep(1 << 42)
        torch.cuda.synchronize()
    elif what.startswith("busy"):
        until = time.perf_counter() + float(what[4:])
        while time.perf_counter() < until:
            sum(i * i for i in range(1000))
    else:
        os.kill(os.getpid(), getattr(signal, what))


def die_in_load(attempt: int, victim: int, rank: int) -> None:
    """On ``attempt``, rank ``victim`` dies (SIGKILL) inside DCP's load of its resume: torch's
    loader, wrapped before ``attach()`` imports it."""
    import torch.distributed.checkpoint.state_dict_loader as loader

    real = loader.load

    def load(*args: Any, **kwargs: Any) -> Any:
        directive = os.environ.get("BABYSIT_DIRECTIVE")
        told = json.loads(Path(directive).read_text()) if directive else {}
        if told.get("attempt") == attempt and rank == victim:
            print(f"rank {rank}: dies while its resume loads", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)

    loader.load = load


def flip_memory_copy(run: Any, rank: int) -> None:
    """Flip one byte of this rank's shard in the newest memory copy its node holds, once the
    supervisor committed that copy (its manifest in the checkpoint folder): host memory that
    went bad under a copy babysit trusts. Waits at most 10 s for the commit."""
    memory = Path(run.directive.memory["root"]) / "memory"
    newest = max(memory.glob("step_*"), key=lambda p: p.name)
    # step_<step>.<timeline> in shared memory; its manifest in the checkpoint folder's step_<step>
    manifest = Path(run.directive.checkpoint_dir) / newest.name.split(".")[0] / "manifest.json"
    deadline = time.monotonic() + 10
    while not manifest.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    with open(newest / f"__{rank}_0.distcp", "r+b") as f:
        f.seek(64)
        byte = f.read(1)
        f.seek(64)
        f.write(bytes([byte[0] ^ 0x10]))
    print(f"rank {rank}: flipped a byte of {newest.name} in shared memory", flush=True)


def flip_bit(param: torch.Tensor, bit: int = 16) -> None:
    """Flip mantissa bit ``bit`` of float32 ``param``'s first element, behind autograd's back."""
    param.data.view(torch.int32).view(-1)[:1].bitwise_xor_(1 << bit)


class Work(torch.nn.Module):
    """Compute inside the model's forward (``--forward-work N``: N 128x128 matrix products, a
    few ms on a CPU core), returning its input as it came: the job's results are unchanged,
    but a machine with less CPU is slower at its forward, as a slow GPU would be."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n
        self.a = torch.randn(128, 128)  # not a buffer: DDP broadcasts nothing for it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.a
        for _ in range(self.n):
            a = torch.tanh(a @ self.a)
        return x + 0.0 * a[0, 0]


class Batches:
    """Rank ``rank``'s rows of global batch ``i``, for any ``i``; ``seek`` moves the start.
    A global batch is 4 rows per rank, or ``--global-batch G`` rows at any world size (each
    rank takes its G / world size): the same samples whatever the world size."""

    def __init__(self, rank: int, world_size: int, args: argparse.Namespace) -> None:
        self.rank, self.world_size, self.args, self.start = rank, world_size, args, 0
        rows = args.global_batch or 4 * world_size
        if rows % world_size:
            raise SystemExit(f"--global-batch {rows} does not split over {world_size} ranks")
        self.rows = rows // world_size

    def seek(self, cursor: int) -> None:
        self.start = cursor

    def __iter__(self):
        position = self.start
        while True:
            # Item ``position`` is global batch ``i``: the same, unless a batch is dropped.
            drop = self.args.drop_batch
            i = position + 1 if drop is not None and position >= drop else position
            position += 1
            g = torch.Generator().manual_seed(1000 + i)
            # By default 4 rows per rank; for 2 ranks exactly the batches the tests' expected
            # values were computed with.
            rows = self.rows
            x = torch.randn(rows * self.world_size, 16,
                            generator=g)[self.rank * rows:(self.rank + 1) * rows]
            y = x.sum(dim=1, keepdim=True)
            bad = self.args.bad_shard
            if bad and bad[0] == self.rank and i >= bad[1]:
                y = y * 3.0
            if self.args.spike and self.args.spike[0] <= i < self.args.spike[1] and \
                    self.args.spike_rank in (None, self.rank):
                y = y * 40.0  # poisoned labels: the loss jumps by orders of magnitude
            if self.args.nan_at == i:
                x = x * float("nan")
            for fault in (self.args.stuck_batch, self.args.bad_batch, self.args.raise_batch):
                if fault and fault == (self.rank, i):
                    print(f"rank {self.rank}: the loader meets global batch {i}", flush=True)
                    if fault is self.args.stuck_batch:
                        threading.Event().wait()
                    if fault is self.args.raise_batch:
                        raise ValueError(f"corrupt sample in global batch {i}")
                    os.kill(os.getpid(), signal.SIGSEGV)
            slow = self.args.slow_data
            if slow and slow[0] == self.rank and (len(slow) == 2 or slow[2] <= i < slow[3]):
                time.sleep(slow[1])
            yield x, y


def elastic_batches(run, rank: int, world_size: int, args: argparse.Namespace, attempt: int):
    """``--elastic-data N``: N fixed rows drawn by babysit's ElasticSampler, 4 a rank at any
    world size; ``--index-log DIR`` writes each rank's indices per step to DIR/<rank>."""
    from torch.utils.data import DataLoader, TensorDataset

    from babysit import ElasticSampler

    g = torch.Generator().manual_seed(5)
    x = torch.randn(args.elastic_data, 16, generator=g)
    rows = TensorDataset(torch.arange(args.elastic_data), x, x.sum(dim=1, keepdim=True))

    class Data(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(rows)

        def __getitem__(self, i: int):
            if i == args.raise_sample:
                print(f"rank {rank}: the loader meets sample {i}", flush=True)
                raise ValueError(f"corrupt sample {i}")
            return rows[i]

    data = Data()
    loader = DataLoader(data, batch_sampler=ElasticSampler(args.elastic_data, 4, seed=0))
    log = None
    if args.index_log:
        Path(args.index_log).mkdir(parents=True, exist_ok=True)
        log = open(Path(args.index_log) / str(rank), "a")  # noqa: SIM115
    for index, xb, yb in run.batches(loader):
        if log is not None:
            log.write(f"{attempt} {run.step_count + 1} {world_size} "
                      f"{' '.join(map(str, index.tolist()))}\n")
            log.flush()
        yield xb, yb


def average_gradients(model: torch.nn.Module) -> None:
    """What DDP does for a replicated model, by hand: every rank's gradients averaged, in one
    all-reduce of them all flattened (DDP's one bucket, for a model this small)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    for grad, averaged in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        grad.copy_(averaged.view_as(grad))


def pace(args: argparse.Namespace) -> float:
    """This step's sleep: ``--pace-file``'s number while it holds one, else ``--step-sleep``."""
    if args.pace_file:
        try:
            return float(Path(args.pace_file).read_text())
        except (OSError, ValueError):
            pass
    return float(args.step_sleep)


def hold(run: Any, until: Path) -> None:
    """Wait until ``until`` exists (``--hold-at``), in a declared phase: a hold, not a hang."""
    if until.exists():
        return
    with run.phase("held"):
        while not until.exists():
            time.sleep(0.1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--step-sleep", type=float, default=0.02)
    p.add_argument("--crash", type=pair)
    p.add_argument("--hang", type=pair)
    p.add_argument("--oom", type=pair)
    p.add_argument("--corrupt", type=pair)
    p.add_argument("--bad-shard", type=pair)
    p.add_argument("--glitch", type=pair)
    p.add_argument("--flops-per-token", type=float, help="passed to attach() for MFU")
    p.add_argument("--peak-flops", type=float, help="passed to attach() for MFU")
    p.add_argument("--every-attempt", action="store_true")
    p.add_argument("--spike", type=pair)
    p.add_argument("--spike-rank", type=int)
    p.add_argument("--nan-at", type=int)
    p.add_argument("--stuck-batch", type=pair)
    p.add_argument("--bad-batch", type=pair)
    p.add_argument("--raise-batch", type=pair)
    p.add_argument("--drop-batch", type=int)
    p.add_argument("--global-batch", type=int)
    p.add_argument("--elastic-data", type=int, default=0)
    p.add_argument("--index-log")
    p.add_argument("--raise-sample", type=int)
    p.add_argument("--reinit-after-attach", action="store_true")
    p.add_argument("--die-in-load", type=pair)
    p.add_argument("--slow-data", type=lambda t: [float(x) if "." in x else int(x)
                                                  for x in t.split(":")])
    p.add_argument("--loss-every", type=int, default=0)
    p.add_argument("--exit-code", type=int, default=0)
    p.add_argument("--flood", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=0)
    p.add_argument("--after-close", choices=["abort", "raise", "hang"])
    p.add_argument("--work-after-close", type=float, default=0.0)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    p.add_argument("--at", action="append", default=[], type=lambda t: t.split(":", 3))
    p.add_argument("--nvrx", action="store_true")
    p.add_argument("--step-log")
    p.add_argument("--pace-file")
    p.add_argument("--hold-at", type=int, default=0)
    p.add_argument("--hold-until")
    p.add_argument("--fsdp", action="store_true", help="shard the model with FSDP2 (fully_shard)")
    p.add_argument("--ddp", action="store_true",
                   help="wrap the model in DistributedDataParallel (default: average by hand)")
    p.add_argument("--width", type=int, default=32,
                   help="the hidden layer's width")
    p.add_argument("--forward-work", type=int, default=0,
                   help="matrix products in each forward (Work): compute a CPU limit slows")
    args = p.parse_args()

    device = torch.device("cpu")
    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend)
    rank = dist.get_rank()
    if device.type == "cuda":
        print(f"rank {rank} on {device} ({torch.cuda.get_device_name(device)}), "
              f"{dist.get_backend()}", flush=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, args.width), torch.nn.ReLU(),
                                torch.nn.Dropout(0.2), torch.nn.Linear(args.width, 1)).to(device)
    layers = (model[0], model[3])
    if args.forward_work:  # first: under FSDP the others wait for it at the next all-gather
        model = torch.nn.Sequential(Work(args.forward_work), *model)
    if args.fsdp:  # FSDP2: every rank holds a shard of each layer's parameters (DTensors)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for layer in layers:
            fully_shard(layer, mesh=mesh)
        net = fully_shard(model, mesh=mesh)
    elif args.ddp:
        net = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    else:
        net = model  # data parallel by hand: average_gradients() after each backward
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.9)
    if args.die_in_load:
        die_in_load(*args.die_in_load, rank)
    run = attach(model=model, optimizer=opt, scheduler=sched,
                 flops_per_token=args.flops_per_token, peak_flops=args.peak_flops)
    if args.reinit_after_attach and run.step_count > 0:
        torch.manual_seed(1234)  # the script's own "load pretrained", over what was restored
        with torch.no_grad():
            for layer in model.modules():
                if isinstance(layer, torch.nn.Linear):
                    layer.reset_parameters()
    # Under another launcher's in-place restarts (ft_launcher) the attempt is its restart count.
    attempt = max(run.directive.attempt, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    faults_on = args.every_attempt or attempt == 0
    # A node's bad machine: its babysitter's environment says in which attempt, at which step,
    # its local rank 0 segfaults ("0:10,1:25"); set per node by a test.
    segv_at = {(int(a), int(s)) for a, _, s in (pair.partition(":") for pair in
               os.environ.get("TINY_TRAIN_SEGV_AT", "").split(",") if pair)}
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if local == 0:  # this node's fault, wherever torchrun placed its ranks
        args.at += [(a, str(rank), s, what) for a, s, what in
                    (item.split(":") for item in
                     os.environ.get("TINY_TRAIN_AT", "").split(",") if item)]
    if os.environ.get("TINY_TRAIN_CORRUPT_AT") and local == 0:
        args.corrupt = (rank, int(os.environ["TINY_TRAIN_CORRUPT_AT"]))
    heartbeat = None
    if args.nvrx:
        import nvidia_resiliency_ext.fault_tolerance as ft

        heartbeat = ft.RankMonitorClient()
        heartbeat.init_workload_monitoring()
    step_log = open(args.step_log, "a") if args.step_log and rank == 0 else None  # noqa: SIM115

    if args.elastic_data:
        source = elastic_batches(run, rank, dist.get_world_size(), args, attempt)
    else:
        source = run.batches(Batches(rank, dist.get_world_size(), args))
    in_optimizer = {(int(a), int(r), int(s)): what.removeprefix("optimizer-")
                    for a, r, s, what in args.at if what.startswith("optimizer-")}
    args.at = [at for at in args.at if not at[3].startswith("optimizer-")]

    def half_way(optimizer, *_):
        """A fault inside optimizer.step(): half the update done, then the strike."""
        what = in_optimizer.get((attempt, rank, run.step_count))
        if what is not None:
            with torch.no_grad():
                layers[0].weight.add_(0.01)
            strike(what, rank, run.step_count)

    if in_optimizer:
        opt.register_step_pre_hook(half_way)
    for x, y in source:
        if run.step_count >= args.steps:
            break
        upcoming = run.step_count + 1
        if faults_on and args.crash and args.crash == (rank, upcoming):
            raise RuntimeError(f"injected crash at step {upcoming}")
        if faults_on and args.oom and args.oom == (rank, upcoming):
            torch.empty(1 << 50, dtype=torch.uint8, device=device)
        if faults_on and args.hang and args.hang == (rank, upcoming):
            print(f"rank {rank}: injected hang at step {upcoming}", flush=True)
            time.sleep(3600)
        if (attempt, upcoming) in segv_at and local == 0:  # this node's machine
            strike("SIGSEGV", rank, upcoming)
        for at_attempt, at_rank, at_step, what in args.at:
            if (int(at_attempt), int(at_rank), int(at_step)) == (attempt, rank, upcoming):
                strike(what, rank, upcoming, run)
        if args.hold_until and upcoming == args.hold_at:
            hold(run, Path(args.hold_until))
        time.sleep(pace(args))
        if args.flood and rank == 0:
            sys.stdout.write(f"flood step {upcoming} " + "x" * 100 + "\n" * 1)
            sys.stdout.write(("y" * 120 + "\n") * (args.flood - 1))
        x, y = x.to(device), y.to(device)
        loss = torch.nn.functional.mse_loss(net(x), y)
        opt.zero_grad()
        loss.backward()
        if not (args.fsdp or args.ddp):
            average_gradients(model)
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
        scalars = None
        if args.eval_every and upcoming % args.eval_every == 0:
            with torch.no_grad():  # a held-out batch, never trained on
                ex = torch.randn(8, 16, generator=torch.Generator().manual_seed(7))
                ey = ex.sum(dim=1, keepdim=True)
                model.eval()  # no dropout: and so no draw from the training RNG stream
                scalars = {"eval_loss": torch.nn.functional.mse_loss(model(ex), ey).item()}
                model.train()
        if run.step(loss=loss.item(), grad_norm=float(gnorm), tokens=4, samples=len(x),
                    scalars=scalars):
            opt.step()
        if faults_on and args.corrupt and args.corrupt == (rank, run.step_count):
            flip_bit(layers[0].weight)
        if faults_on and args.glitch and args.glitch == (rank, run.step_count):
            with torch.no_grad():
                weights = layers[0].weight.view(-1)
                weights[weights.abs().argmax()] *= 2.0**16
        sched.step()
        if heartbeat is not None:
            heartbeat.send_heartbeat()
        if args.loss_every and rank == 0 and run.step_count % args.loss_every == 0:
            print(f"step {run.step_count} loss {loss.item():.6f}", flush=True)
        if step_log is not None:
            step_log.write(f"{time.time()} {attempt} {run.step_count}\n")
            step_log.flush()
    if heartbeat is not None:
        heartbeat.shutdown_workload_monitoring()
    print(f"rank {rank} done at step {run.step_count} pid {os.getpid()}", flush=True)
    run.close()
    dist.destroy_process_group()
    if rank == 0 and args.after_close == "abort":
        os.abort()
    if rank == 0 and args.after_close == "raise":
        raise RuntimeError("uploading the final model failed")
    if rank == 0 and args.after_close == "hang":
        threading.Event().wait()
    if rank == 1 and args.work_after_close:
        until = time.monotonic() + args.work_after_close
        while time.monotonic() < until:
            sum(i * i for i in range(10_000))
        print(f"rank 1 worked {args.work_after_close:g} s after close", flush=True)
    sys.exit(args.exit_code if rank == 0 else 0)


if __name__ == "__main__":
    main()
