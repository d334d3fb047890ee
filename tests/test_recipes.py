"""Every scheduler recipe in the docs runs as written, or at least its babysit command line
reads as babysit reads it.

The Slurm job script of docs/multinode.md is submitted as written to a real Slurm cluster by
``tests/e2e/test_slurm.py`` (``slurm_script``, ``elastic_step`` below give it the text). Where
no real scheduler can run here (Kubernetes), and for every other ``babysit run`` line of the
README and the docs, the command line is expanded by a real shell (its variables set as the
scheduler would) and parsed by babysit's own command line into a plan: options before or after
the config file, every one landing in the key it names.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from babysit.supervisor.commands import cli

ROOT = Path(__file__).resolve().parent.parent
MULTINODE = ROOT / "docs" / "multinode.md"


def code_blocks(text: str, language: str) -> list[str]:
    """The fenced code blocks of ``language`` in Markdown ``text``, in order."""
    return re.findall(rf"```{language}\n(.*?)```", text, re.DOTALL)


def section(title: str) -> str:
    """The text of docs/multinode.md's section ``## title``."""
    return MULTINODE.read_text().split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def slurm_script() -> str:
    """The Slurm job script of docs/multinode.md, as written."""
    script = code_blocks(section("Slurm"), "bash")[0]
    assert script.startswith("#!/bin/bash\n") and "srun" in script
    return script


def elastic_step() -> str:
    """The docs' step for a job that goes on without a lost node (its ``srun`` line)."""
    [step] = [b.strip() for b in code_blocks(section("Slurm"), "bash")
              if b.startswith("srun") and "--nnodes" in b]
    return step


def _babysit_lines(text: str) -> list[tuple[str, bool]]:
    """Every ``babysit run`` command of a shell block (continued lines joined, comments off),
    and whether ``srun`` starts it."""
    text = text.replace("\\\n", " ")
    lines = []
    for line in text.splitlines():
        line = line.split(" #", 1)[0].strip()
        if "babysit run" in line:
            at = line.index("babysit run")
            lines.append((line[at:], line[:at].lstrip().startswith("srun")))
    return lines


def documented_runs() -> list[tuple[str, bool]]:
    """The ``babysit run`` lines with a config file of the README's and the docs' shell blocks,
    each with whether ``srun`` starts it (a torchrun-style line is torchrun's order)."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in code_blocks(path.read_text(), "bash"):
            found += [(line, srun) for line, srun in _babysit_lines(block)
                      if re.search(r"\S+\.ya?ml\b", line)]
    return found


def kubernetes_args() -> str:
    """The babysit command of docs/multinode.md's Kubernetes Job, as its container runs it."""
    [manifest] = code_blocks(section("Kubernetes"), "yaml")
    docs = list(yaml.safe_load_all(manifest))
    [job] = [d for d in docs if d.get("kind") == "Job"]
    [container] = job["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["bash", "-c"]
    [args] = container["args"]
    return str(args)


def expand(line: str, env: dict[str, str]) -> list[str]:
    """``line`` as bash would hand it to babysit, with ``env`` set."""
    done = subprocess.run(["bash", "-c", f"printf '%s\\0' {line}"], capture_output=True,
                          text=True, env={**os.environ, **env}, timeout=30, check=True)
    return done.stdout.split("\0")[:-1]


def plan_of(argv: list[str], config: Path) -> Any:
    """The plan ``babysit run ARGV`` would run, the config file named in it replaced by
    ``config``."""
    argv = [str(config) if a.endswith((".yaml", ".yml")) else a for a in argv]
    args = cli.build_parser().parse_args(argv[1:] if argv[0] == "babysit" else argv)
    return cli._plan(args)


@pytest.fixture
def config(tmp_path: Path) -> Path:
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    path = tmp_path / "train.yaml"
    path.write_text(f"launch: {{script: {script}, nproc-per-node: 2}}\n")
    return path


SCHEDULER_ENV = {"R": "1", "SLURM_NNODES": "4", "JOB_COMPLETION_INDEX": "2",
                 "BABYSIT_SECRET": "a secret of at least sixteen characters"}
"""What the recipes' variables are when they run: a node rank (the README's ``$R``), Slurm's
node count, Kubernetes's Indexed Job index."""
SRUN_ENV = {"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_NODES": "4",
            "SLURM_STEP_NUM_TASKS": "4", "SLURM_NODEID": "1", "SLURMD_NODENAME": "gpu02",
            "SLURM_STEP_NODELIST": "gpu[01-04]"}
"""What ``srun`` tells node 1's task of a 4-node step of job 42."""


@pytest.mark.parametrize(("line", "srun"), documented_runs(), ids=lambda v: str(v))
def test_every_documented_babysit_run_line_reads_as_babysit_reads_it(
        line: str, srun: bool, config: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    for key in [k for k in os.environ if k.startswith("SLURM")]:
        monkeypatch.delenv(key)
    env = {**SCHEDULER_ENV, **(SRUN_ENV if srun else {})}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    argv = expand(line.replace("/shared/", f"{tmp_path}/shared/"), env)
    monkeypatch.chdir(tmp_path)
    plan = plan_of(argv, config)
    if srun:  # what the user left unset comes from the step
        assert plan.node_rank == 1 and plan.leader_address == "gpu01:20042"
        assert plan.shared_dir == tmp_path / "runs" / "train-42"
    # Every option given, wherever it stands, landed in the plan.
    launch = plan.config.launch
    for flag, key, _ in cli._TORCHRUN_OPTIONS:
        if f"--{flag}" in argv:
            assert str(getattr(launch, key)) == argv[argv.index(f"--{flag}") + 1], (flag, line)
    if "--run-dir" in argv:
        assert plan.shared_dir == Path(argv[argv.index("--run-dir") + 1]).resolve()


def test_the_kubernetes_job_gives_each_pod_its_node_rank_after_the_config_file(
        config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No Kubernetes here: the container's command line, expanded as its shell would with
    the index the Indexed Job sets, read by babysit's parser into the plan a pod would run."""
    args = kubernetes_args().replace("/shared/", f"{tmp_path}/shared/")
    for key, value in SCHEDULER_ENV.items():
        monkeypatch.setenv(key, value)
    argv = expand(args, SCHEDULER_ENV)
    assert argv[:2] == ["babysit", "run"] and argv[2].endswith(".yaml")  # options after it
    plan = plan_of(argv, config)
    assert plan.config.launch.nnodes == "4" and plan.node_rank == 2
    assert plan.config.launch.rdzv_endpoint == "llm-0.llm:29400"
    assert plan.leader_address == "llm-0.llm:29401"
    assert plan.shared_dir == tmp_path / "shared" / "runs" / "llm"


def test_the_slurm_recipe_runs_babysit_with_the_config_alone() -> None:
    """What ``srun`` starts on every node: babysit and the config, everything else from the
    step (the script itself runs on a real cluster: ``tests/e2e/test_slurm.py``)."""
    step = [line for line in slurm_script().splitlines() if line.startswith("srun")]
    assert step == ["srun --no-kill babysit run train.yaml"]
    assert shlex.split(elastic_step())[:5] == ["srun", "--no-kill", "babysit", "run",
                                               "train.yaml"]
