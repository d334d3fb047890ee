"""Hang -> first step of the next attempt: babysit's default policy beside NVIDIA's ft_launcher.

    .venv/bin/python benchmarks/recovery.py [--repeats 3] [--cold] [--no-ahead] [--imports]
                                            [--no-nvrx]
                                            [--nvrx-venv PATH] [--device cuda]
                                            [--hang-step 20 300] [--ranks 2 16]

The same job both ways: ``tests/workers/tiny_train.py``, 2 gloo ranks on this CPU, 0.05 s steps,
rank 1 sleeping forever at step 300 of the first attempt (some 15 s in), outside the all-reduce
rank 0 then waits in. Rank 0 logs the wall time of every step it finishes (``--step-log``), and
the figure is the same for both: the last step of the first attempt -> the first step of the
next one.

- babysit: ``babysit run`` with the *default* policy (no hand-set floor): the stall is
  suspected after max(2 s, 5 x p99 step time), confirmed from the ranks' stacks, process state
  and CPU, then the attempt is stopped and relaunched from the newest checkpoint (every 10
  steps), by promoting the warm standby (``launch.warm_standby``, on by default: started 5 s
  after the first step, waiting in ``attach()``). The journal splits the time: suspicion,
  confirmation, stop, relaunch -> every rank attached (the checkpoint restored) -> first step.
  ``--cold`` also runs babysit with ``warm_standby: false`` (torchrun started ahead,
  ``launch.torchrun_ahead``: the default), a column of its own, ``--no-ahead`` with
  ``warm_standby: false`` and ``torchrun_ahead: false`` (torchrun started anew), and
  ``--imports`` with ``warm_standby: imports`` (the standby waits before the script, with torch
  imported: what ``auto`` picks on GPUs).
- NVRx: ``ft_launcher`` from ``nvidia-resiliency-ext==0.4.1`` with a hand-set 5 s rank
  heartbeat timeout (each rank beats once per step: ``--nvrx``), tuned as a user who cares
  about recovery would (``--ft-param-workload_check_interval 1 --monitor-interval 0.3``;
  defaults 5 s and 5 s), restarting the workers in
  place (``--max-restarts 3``), from step 0 (the job keeps no checkpoint of its own there;
  reloading this model's checkpoint takes milliseconds). Installed by this script into its own
  virtual environment (``pip install torch==2.13.0 nvidia-resiliency-ext==0.4.1``), reused when
  it is already there.

``--device cuda`` puts the model on the GPU (both ranks on one GPU, gloo over CUDA tensors) and
adds the standby's GPU memory, read from ``nvidia-smi``. ``--hang-step 20`` hangs about 1 s in,
before the warm standby is ready: the cold path a hang in the first seconds takes. Several
``--hang-step`` and ``--ranks`` values run every combination (interleaved within each), each
with its own table, then one summary table of the medians and their ratios to NVRx.

torchrun alone notices a rank stuck in a collective only when the process group times out
(``default_pg_timeout``, 30 minutes for gloo): printed for reference, not waited for.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import venv
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "workers" / "tiny_train.py"
STEPS_AFTER_HANG = 20


def job(hang_step: int = 300, device: str = "cpu") -> list[str]:
    """The worker's arguments: rank 1 hangs at ``hang_step`` of the first attempt."""
    return ["--steps", str(hang_step + STEPS_AFTER_HANG), "--step-sleep", "0.05",
            "--at", f"0:1:{hang_step}:hang", "--device", device, "--ddp"]
NVRX = "nvidia-resiliency-ext==0.4.1"
HEARTBEAT_S = 5.0


def read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def env() -> dict[str, str]:
    return {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HOME": os.environ.get("HOME", "/"),
            "PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin"}


def steps(log: Path) -> dict[int, list[float]]:
    """Attempt -> wall times of rank 0's finished steps, from ``--step-log``."""
    out: dict[int, list[float]] = {}
    for line in log.read_text().splitlines():
        t, attempt, _ = line.split()
        out.setdefault(int(attempt), []).append(float(t))
    return out


def gap(log: Path) -> float:
    """The last step of attempt 0 -> the first step of attempt 1, in seconds."""
    times = steps(log)
    if 1 not in times:
        raise SystemExit(f"no step of a second attempt in {log}: the job did not recover")
    return min(times[1]) - max(times[0])


def babysit_run(workdir: Path, job: list[str], standby: str = "true",
                ranks: int = 2, ahead: bool = True) -> dict[str, float]:
    """One babysit run with ``launch.warm_standby: <standby>`` (true, false or imports) and
    ``launch.torchrun_ahead: <ahead>``."""
    warm = standby != "false"
    log = workdir / "steps.log"
    config = workdir / "run.yaml"
    config.write_text(
        f"launch:\n  script: {WORKER}\n  nproc-per-node: {ranks}\n"
        f"  args: {json.dumps([*job, '--step-log', str(log)])}\n"
        f"  warm_standby: {standby}\n  torchrun_ahead: {str(ahead).lower()}\n"
        f"run_dir: {workdir / 'run'}\n"
        f"checkpoints: {{every_steps: 10, probation_steps: 5}}\n")
    with open(workdir / "babysit.out", "w+") as out:
        proc = subprocess.Popen([sys.executable, "-m", "babysit", "run", str(config)],
                                cwd=workdir, env=env(), stdout=out, stderr=subprocess.STDOUT)
        cost = standby_cost(workdir / "run", proc, ranks) if warm else {}
        if proc.wait(timeout=600) != 0:
            out.seek(0)
            raise SystemExit(f"babysit failed:\n{out.read()[-6000:]}")
    journal = read(workdir / "run" / "events.jsonl")

    def first(event: str, attempt: int) -> dict[str, Any]:
        return next(e for e in journal if e["event"] == event and e["attempt"] == attempt)

    last = max(steps(log)[0])
    diagnosis = first("hang_diagnosis", 0)
    confirmed = diagnosis["time"]
    suspected = confirmed - diagnosis["seconds"]
    launch = first("launch", 1)
    promoted = launch.get("standby") is True
    if promoted and not warm:
        raise SystemExit(f"attempt 1 was launched warm with the standby off: {launch}")
    attached = max(e["time"] for e in journal if e["event"] == "worker_hello"
                   and e["attempt"] == 1)
    return {
        "hang -> first step of the next attempt": gap(log),
        # A hang before the standby is ready is relaunched cold even with the standby on.
        "  next attempt from the warm standby (1 = yes)": float(promoted),
        "  next attempt's torchrun started ahead (1 = yes)": float(bool(launch.get(
            "torchrun_ahead"))),
        "  last step -> stall suspected": suspected - last,
        "  confirmation (CPU window, stacks)": diagnosis["seconds"],
        "  stop workers": first("workers_stopped", 0)["time"] - confirmed,
        "  relaunch -> first step": min(steps(log)[1]) - launch["time"],
        # Hellos are journaled at babysit's next tick: up to 0.1 s after the ranks sent them.
        "    relaunch -> hellos (checkpoint loaded)": attached - launch["time"],
        "    hellos -> first step": min(steps(log)[1]) - attached,
        **cost,
    }


def standby_cost(run_dir: Path, babysit: subprocess.Popen[bytes],
                 ranks: int = 2) -> dict[str, float]:
    """The first standby's processes (torchrun and its ranks) once every rank waits in
    ``attach()``: resident and unique memory (MB) and the CPU time it took to get there."""
    import psutil

    ready = run_dir / "attempts" / "1" / "standby" / "ready"
    while babysit.poll() is None:
        time.sleep(0.2)
        journal = read(run_dir / "events.jsonl") if (run_dir / "events.jsonl").exists() \
            else []
        if any(e["event"] == "launch" and e["attempt"] == 1 for e in journal):
            # Promoted before it was ready (a hang in the first seconds): what it holds now is
            # the running attempt's, not a waiting standby's.
            return {}
        started = [e for e in journal if e["event"] == "standby_started"]
        if not started or len([p for p in ready.glob("*") if p.name.isdigit()]) < ranks:
            continue
        try:
            root = psutil.Process(started[0]["pid"])
            procs = [root, *root.children(recursive=True)]
            memory = [p.memory_full_info() for p in procs]
            cpu = sum(sum(p.cpu_times()[:2]) for p in procs)
        except psutil.Error:
            return {}  # already promoted and gone by the time we looked
        return {"standby: resident MB": sum(m.rss for m in memory) / 2**20,
                "standby: unique MB": sum(m.uss for m in memory) / 2**20,
                "standby: CPU seconds to get ready": cpu,
                **gpu_memory({p.pid for p in procs})}
    return {}


def gpu_memory(pids: set[int]) -> dict[str, float]:
    """The GPU memory (MB) that nvidia-smi lists for ``pids``; nothing without nvidia-smi."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                               "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    if done.returncode != 0:
        return {}
    used = [float(mb) for pid, mb in (line.split(",") for line in done.stdout.splitlines()
                                      if line.count(",") == 1) if int(pid) in pids]
    return {"standby: GPU MB (nvidia-smi)": sum(used)}


def nvrx_python(path: Path) -> Path:
    """NVRx's own virtual environment at ``path``, created and installed on first use."""
    python = path / "bin" / "python"
    if (path / "bin" / "ft_launcher").exists():
        return python
    print(f"installing {NVRX} into {path} (once)", file=sys.stderr)
    venv.create(path, with_pip=True)
    done = subprocess.run([str(python), "-m", "pip", "install", "-q", "torch==2.13.0", NVRX],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"pip install {NVRX} failed:\n{done.stdout[-2000:]}"
                           f"{done.stderr[-2000:]}")
    return python


def nvrx_run(workdir: Path, job: list[str], python: Path, port: int,
             ranks: int = 2) -> dict[str, float]:
    log = workdir / "steps.log"
    command = [str(python.parent / "ft_launcher"), "--nproc-per-node", str(ranks),
               "--max-restarts", "3", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--ft-param-initial_rank_heartbeat_timeout", "60",
               "--ft-param-rank_heartbeat_timeout", str(HEARTBEAT_S),
               # Tuned as a user who cares about recovery would: its launcher looks at the
               # workers every 0.3 s and at the heartbeats every second (defaults: 5 s).
               "--ft-param-workload_check_interval", "1", "--monitor-interval", "0.3",
               str(WORKER), *job, "--nvrx", "--step-log", str(log)]
    done = subprocess.run(command, cwd=workdir, env={**env(), "PATH": f"{python.parent}:"
                                                     "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"ft_launcher failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return {"hang -> first step of the next attempt": gap(log)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--nvrx-venv", type=Path,
                        default=Path(tempfile.gettempdir()) / "babysit-bench-nvrx-0.4.1")
    parser.add_argument("--no-nvrx", action="store_true", help="babysit's side only")
    parser.add_argument("--cold", action="store_true",
                        help="also run babysit with launch.warm_standby: false")
    parser.add_argument("--no-ahead", action="store_true",
                        help="also run babysit with warm_standby: false and "
                             "launch.torchrun_ahead: false (torchrun started anew)")
    parser.add_argument("--imports", action="store_true",
                        help="also run babysit with launch.warm_standby: imports")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where the model lives (cuda: both ranks on one GPU, gloo)")
    parser.add_argument("--hang-step", type=int, nargs="+", default=[300],
                        help="the step rank 1 hangs at (300: ~15 s in, after the standby is "
                        "ready; 20: ~1 s in, before it); several: each in turn")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2],
                        help="ranks of the job (one node); several: each in turn")
    args = parser.parse_args()
    python: Path | None = None
    nvrx_error = "not run (--no-nvrx)" if args.no_nvrx else None
    if not args.no_nvrx:
        try:
            python = nvrx_python(args.nvrx_venv)
        except (RuntimeError, OSError) as exc:
            nvrx_error = str(exc)
    # babysit's columns: warm_standby's value -> its runs.
    columns = {"babysit": ("true", True), **({"imports": ("imports", True)} if args.imports
                                             else {}),
               **({"cold": ("false", True)} if args.cold else {}),
               **({"no ahead": ("false", False)} if args.no_ahead else {})}
    summary: list[tuple[int, int, dict[str, float | None]]] = []
    for ranks in args.ranks:
        for hang_step in args.hang_step:
            print(f"\n## {ranks} ranks, rank 1 hangs at step {hang_step}\n", flush=True)
            medians, nvrx_error = case(args, columns, ranks, hang_step, python, nvrx_error)
            summary.append((ranks, hang_step, medians))
    key = "hang -> first step of the next attempt"
    print(f"\n## Summary: {key}, seconds (median of {args.repeats}) and x NVRx\n")
    names = [*columns, "NVRx"]
    print("| ranks | hang at step | " + " | ".join(names) + " | " +
          " | ".join(f"{n} / NVRx" for n in columns) + " |")
    print("| ---: | ---: | " + " | ".join("---:" for _ in names) + " | " +
          " | ".join("---:" for _ in columns) + " |")
    for ranks, hang_step, medians in summary:
        theirs = medians.get("NVRx")
        cells = [f"{v:.2f}" if (v := medians.get(n)) is not None else "" for n in names]
        ratios = [f"{v / theirs:.2f}x" if theirs and (v := medians.get(n)) is not None
                  else "" for n in columns]
        print(f"| {ranks} | {hang_step} | " + " | ".join(cells) + " | " + " | ".join(ratios)
              + " |")
    if nvrx_error is not None:
        print(f"\nNVRx was not measured: {nvrx_error}")


def case(args: argparse.Namespace, columns: dict[str, tuple[str, bool]], ranks: int,
         hang_step: int,
         python: Path | None, nvrx_error: str | None
         ) -> tuple[dict[str, float | None], str | None]:
    """One job size and hang step: every column ``args.repeats`` times, interleaved; prints its
    table; returns each column's median of the headline figure (and NVRx's error, if any)."""
    work = job(hang_step, args.device)
    from torch.distributed.constants import default_pg_timeout

    from babysit.supervisor.node.launcher import free_port

    runs: dict[str, list[dict[str, float]]] = {name: [] for name in columns}
    theirs: list[dict[str, float]] = []
    for i in range(args.repeats):  # interleaved: the machine's load falls on all alike
        for name, (standby, ahead) in columns.items():
            with tempfile.TemporaryDirectory(prefix=f"babysit-bench-{name.replace(' ', '-')}-"
                                             ) as tmp:
                runs[name].append(babysit_run(Path(tmp), work, standby, ranks, ahead))
        if python is not None and nvrx_error is None:
            with tempfile.TemporaryDirectory(prefix="nvrx-bench-") as tmp:
                try:
                    theirs.append(nvrx_run(Path(tmp), work, python, free_port(), ranks))
                except RuntimeError as exc:
                    nvrx_error = str(exc)
        print(f"repeat {i + 1}/{args.repeats} done", file=sys.stderr)

    head = f"seconds (median of {args.repeats})"
    print(f"{head:48s} " + " ".join(f"{name:>9s}" for name in columns) +
          f" {'NVRx 5 s':>9s} {'torchrun':>9s}")
    timeout = default_pg_timeout.total_seconds()

    def column(runs: list[dict[str, float]], key: str) -> str:
        values = [r[key] for r in runs if key in r]
        return f"{statistics.median(values):9.2f}" if values else f"{'':9s}"

    every = [r for name in columns for r in runs[name]]
    for key in dict.fromkeys(k for r in every for k in r):  # every row any run measured
        ref = f"{timeout:9.0f}" if key.startswith("hang") else ""
        ours = " ".join(column(runs[name], key) for name in columns)
        print(f"{key:48s} {ours} {column(theirs, key)} {ref}")
    print(f"\nbabysit: the default policy, nothing hand-set, warm standby on (imports: "
          f"launch.warm_standby imports; cold: false, torchrun started ahead; no ahead: "
          f"false, and launch.torchrun_ahead false). NVRx: ft_launcher with "
          f"rank_heartbeat_timeout={HEARTBEAT_S:g} s, workload_check_interval 1 s and "
          f"monitor-interval 0.3 s set by hand. torchrun: torch's default "
          f"gloo process-group timeout ({timeout:.0f} s), not waited for.", flush=True)
    headline = "hang -> first step of the next attempt"

    def median(rs: list[dict[str, float]]) -> float | None:
        return statistics.median(r[headline] for r in rs) if rs else None

    return {**{name: median(runs[name]) for name in columns}, "NVRx": median(theirs)}, \
        nvrx_error


if __name__ == "__main__":
    main()
