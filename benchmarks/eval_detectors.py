"""Evaluate babysit's loss-spike verdicts on real Pythia curves, injected faults, and a real run.

    .venv/bin/python benchmarks/eval_detectors.py [--policy default] [--positions 40] [--seed 0]
                                                  [--e2e] [--no-write]

What it measures (tables go to stdout and into docs/detection.md between the eval markers):

1. every real curve in ../shared/data/curves/, replayed end to end through the policy. These
   runs all finished healthy with nobody intervening: every rollback there is wasted work.
2. injected faults, multiplied onto every curve at random positions after step 1500 (seeded),
   each replayed from a snapshot of the pipeline (through JSON, as a supervisor taking over
   would) for the ~250 steps it touches:
   - healing: scaled copies of the two real spike shapes of pythia-160m-seed7 (the big one
     around step 1400, the bump around 1250), as they were: they heal by themselves, so a
     rollback is wasted;
   - not healing: the same shapes held at their peak for the rest of the window;
   - a step jump that stays (1.25x, 1.5x, 2x); a divergence (the loss grows 0.5 % or 1 % per
     step, without end); catastrophic faults (a 5x jump, a NaN).
   Onset = the first injected step at least 2 % above the clean curve (the jump itself for
   step faults); latency = first rollback step - onset.
3. the resume check (``policies/detectors/resume_loss.py``) on every curve: a resume every
   ``RESUME_EVERY`` steps, its first steps the curve's own next ones (it took: any verdict is
   a false alarm), and the same resumes whose first steps are the run's very first losses (a
   script that loaded fresh weights over the restored ones: it must be caught).
4. with ``--e2e``: the demo model (configs/demo_train.py, 2 ranks, 400 steps) trained clean,
   then with poisoned batches 200-229 under plain torchrun and under babysit (torchrun-style
   invocation, default checkpoints): final eval losses. About two minutes on 2 free cores.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from babysit.policies.detectors.resume_loss import ResumeLoss  # noqa: E402
from babysit.policies.loader import load_policy  # noqa: E402
from babysit.policies.pipeline import Pipeline, ReplayDecision  # noqa: E402
from babysit.policies.replay import read_curve  # noqa: E402
from babysit.policies.schema import Policy  # noqa: E402
from babysit.policies.types import RankStep, StepRecord  # noqa: E402

CURVES = Path(os.environ.get("BABYSIT_CURVES", ROOT.parent / "shared" / "data" / "curves"))
DOC = ROOT / "docs" / "detection.md"
BEGIN, END = "<!-- eval:begin -->", "<!-- eval:end -->"
SHAPE_SIZES = (1.1, 1.25, 1.5, 2.0)
ONSET_EXCESS = 0.02
WINDOW = 250
"""Steps replayed per injection: the fault and what follows it."""
DEADLINE = 100
RESUME_EVERY = 7
"""Steps between the resumes the resume check is tried at (after the first 20)."""
"""A fault that does not heal must be rolled back within this many steps of its onset."""


def load(path: Path) -> list[float]:
    return [r.loss if r.loss is not None else math.nan for r in read_curve(path)]


def shapes(loss160: list[float]) -> dict[str, list[float]]:
    """Log-excess profiles of the real spikes, normalised to a peak of 1 (index = step - 1)."""
    out = {}
    for name, (base_lo, base_hi, lo, hi) in {
        "big@1400": (1360, 1390, 1390, 1446),
        "bump@1250": (1210, 1240, 1240, 1272),
    }.items():
        base = statistics.median(math.log(v) for v in loss160[base_lo - 1:base_hi - 1])
        exc = [max(math.log(v) - base, 0.0) for v in loss160[lo - 1:hi - 1]]
        peak = max(exc)
        out[name] = [e / peak for e in exc]
    return out


def record(step: int, loss: float) -> StepRecord:
    rank = RankStep(rank=0, step=step, time=float(step), cursor=step, loss=loss)
    return StepRecord(step=step, time=float(step), ranks=(rank,), world_size=1)


Fault = Callable[[int], float]
"""Multiplier of the clean loss at offset i (0 = the injection point) of the window."""


def from_shape(shape: list[float], size: float, hold: bool) -> Fault:
    peak = shape.index(1.0)
    log_size = math.log(size)

    def mult(i: int) -> float:
        if hold and i > peak:
            return size
        return math.exp(log_size * shape[i]) if i < len(shape) else 1.0
    return mult


def jump(size: float) -> Fault:
    return lambda i: size


def diverge(rate: float) -> Fault:
    return lambda i: math.exp(rate * (i + 1))


def nan_at_start(i: int) -> float:
    return math.nan if i == 0 else 1.0


@dataclass
class Outcome:
    latency: int | None
    """First rollback step - onset; None: never rolled back in the window."""
    warned: bool


def run_clean(policy: Policy, loss: list[float], positions: list[int]) -> tuple[
        list[ReplayDecision], dict[int, str]]:
    """Replay a whole clean curve; snapshot the pipeline before each position (1-based step)."""
    pipe = Pipeline(policy)
    wanted = set(positions)
    snaps: dict[int, str] = {}
    decisions: list[ReplayDecision] = []
    for i, v in enumerate(loss):
        step = i + 1
        if step in wanted:
            snaps[step] = json.dumps(pipe.state_dict())
        decisions.extend(pipe.observe(record(step, v)))
    return decisions, snaps


def inject(policy: Policy, loss: list[float], snap: str, pos: int, fault: Fault) -> Outcome:
    pipe = Pipeline(policy)
    pipe.load_state_dict(json.loads(snap))
    onset: int | None = None
    warned = False
    for i in range(WINDOW):
        step = pos + i
        m = fault(i)
        if onset is None and (math.isnan(m) or m - 1.0 >= ONSET_EXCESS):
            onset = step
        for d in pipe.observe(record(step, loss[step - 1] * m)):
            warned = True
            if d.action in ("rollback", "stop") and onset is not None:
                return Outcome(d.step - onset, True)
    return Outcome(None, warned)


def resume_checks(policy: Policy, curves: dict[str, list[float]]) -> list[str]:
    """Section 3: the resume check's false alarms and catches on every curve."""
    config = policy.detectors.resume_loss
    lines = ["", "**Resume check** (a resume every "
             f"{RESUME_EVERY} steps; took: the curve goes on; overwritten: its first "
             f"{config.steps} steps are the run's first ones)", "",
             "| run | resumes | false alarms (took) | caught (overwritten) |",
             "| --- | ---: | ---: | ---: |"]
    for name, loss in curves.items():
        resumes = alarms = caught = 0
        for s in range(20, len(loss) - 2 * config.steps, RESUME_EVERY):
            recorded = {t: loss[t] for t in range(max(0, s - config.history + 1), s + 1)}
            took = ResumeLoss.start(config, s, recorded)
            overwritten = ResumeLoss.start(config, s, recorded)
            if took is None or overwritten is None:
                continue
            resumes += 1
            ahead = range(s + 1, s + 1 + 2 * config.steps)
            alarms += any(took.observe(t, loss[t]) is not None for t in ahead)
            caught += any(overwritten.observe(t, loss[t - s - 1]) is not None for t in ahead)
        lines.append(f"| {name} | {resumes} | {alarms} | {caught / max(resumes, 1):.4f} |")
    return lines


def pct(xs: list[int], q: float) -> str:
    if not xs:
        return "-"
    s = sorted(xs)
    return f"{s[min(len(s) - 1, int(q * len(s)))]}"


def demo_e2e(workdir: Path) -> list[str]:
    """Clean, poisoned under torchrun, poisoned under babysit: the demo's final eval loss."""
    bin_dir = Path(sys.executable).parent
    script = str(ROOT / "configs" / "demo_train.py")
    common = ["--nproc-per-node", "2", script, "--steps", "400"]
    runs = {
        "clean (torchrun)": [str(bin_dir / "torchrun"), *common],
        "poisoned, plain torchrun": [str(bin_dir / "torchrun"), *common, "--corrupt", "200:230"],
        "poisoned, babysit": [str(bin_dir / "babysit"), "run", "--run-dir",
                              str(workdir / "babysit"), *common, "--corrupt", "200:230"],
    }
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    lines = ["", "**End to end: the demo model with poisoned data** (`configs/demo_train.py "
             "--steps 400`, 2 ranks, batches 200-229 with random targets)", "",
             "| run | exit | final eval loss | vs clean | wall s |",
             "| --- | ---: | ---: | ---: | ---: |"]
    clean = None
    for name, cmd in runs.items():
        t0 = time.perf_counter()
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
        found = re.findall(r"done: .* eval loss ([0-9.]+)", out.stdout + out.stderr)
        loss = float(found[-1]) if found else math.nan
        clean = loss if clean is None else clean
        lines.append(f"| {name} | {out.returncode} | {loss:.3f} | "
                     f"{100 * (loss / clean - 1):+.1f} % | {time.perf_counter() - t0:.0f} |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--policy", default="default")
    ap.add_argument("--positions", type=int, default=40, help="injections per curve and fault")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--e2e", action="store_true", help="also train the demo model three ways")
    ap.add_argument("--no-write", action="store_true", help="print only; leave the doc alone")
    args = ap.parse_args()
    t0 = time.perf_counter()
    policy = load_policy(args.policy, {})
    rng = random.Random(args.seed)
    paths = sorted(CURVES.glob("*.tsv.gz"))
    if not paths:
        print(f"no curves (*.tsv.gz) in {CURVES}; set BABYSIT_CURVES", file=sys.stderr)
        return 2
    curves = {p.name.removesuffix(".tsv.gz"): load(p) for p in paths}
    spike_source = curves.get("pythia-160m-seed7")
    profiles = shapes(spike_source) if spike_source else {}
    lines = [f"Policy `{args.policy}`, seed {args.seed}, {args.positions} positions per curve "
             f"and fault, on {len(curves)} curves.", "",
             "**Real runs, replayed end to end** (all finished healthy: every rollback is "
             "wasted)", "",
             "| run | steps | warnings (alerts) | rollbacks | findings |",
             "| --- | ---: | ---: | ---: | --- |"]
    positions = {n: sorted(rng.sample(range(1500, len(c) - WINDOW - 1), args.positions))
                 for n, c in curves.items()}
    snaps: dict[str, dict[int, str]] = {}
    for name, loss in curves.items():
        decs, snaps[name] = run_clean(policy, loss, positions[name])
        rb = [d for d in decs if d.action in ("rollback", "stop")]
        where = ", ".join(f"{d.step} ({d.severity}, {d.action})" for d in decs[:6]) or "-"
        lines.append(f"| {name} | {len(loss)} | {len(decs) - len(rb)} | {len(rb)} | {where} |")

    faults: list[tuple[str, str, Fault]] = []
    for sname, prof in profiles.items():
        for size in SHAPE_SIZES:
            faults.append(("healing", f"{sname} x{size:g}", from_shape(prof, size, hold=False)))
    for sname, prof in profiles.items():
        for size in SHAPE_SIZES:
            faults.append(("not healing", f"{sname} x{size:g}, held",
                           from_shape(prof, size, hold=True)))
    faults += [("not healing", f"jump x{s:g}, stays", jump(s)) for s in (1.25, 1.5, 2.0)]
    faults += [("diverging", f"+{100 * r:g} %/step", diverge(r)) for r in (0.005, 0.01)]
    faults += [("catastrophic", "jump x5", jump(5.0)), ("catastrophic", "NaN", nan_at_start)]

    lines += ["", "**Injected faults** (onset = first step >= 2 % above the clean curve; "
              f"latency = rollback step - onset; deadline {DEADLINE} steps for the ones that "
              "do not heal)", "",
              "| kind | fault | injections | rolled back | within deadline | warned "
              "| latency median | p90 | max |",
              "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for kind, label, fault in faults:
        outs = [inject(policy, curves[n], snaps[n][p], p, fault)
                for n in curves for p in positions[n]]
        lat = [o.latency for o in outs if o.latency is not None]
        rolled = len(lat) / len(outs)
        within = sum(1 for x in lat if x <= DEADLINE) / len(outs)
        lines.append(
            f"| {kind} | {label} | {len(outs)} | {rolled:.3f} | "
            f"{within if kind != 'healing' else float('nan'):.3f} | "
            f"{sum(o.warned for o in outs) / len(outs):.3f} | {pct(lat, 0.5)} | "
            f"{pct(lat, 0.9)} | {max(lat) if lat else '-'} |")
    lines += resume_checks(policy, curves)
    if args.e2e:
        with tempfile.TemporaryDirectory(prefix="babysit-eval-") as tmp:
            lines += demo_e2e(Path(tmp))
    lines += ["", f"_{time.perf_counter() - t0:.1f} s on this machine._"]
    table = "\n".join(lines).replace("| nan |", "| - |")
    print(table)
    if not args.no_write:
        doc = DOC.read_text() if DOC.exists() else f"{BEGIN}\n{END}\n"
        if BEGIN not in doc or END not in doc:
            doc += f"\n{BEGIN}\n{END}\n"
        head, rest = doc.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
        DOC.write_text(f"{head}{BEGIN}\n{table}\n{END}{tail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
