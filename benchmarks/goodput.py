"""Goodput under a fault schedule: babysit (default policy) beside plain torchrun, same job.

    .venv/bin/python benchmarks/goodput.py [--minutes 2] [--stall-s 30]
                                           [--saves default|sync|async]
                                           [--just-in-time on|off|both] [--repeats N]
                                           [--fsdp] [--memory 0,auto,5]
                                           [--no-torchrun] [--keep DIR]

The job is ``tests/workers/tiny_train.py``, 2 gloo ranks on this CPU, 0.05 s of sleep per
step, sized to ``--minutes`` of fault-free training (the issue's figure is for 10; the step
time is measured first, on 60 steps under plain torchrun), with
four faults placed at fractions of its steps:

- 20%: a data spike: 4 poisoned global batches (``--spike``), a loss jump;
- 40%: a hang: rank 1 sleeps forever outside the all-reduce (``--at ...:hang``);
- 60%: a crash: rank 0 killed by SIGKILL (``--at ...:SIGKILL``), as the OOM killer would;
- 75-85%: a straggler: rank 1's loader waits 0.05 s for each batch (``--slow-data``).

babysit runs with its default policy and a checkpoint every 25 steps (``checkpoints.async_save``
at its default unless ``--saves`` says otherwise); goodput is its ledger's
(``babysit status --json``: productive step time / wall time), the final loss its last metrics
row's. Each fault strikes once: babysit's attempts are numbered, so the hang is placed in
attempt 2 (the spike takes two relaunches: the rerun of the same batches, then the rollback
that skips them) and the crash in attempt 3, after the hang's relaunch. A scheduled fault
babysit never met stops the script with an error rather than a flattering figure.

babysit's own badput is its ledger's badput less the job's own delays, which the same job pays
under any launcher: the injected slow loader (the ``straggler`` category) and the job's start-up
and exit as plain torchrun measures them on the calibration run, from the command to its first
step and from its last step to its exit (never more than the ledger's ``startup`` and
``shutdown``), plus the babysit process's seconds outside its ledger (its interpreter and
imports before the run's first journal entry, its exit after the last), over the babysit
process's whole wall time. The gross figures are printed beside it.

``--just-in-time both --repeats 3`` runs babysit's half six times, with
``checkpoints.just_in_time`` on (the default) and off in turn, and prints each figure's median
side by side: what the ranks that still hold the last step save of the work since the last
checkpoint (the hang's and the crash's "lost"; the spike's rollback goes back before its onset
either way).

``--fsdp`` shards the model with FSDP2 (each rank the only holder of its half): the crash then
leaves a shard no live rank holds, and ``--memory 0,auto,5`` runs babysit's half with
``checkpoints.memory_every_steps`` at each value in turn (0: off; ``auto``, the default; a
number of steps), printing what the crash lost under each, side by side.

torchrun (``python -m torch.distributed.run --standalone``) gets the same faults, all in its
only attempt. It trains through the spike, then hangs: gloo would wait 30 minutes before its
collective times out, so the script stops it after ``--stall-s`` seconds without a step and
says so. Its goodput is rank 0's step time (``--step-log``: each step's wall time) over the
wall time until it was stopped; its loss is the last one rank 0 printed (``--loss-every``).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "workers" / "tiny_train.py"
GLOO_TIMEOUT_S = 1800.0  # torch's default_pg_timeout for gloo


def env() -> dict[str, str]:
    return {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HOME": os.environ.get("HOME", "/"),
            "PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin"}


def calibrate(workdir: Path, nproc: int = 2,
              job: tuple[str, ...] = ("--step-sleep", "0.05", "--ddp")
              ) -> tuple[float, float, float]:
    """The job's fault-free step time on this machine (``nproc`` ranks of the tiny job with
    ``job`` as its arguments: 0.05 s of sleep, the compute, the collectives): the median of
    60 steps under plain torchrun, so that ``--minutes`` is what the fault-free run takes here.
    Also what the same job pays under plain torchrun to start (the command to its first step
    done) and to end (its last step to torchrun's exit), the job's own start-up and exit that
    babysit's ledger counts as ``startup`` and ``shutdown``."""
    log = workdir / "calibrate-steps.log"
    started = time.time()
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", str(nproc), str(WORKER), "--steps", "60", *job,
                           "--step-log", str(log)], cwd=workdir, env=env(),
                          capture_output=True, text=True, timeout=300)
    ended = time.time()
    times = step_log(log)
    # gloo in torch 2.13 sometimes aborts a rank in its teardown after the last step, and
    # torchrun then exits 1: the steps are what counts.
    if len(times) < 60:
        raise SystemExit(f"the calibration run stopped at step {len(times)} (exit "
                         f"{done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    step_s = statistics.median(b - a for a, b in itertools.pairwise(times[10:]))
    return step_s, times[0] - started, ended - times[-1]


def workdir_for(stack: contextlib.ExitStack, keep: Path | None, prefix: str) -> Path:
    """``keep`` (made, kept after the run) or a temporary folder ``stack`` removes."""
    if keep:
        keep.mkdir(parents=True, exist_ok=True)
        return keep.resolve()
    return Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=prefix)))


def step_log(log: Path) -> list[float]:
    """The wall time of each step rank 0 finished (``--step-log``), in order; [] if none."""
    return [float(line.split()[0]) for line in log.read_text().splitlines()] \
        if log.exists() else []


def schedule(steps: int) -> dict[str, int]:
    """Where the faults strike, in steps (the data spike and the straggler in global batches,
    which track steps until a rollback skips some)."""
    return {"spike": int(0.2 * steps), "hang": int(0.4 * steps), "crash": int(0.6 * steps),
            "slow_start": int(0.75 * steps), "slow_end": int(0.85 * steps)}


def job(steps: int, at: dict[str, int], hang_attempt: int, crash_attempt: int,
        fsdp: bool = False) -> list[str]:
    return ["--steps", str(steps), "--step-sleep", "0.05", "--loss-every", "10",
            *(["--fsdp"] if fsdp else ["--ddp"]),
            "--spike", f"{at['spike']}:{at['spike'] + 4}",
            "--at", f"{hang_attempt}:1:{at['hang']}:hang",
            "--at", f"{crash_attempt}:0:{at['crash']}:SIGKILL",
            "--slow-data", f"1:0.05:{at['slow_start']}:{at['slow_end']}"]


def under_babysit(workdir: Path, steps: int, at: dict[str, int],
                  saves: str = "default", just_in_time: bool = True, fsdp: bool = False,
                  memory: str = "auto") -> dict[str, Any]:
    run_dir = workdir / "babysit"
    if run_dir.exists():  # a repeat: a fresh run, not a takeover of the last one
        import shutil

        shutil.rmtree(run_dir)
    config = workdir / "run.yaml"
    how = {"default": "", "sync": ", async_save: false", "async": ", async_save: true"}[saves]
    how += "" if just_in_time else ", just_in_time: false"
    how += "" if memory == "auto" else f", memory_every_steps: {memory}"
    config.write_text(
        f"launch:\n  script: {WORKER}\n  nproc-per-node: 2\n"
        f"  args: {json.dumps(job(steps, at, hang_attempt=2, crash_attempt=3, fsdp=fsdp))}\n"
        f"run_dir: {run_dir}\ncheckpoints: {{every_steps: 25, probation_steps: 5{how}}}\n")
    started = time.time()
    done = subprocess.run([sys.executable, "-m", "babysit", "run", str(config)], cwd=workdir,
                          env=env(), capture_output=True, text=True, timeout=6 * 3600)
    wall = time.time() - started
    status = subprocess.run([sys.executable, "-m", "babysit", "status", "--json", str(run_dir)],
                            cwd=workdir, env=env(), capture_output=True, text=True, check=True)
    snap = json.loads(status.stdout)
    remedies = [f"{i['incident']} -> {i['action']}" for i in snap["incidents"]]
    met = {i["incident"] for i in snap["incidents"]}
    missed = [incident for incident in ("hang", "crash") if incident not in met]
    if missed:
        raise SystemExit(f"babysit never met the scheduled {' and '.join(missed)} "
                         f"(attempt numbering changed?); its remedies: {remedies}")
    lost = {str(a["attempt"]): round(a["seconds"].get("lost", 0.0), 3)
            for a in snap["goodput"].get("attempts", [])}
    return {"exit": done.returncode, "wall_s": wall, "ledger": snap["goodput"],
            "step": snap["step"], "loss": snap["loss"], "remedies": remedies,
            "tail": done.stdout[-1500:], "lost_by_attempt": lost}


def under_torchrun(workdir: Path, steps: int, at: dict[str, int],
                   stall_s: float) -> dict[str, Any]:
    log = workdir / "torchrun-steps.log"
    out = workdir / "torchrun.out"
    args = [*job(steps, at, hang_attempt=0, crash_attempt=0), "--step-log", str(log)]
    started = time.time()
    with open(out, "w") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
             "2", str(WORKER), *args], cwd=workdir, env=env(), stdout=sink,
            stderr=subprocess.STDOUT, start_new_session=True)
        how = "finished"
        last_progress = started
        seen = 0
        while proc.poll() is None:
            time.sleep(1.0)
            lines = log.read_text().count("\n") if log.exists() else 0
            if lines != seen:
                seen, last_progress = lines, time.time()
            if time.time() - last_progress > stall_s:
                how = f"hung: no step for {stall_s:g} s, stopped (gloo's own timeout is 30 min)"
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if how == "finished" and proc.returncode:
            how = f"crashed (exit {proc.returncode})"
    ended = time.time()
    times = step_log(log)
    productive = sum(b - a for a, b in itertools.pairwise(times))
    losses = re.findall(r"step (\d+) loss ([0-9.einfa]+)", out.read_text())
    return {"how": how, "wall_s": ended - started, "goodput": productive / (ended - started),
            "step": len(times), "loss": float(losses[-1][1]) if losses else None,
            "loss_step": int(losses[-1][0]) if losses else None}


def report(b: dict[str, Any], job_start_s: float, job_exit_s: float) -> dict[str, float]:
    """Print one babysit run's figures; return them for the medians."""
    ledger = b["ledger"]
    bad = ", ".join(f"{k} {v:.1f} s" for k, v in sorted(
        ledger["seconds"].items(), key=lambda kv: -kv[1]) if k != "productive" and v >= 0.05)
    print(f"babysit:  goodput {100 * ledger['goodput']:.1f}% of {ledger['wall_s']:.1f} s "
          f"(exit {b['exit']}), step {b['step']}, final loss {b['loss']:.4f}; "
          f"{'; '.join(b['remedies'])}", flush=True)
    print(f"          badput: {bad}; lost by attempt: {b['lost_by_attempt']}", flush=True)
    if b["exit"] != 0:
        print(b["tail"])
    straggler = ledger["seconds"].get("straggler", 0.0)
    if straggler:  # the injected slow loader: the job's own, whoever supervises it
        print(f"          without the straggler's own delay: goodput "
              f"{100 * ledger['seconds']['productive'] / (ledger['wall_s'] - straggler):.1f}%",
              flush=True)
    # babysit's own: its badput less the job's own delays, which the same job pays under
    # plain torchrun (the slow loader; starting and ending its processes, measured above).
    sec = ledger["seconds"]
    gross = sum(v for k, v in sec.items() if k != "productive")
    # ...and the seconds of the babysit process outside its ledger (its interpreter and
    # imports before the run's first journal entry, its exit after the last).
    outside = max(0.0, b["wall_s"] - ledger["wall_s"])
    own = gross - straggler - min(sec.get("startup", 0.0), job_start_s) \
        - min(sec.get("shutdown", 0.0), job_exit_s) + outside
    print(f"          babysit's own badput: {own:.1f} s, {100 * own / b['wall_s']:.1f}% "
          f"of the process's wall time {b['wall_s']:.1f} s (its badput {gross:.1f} s, "
          f"less the straggler {straggler:.1f} s and the job's own start {job_start_s:.1f} s "
          f"and exit {job_exit_s:.1f} s under plain torchrun, plus {outside:.1f} s of its "
          f"process outside the ledger)", flush=True)
    return {"goodput_%": 100 * ledger["goodput"], "own_badput_s": own,
            "own_badput_%": 100 * own / b["wall_s"], "lost_s": sec.get("lost", 0.0),
            "crash_lost_s": b["lost_by_attempt"].get("3", 0.0), "wall_s": b["wall_s"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=2.0,
                   help="fault-free training time the job is sized to (the issue: 10)")
    p.add_argument("--stall-s", type=float, default=30.0,
                   help="stop torchrun after this long without a step")
    p.add_argument("--saves", choices=("default", "sync", "async"), default="default",
                   help="checkpoints.async_save: babysit's default (true: asynchronous), "
                        "false or true")
    p.add_argument("--just-in-time", choices=("on", "off", "both"), default="on",
                   help="checkpoints.just_in_time: on (the default), off, or both in turn")
    p.add_argument("--repeats", type=int, default=1,
                   help="babysit runs of each setting (medians printed when more than one)")
    p.add_argument("--fsdp", action="store_true",
                   help="shard the model with FSDP2: the crash leaves a shard no live rank holds")
    p.add_argument("--memory", default="auto",
                   help="checkpoints.memory_every_steps, or several comma-separated in turn "
                        "(0: off, auto: the default, or a number of steps)")
    p.add_argument("--no-torchrun", action="store_true", help="run only the babysit half")
    p.add_argument("--keep", type=Path, metavar="DIR",
                   help="run in DIR and keep it (babysit's run directory: DIR/babysit) instead "
                        "of a temporary folder")
    args = p.parse_args()
    with contextlib.ExitStack() as stack:
        workdir = workdir_for(stack, args.keep, "babysit-goodput-")
        step_s, job_start_s, job_exit_s = calibrate(workdir)
        steps = int(args.minutes * 60 / step_s)
        at = schedule(steps)
        print(f"job: {steps} steps of {1000 * step_s:.1f} ms (~{args.minutes:g} min "
              f"fault-free here); spike at batch {at['spike']}, hang at step {at['hang']}, "
              f"crash at step {at['crash']}, slow loader batches {at['slow_start']}-"
              f"{at['slow_end'] - 1}", flush=True)
        keeps = {"on": [True], "off": [False], "both": [True, False]}[args.just_in_time]
        settings = [(k, m) for k in keeps for m in args.memory.split(",")]
        figures: dict[tuple[bool, str], list[dict[str, float]]] = {s: [] for s in settings}
        for repeat in range(args.repeats):
            for keeping, memory in settings:
                if len(settings) > 1 or args.repeats > 1:
                    print(f"-- babysit, just_in_time {'on' if keeping else 'off'}, "
                          f"memory_every_steps {memory}, run {repeat + 1} of {args.repeats}",
                          flush=True)
                b = under_babysit(workdir, steps, at, saves=args.saves, just_in_time=keeping,
                                  fsdp=args.fsdp, memory=memory)
                figures[(keeping, memory)].append(report(b, job_start_s, job_exit_s))
        if len(settings) > 1 or args.repeats > 1:
            names = " / ".join(f"just_in_time {'on' if k else 'off'}, memory {m}"
                               for k, m in settings)
            print(f"\nmedians of {args.repeats} ({names}):")
            for name in ("goodput_%", "own_badput_s", "own_badput_%", "lost_s", "crash_lost_s",
                         "wall_s"):
                cells = " / ".join(
                    f"{statistics.median(f[name] for f in figures[s]):.2f}" for s in settings)
                print(f"  {name:14s} {cells}")
        if args.no_torchrun:
            return
        t = under_torchrun(workdir, steps, at, args.stall_s)
        loss = (f"last loss {t['loss']:.4f} at step {t['loss_step']}" if t["loss"] is not None
                else "no loss printed")
        waited = ""
        if t["how"].startswith("hung"):  # what gloo's 30-minute timeout would have made of it
            total = t["wall_s"] - args.stall_s + GLOO_TIMEOUT_S
            waited = f" (to gloo's timeout: {100 * t['goodput'] * t['wall_s'] / total:.1f}%)"
        print(f"torchrun: goodput {100 * t['goodput']:.1f}%{waited} of {t['wall_s']:.1f} s, "
              f"{t['how']}; {t['step']} of {steps} steps, {loss}", flush=True)


if __name__ == "__main__":
    main()
