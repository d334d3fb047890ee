"""``babysit``: the command line.

    babysit run [options] CONFIG.yaml [options]    # options: --run-dir, torchrun's (they
                                                   # override the file's launch section)
    babysit run [torchrun options] SCRIPT [script args...]      # drop-in for torchrun
    srun babysit run CONFIG.yaml                   # under Slurm: nodes, node rank, leader and
                                                   # run directory from the step (config.slurm)
    babysit validate CONFIG.yaml
    babysit doctor CONFIG.yaml [--send-alert] [--json]
    babysit alert-test CONFIG.yaml
    babysit status RUN_DIR [--json]
    babysit report RUN_DIR [--out PATH]
    babysit schema [--policy] [--json] [--write PATH]
    babysit replay CURVE [--policy NAME|PATH] [--json]

Exit codes: 0 success; 1 the run failed and should not simply be run again (the job's own
fault, no progress) or a check failed; 75 the run failed for a cause outside the job: requeue it
without the hosts in RUN_DIR/exclude_hosts; 2 a usage or configuration mistake; 128+N babysit
was stopped by signal N.
Heavy modules are imported inside the subcommands so ``babysit --help`` answers at once.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from babysit.supervisor.node.ahead import Early

EXIT_USAGE = 2
DEFAULT_CHECKPOINT_EVERY = 100  # config.schema.DEFAULT_EVERY_STEPS, without importing pydantic
"""Checkpoint interval of a run (a config or the command line alike: ``checkpoints.every_steps:
auto``) until the cadence advice, which measures this run's checkpoint cost and interruptions,
adopts its own (Young/Daly). 100 steps bounds the work a rollback or crash loses before any
measurement, and leaves a good checkpoint (past its 50-step probation) behind most spikes."""

# torchrun options babysit models, as (flag, config key, type). Both spellings are accepted.
_TORCHRUN_OPTIONS: list[tuple[str, str, type]] = [
    ("nproc-per-node", "nproc_per_node", str),
    ("nnodes", "nnodes", str),
    ("node-rank", "node_rank", int),
    ("rdzv-backend", "rdzv_backend", str),
    ("rdzv-endpoint", "rdzv_endpoint", str),
    ("rdzv-id", "rdzv_id", str),
    ("rdzv-conf", "rdzv_conf", str),
    ("master-addr", "master_addr", str),
    ("master-port", "master_port", int),
    ("local-addr", "local_addr", str),
    ("start-method", "start_method", str),
    ("monitor-interval", "monitor_interval", float),
    ("role", "role", str),
    ("max-restarts", "max_restarts", int),
    ("local-ranks-filter", "local_ranks_filter", str),
]
# torchrun options babysit passes to torchrun as they are (into launch.torchrun_args): the
# valued ones, then the switches.
_PASSED_THROUGH = ["event-log-handler", "duplicate-stdout-filters", "duplicate-stderr-filters",
                   "logs-specs", "numa-binding", "signals-to-handle", "shutdown-timeout"]
_PASSED_SWITCHES = ["run-path", "virtual-local-rank"]
# torchrun options whose job babysit does itself: accepted (a torchrun command line works as
# it is) with a note saying what babysit does instead; ignoring them silently would mislead.
_OWNED_BY_BABYSIT = {
    "log-dir": "babysit keeps every rank's stdout/stderr under the run directory "
               "(attempts/<n>/torchrun/); use --run-dir to choose where",
    "redirects": "babysit always keeps per-rank logs and shows them on the console",
    "tee": "babysit always keeps per-rank logs and shows them on the console",
}


class UsageError(Exception):
    pass


def _spellings(name: str) -> list[str]:
    dashed = f"--{name}"
    underscored = f"--{name.replace('-', '_')}"
    return [dashed] if dashed == underscored else [dashed, underscored]


def _run_options(run: argparse.ArgumentParser) -> None:
    """``babysit run``'s options: before the target, or after a config file."""
    run.add_argument("--run-dir", "--run_dir", dest="run_dir",
                     help="folder for the journal, logs, metrics and checkpoints")
    run.add_argument("--policy", help="built-in policy name or path to a policy YAML")
    run.add_argument("--checkpoint-every", "--checkpoint_every", dest="checkpoint_every",
                     type=int, metavar="N", default=None,
                     help="save a checkpoint every N steps through attach(model=...); 0: never "
                          f"(default, as checkpoints.every_steps: auto: {DEFAULT_CHECKPOINT_EVERY}"
                          ", then the cadence advice's interval)")
    run.add_argument("--name", help="name of the run (alerts, default run directory)")
    run.add_argument("--leader", metavar="HOST:PORT",
                     help="multi-node runs: where node 0's babysitter listens (nodes.leader)")
    run.add_argument("--spares", type=int, metavar="K", default=None,
                     help="multi-node runs: K hot-spare nodes beyond the MAX of --nnodes, at "
                          "node ranks MAX to MAX+K-1; a lost or evicted node's place goes to "
                          "one (nodes.spares)")
    run.add_argument("--skip-doctor", action="store_true",
                     help="start even if the fast pre-flight checks fail")
    torchrun = run.add_argument_group("torchrun options (both dash and underscore spellings)")
    for flag, key, kind in _TORCHRUN_OPTIONS:
        torchrun.add_argument(*_spellings(flag), dest=key, type=kind, default=None)
    torchrun.add_argument("--standalone", action="store_true",
                          help="accepted for compatibility: single-node runs always get a fresh "
                               "local rendezvous")
    torchrun.add_argument("-m", "--module", dest="module", action="store_true",
                          help="SCRIPT is a module name, as python -m")
    torchrun.add_argument("--no-python", "--no_python", dest="no_python", action="store_true")
    for flag in _PASSED_THROUGH:
        torchrun.add_argument(*_spellings(flag), dest=f"pass_{flag}", default=None,
                              help="passed to torchrun as it is")
    for flag in _PASSED_SWITCHES:
        torchrun.add_argument(*_spellings(flag), dest=f"pass_{flag}", action="store_true",
                              help="passed to torchrun as it is")
    for flag in _OWNED_BY_BABYSIT:
        short = {"redirects": ["-r"], "tee": ["-t"]}.get(flag, [])
        torchrun.add_argument(*short, *_spellings(flag), dest=f"owned_{flag}", default=None,
                              help=argparse.SUPPRESS)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="babysit",
        description="Run distributed PyTorch training under a babysitter: a drop-in for torchrun "
                    "that detects loss spikes, NaNs, hangs, stragglers and crashes, and recovers.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser(
        "run", help="run a job from a config file, or torchrun-style from a script",
        description="Run CONFIG.yaml, or run SCRIPT like torchrun would (default policy, run "
                    "directory under ./runs). torchrun options given with a config file, before "
                    "or after it, override its launch section. Under srun (one task per node), "
                    "--nnodes, --node-rank, the leader's address and the run directory default "
                    "to the Slurm step's (docs/multinode.md#slurm).",
        epilog="Exit codes: 0 succeeded; 1 failed, do not simply run it again (the job's own "
               "fault, or no progress since the last requeue); 75 failed for a cause outside "
               "the job: requeue without the hosts in RUN_DIR/exclude_hosts; 2 a usage or "
               "config mistake; 128+N stopped by signal N. See docs/multinode.md#exit-codes.",
        allow_abbrev=False)
    run.add_argument("target", metavar="CONFIG.yaml|SCRIPT",
                     help="a run config (.yaml/.yml) or a training script")
    run.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS",
                     help="arguments for the script (torchrun style); after a config file, "
                          "babysit's and torchrun's options, as before it")
    _run_options(run)

    validate = sub.add_parser("validate", help="check a config file without running it")
    validate.add_argument("config", metavar="CONFIG.yaml")

    doctor = sub.add_parser(
        "doctor", help="pre-flight checks before a long run (imports, torch, GPUs, disk, "
        "checkpoint round trip, rendezvous, alert sinks)")
    doctor.add_argument("config", metavar="CONFIG.yaml")
    doctor.add_argument("--send-alert", action="store_true",
                        help="send a real test alert to every sink (default: only probe them)")
    doctor.add_argument("--json", action="store_true", help="one JSON list of results")

    schema = sub.add_parser(
        "schema", help="print the run config reference: every key, its type, default, meaning",
        description="Print the run config reference (section, key, type, default, meaning), "
                    "the same text as docs/config.md; --policy: the policy's (docs/policy.md).")
    schema.add_argument("--policy", action="store_true", help="the policy's reference instead")
    schema.add_argument("--json", action="store_true", help="print the JSON Schema instead")
    schema.add_argument("--write", metavar="PATH",
                        help="write the reference to PATH instead of printing it (to regenerate "
                             "docs/config.md and docs/policy.md)")

    status = sub.add_parser("status", help="state, progress, goodput, incidents and checkpoints "
                                           "of a run")
    status.add_argument("run_dir", metavar="RUN_DIR")
    status.add_argument("--json", action="store_true", help="one JSON object, for scripts")

    report = sub.add_parser("report", help="write an HTML report with plots of a run")
    report.add_argument("run_dir", metavar="RUN_DIR")
    report.add_argument("--out", help="where to write the page (default RUN_DIR/report.html)")

    alert_test = sub.add_parser("alert-test",
                                help="send one test alert to every sink of a config")
    alert_test.add_argument("config", metavar="CONFIG.yaml")

    replay = sub.add_parser(
        "replay", help="run a recorded loss curve through the detectors and a policy",
        description="Replay a TSV/CSV curve (step and loss columns, optional grad norm) or a run "
                    "directory's metrics.jsonl, and print every decision the policy would take.")
    replay.add_argument("curve", metavar="CURVE")
    replay.add_argument("--policy", default="default", help="built-in name or YAML path")
    replay.add_argument("--json", action="store_true", help="one JSON object per decision")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from babysit.supervisor.config.schema import ConfigError
    from babysit.supervisor.services.exporter import ExporterError

    try:
        handler = {"run": _run, "validate": _validate, "schema": _schema, "replay": _replay,
                   "alert-test": _alert_test, "status": _status, "report": _report,
                   "doctor": _doctor}
        return handler[args.command](args)
    except (ConfigError, UsageError, ExporterError) as exc:
        print(f"babysit: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


def _launch_overrides(args: argparse.Namespace) -> dict[str, Any]:
    for flag, why in _OWNED_BY_BABYSIT.items():
        if getattr(args, f"owned_{flag}") is not None:
            print(f"babysit: --{flag} ignored: {why}.", file=sys.stderr)
    overrides = {key: getattr(args, key) for _, key, _ in _TORCHRUN_OPTIONS
                 if getattr(args, key) is not None}
    if args.no_python:
        overrides["no_python"] = True
    passed = [f"--{flag}" for flag in _PASSED_SWITCHES if getattr(args, f"pass_{flag}")]
    for flag in _PASSED_THROUGH:
        value = getattr(args, f"pass_{flag}")
        if value is not None:
            passed += [f"--{flag}", value]
    if passed:
        overrides["torchrun_args"] = passed
    return overrides


def _options_after_config(args: argparse.Namespace) -> None:
    """Options written after the config file (``babysit run train.yaml --nnodes 2``, as
    torchrun users type them) read into ``args`` as if written before it; one given on both
    sides takes the later value."""
    if not args.args:
        return
    tail = argparse.ArgumentParser(prog=f"babysit run {args.target}", add_help=False,
                                   allow_abbrev=False)
    _run_options(tail)
    rest = tail.parse_known_args(args.args, namespace=args)[1]
    args.args = []
    if rest:
        raise UsageError(
            f"arguments after the config file ({' '.join(rest)}) are not babysit's or "
            f"torchrun's options: put script arguments under launch.args in {args.target}.")


def _plan(args: argparse.Namespace) -> Any:
    from babysit.supervisor.config import plan
    from babysit.supervisor.config.slurm import SlurmStep

    config_file = args.target.endswith((".yaml", ".yml")) and not args.module
    if config_file:
        _options_after_config(args)
    try:
        slurm = SlurmStep.from_env()
    except ValueError as exc:
        raise UsageError(f"cannot read the Slurm step this runs in: {exc}; run babysit under "
                         f"srun, one task per node, or unset SLURM_STEP_ID") from None
    overrides = _launch_overrides(args)
    extra: dict[str, Any] = {}
    if args.policy:  # the file's overrides were written for the file's policy
        extra["policy"] = {"name": args.policy, "overrides": {}}
    if args.leader:
        extra.setdefault("nodes", {})["leader"] = args.leader
    if args.spares is not None:
        extra.setdefault("nodes", {})["spares"] = args.spares
    if args.name:
        extra["name"] = args.name
    if args.checkpoint_every is not None:
        if args.checkpoint_every < 0:
            raise UsageError(f"--checkpoint-every {args.checkpoint_every}: give a number of "
                             "steps, or 0 to save no checkpoints.")
        extra["checkpoints"] = {"every_steps": args.checkpoint_every}
    if config_file:
        return plan.from_file(args.target, args.run_dir, overrides, extra, slurm=slurm)
    launch: dict[str, Any] = {"args": list(args.args), **overrides}
    launch["module" if args.module else "script"] = args.target
    return plan.from_mapping({"launch": launch, **extra}, source="command line",
                             base=Path.cwd(), stem="command line", run_dir=args.run_dir,
                             slurm=slurm)


def _run(args: argparse.Namespace) -> int:
    from babysit.supervisor.node.ahead import Early

    # The first attempt's torchrun starts now, its import of torch beside babysit's own start
    # (node/ahead.py); the first launch takes it where it fits, and it is stopped otherwise.
    early = Early() if _early_wanted(args) else None
    try:
        return _supervise(args, early)
    finally:
        if early is not None:
            early.stop()


def _early_wanted(args: argparse.Namespace) -> bool:
    """A config file that turns ``launch.torchrun_ahead`` off, or names another interpreter,
    gets no first torchrun started ahead: a look at its raw YAML (the config is read, checked
    and reported properly later; a file that cannot be read here is that reading's to say)."""
    if args.module or not args.target.endswith((".yaml", ".yml")):
        return True
    import yaml

    try:
        config = yaml.safe_load(Path(args.target).read_text())
    except (OSError, yaml.YAMLError):
        return True
    launch = config.get("launch") if isinstance(config, dict) else None
    if not isinstance(launch, dict):
        return True
    return launch.get("torchrun_ahead") is not False and \
        launch.get("python") in (None, sys.executable)


def _supervise(args: argparse.Namespace, early: Early | None) -> int:
    from babysit.supervisor.run.console import Console
    from babysit.supervisor.run.loop import Supervisor

    plan = _plan(args)
    console = Console()
    if plan.slurm is not None:
        from babysit.supervisor.node import shield

        console.log(plan.slurm.describe())
        if not shield.torchrun_can():
            console.log("babysit: warning: this torch's torchrun has no --signals-to-handle "
                        "(torch 2.9 and later): Slurm's SIGTERM (the time limit's --signal, "
                        "scancel) ends the ranks before babysit can ask for a final checkpoint")
    from babysit.supervisor.commands.doctor import Status, fast_checks, render

    results = fast_checks(plan)
    if any(r.status in (Status.WARN, Status.FAIL) for r in results):
        console.log(render(results, problems_only=True))
    if any(r.status is Status.FAIL for r in results) and not args.skip_doctor:
        console.log("babysit: not starting: fix the failures above, or pass --skip-doctor.")
        return 1
    if not plan.config.launch.multinode:
        from babysit.supervisor.run import slurm_job

        code = Supervisor(plan, console, early=early).run()
        slurm_job.end(plan, console.log)
        return code
    from babysit.supervisor.cluster.roles import run_node

    return run_node(plan, console, early)  # leader or follower, and a follower may take over


def _validate(args: argparse.Namespace) -> int:
    from babysit.supervisor.config import plan

    p = plan.from_file(args.config)
    launch = p.config.launch
    what = f"script {p.script}" if p.script else f"module {launch.module}"
    print(f"{args.config}: OK. Run '{p.name}': {launch.nproc_per_node} worker(s) per node x "
          f"{launch.nnodes} node(s), {what}, policy '{p.config.policy.name}', "
          f"run directory {p.run_dir}.")
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from babysit.supervisor.commands.doctor import doctor_main

    return doctor_main(args.config, args.send_alert, args.json, sys.stdout)


def _status(args: argparse.Namespace) -> int:
    from babysit.supervisor.commands.status import status_main

    return status_main(args.run_dir, args.json, sys.stdout)


def _report(args: argparse.Namespace) -> int:
    from babysit.supervisor.commands.report import report_main

    return report_main(args.run_dir, args.out, sys.stdout)


def _alert_test(args: argparse.Namespace) -> int:
    from babysit.supervisor.config import plan
    from babysit.supervisor.services.alerts import AlertDispatcher

    p = plan.from_file(args.config)
    if not p.config.alerts.sinks:
        print(f"{args.config}: no alert sinks configured (alerts.sinks is empty); alerts are "
              f"only journaled.")
        return 1
    results = AlertDispatcher.from_config(p.config.alerts).test_all(run=p.name)
    for name, ok, detail in results:
        print(f"{name}: {'delivered' if ok else 'FAILED'} ({detail})")
    return 0 if all(ok for _, ok, _ in results) else 1


def _schema(args: argparse.Namespace) -> int:
    from babysit.supervisor.config import reference

    if args.json:
        if args.policy:
            from babysit.policies.schema import Policy

            text = json.dumps(Policy.model_json_schema(), indent=2) + "\n"
        else:
            from babysit.supervisor.config.schema import schema

            text = json.dumps(schema(), indent=2) + "\n"
    else:
        text = reference.policy_reference() if args.policy else reference.config_reference()
    if args.write:
        Path(args.write).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


def _replay(args: argparse.Namespace) -> int:
    from babysit.policies.loader import PolicyError
    from babysit.policies.replay import CurveError, run_replay

    try:
        return run_replay(args.curve, args.policy, args.json, sys.stdout)
    except (CurveError, PolicyError) as exc:
        raise UsageError(str(exc)) from None


if __name__ == "__main__":
    sys.exit(main())
