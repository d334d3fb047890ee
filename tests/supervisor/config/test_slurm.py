"""What a run takes from the Slurm step it runs in (``config.slurm``): read from ``srun``'s
environment, what the user gave wins, and a step babysit cannot run as is refused with what to
change. The real thing, under a real cluster: ``tests/e2e/test_slurm.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from babysit.supervisor.config import plan
from babysit.supervisor.config.schema import ConfigError
from babysit.supervisor.config.slurm import SlurmStep, first_host, leader_port, under_srun

STEP = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_NODES": "4",
        "SLURM_STEP_NUM_TASKS": "4", "SLURM_NODEID": "2", "SLURM_STEP_NODELIST": "gpu[007-010]",
        "SLURMD_NODENAME": "gpu009"}
"""What ``srun`` tells the task on the third node of a 4-node step of job 4242."""


@pytest.mark.parametrize(("nodelist", "first"), [
    ("n0", "n0"), ("n[0-1]", "n0"), ("gpu[007-010,012],cpu3", "gpu007"),
    ("gpu[012,007-010]", "gpu012"), ("rack[1-2]-node[01-04]", "rack1-node01"),
    ("a,b[1-3]", "a"), ("node-7.cluster", "node-7.cluster"),
])
def test_the_first_host_of_a_slurm_host_list(nodelist: str, first: str) -> None:
    assert first_host(nodelist) == first


@pytest.mark.parametrize("nodelist", ["", "n[0-", "[1-2]x]"])
def test_a_host_list_that_does_not_read_is_said(nodelist: str) -> None:
    with pytest.raises(ValueError, match="not a Slurm host list"):
        first_host(nodelist)


def test_the_step_as_srun_tells_it() -> None:
    step = SlurmStep.from_env(STEP)
    assert step == SlurmStep(job_id="4242", nodes=4, tasks=4, node_id=2,
                             nodelist="gpu[007-010]", node_name="gpu009")
    assert step.leader == f"gpu007:{leader_port('4242')}" == "gpu007:24242"
    assert leader_port("14242") == leader_port("4242")  # the job id modulo 10000


def test_outside_srun_nothing_is_read() -> None:
    """A batch script's own shell (no step of babysit's) or no Slurm at all."""
    batch = {k: v for k, v in STEP.items() if not k.startswith("SLURM_STEP")}
    assert SlurmStep.from_env(batch) is None and not under_srun(batch)
    assert SlurmStep.from_env({}) is None


def test_a_variable_that_does_not_read_is_named() -> None:
    with pytest.raises(ValueError, match="SLURM_NODEID='x' is not a number"):
        SlurmStep.from_env({**STEP, "SLURM_NODEID": "x"})


@pytest.fixture
def config(tmp_path: Path) -> Path:
    (tmp_path / "train.py").write_text("")
    path = tmp_path / "train.yaml"
    path.write_text(f"launch: {{script: {tmp_path / 'train.py'}, nproc-per-node: 8}}\n")
    return path


@pytest.fixture(autouse=True)
def _secret(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("BABYSIT_SECRET", "a secret of at least sixteen characters")
    monkeypatch.chdir(tmp_path)


def test_what_the_user_left_unset_comes_from_the_step(config: Path, tmp_path: Path) -> None:
    p = plan.from_file(config, slurm=SlurmStep.from_env(STEP))
    launch = p.config.launch
    assert launch.nnodes == "4" and p.node_rank == 2
    assert p.leader_address == "gpu007:24242" and launch.rdzv_endpoint is None
    assert p.shared_dir == tmp_path / "runs" / "train-4242"  # the same on every node
    assert p.run_dir == p.shared_dir / "nodes" / "2"
    assert p.slurm is not None and p.slurm.to_json() == {
        "job_id": "4242", "node": "gpu009", "took": {
            "launch.nnodes": "4 (SLURM_STEP_NUM_NODES)",
            "launch.node_rank": "2 (SLURM_NODEID)",
            "nodes.leader": "gpu007:24242 (SLURM_STEP_NODELIST, SLURM_JOB_ID)",
            "run_dir": f"{tmp_path / 'runs' / 'train-4242'} (SLURM_JOB_ID)"}}
    assert "took launch.nnodes 4 (SLURM_STEP_NUM_NODES)" in p.slurm.describe()


def test_what_the_user_gives_wins(config: Path, tmp_path: Path) -> None:
    config.write_text(config.read_text().replace("nproc-per-node: 8", "nproc-per-node: 8, "
                                                 "node-rank: 3, rdzv-endpoint: 'h:29400'")
                      + "nodes: {spares: 1}\n")
    p = plan.from_file(config, run_dir=str(tmp_path / "shared"),
                       launch_overrides={"nnodes": "2:4"}, slurm=SlurmStep.from_env(STEP))
    assert p.config.launch.nnodes == "2:4" and p.node_rank == 3
    assert p.leader_address == "h:29401" and p.shared_dir == tmp_path / "shared"
    assert p.slurm is not None and p.slurm.keys == {}
    assert p.slurm.describe().endswith("took nothing (all given)")
    named = plan.from_file(config, overrides={"nodes": {"leader": "head:1234"}},
                           slurm=SlurmStep.from_env(STEP))
    assert named.leader_address == "head:1234" and "nodes.leader" not in named.slurm.keys


def test_a_one_node_step_is_a_one_node_run(config: Path) -> None:
    one = {**STEP, "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NUM_TASKS": "1", "SLURM_NODEID": "0",
           "SLURM_STEP_NODELIST": "gpu007"}
    p = plan.from_file(config, slurm=SlurmStep.from_env(one))
    assert not p.config.launch.multinode and p.run_dir.name == "train-4242"
    assert p.slurm is not None and set(p.slurm.keys) == {"launch.nnodes", "run_dir"}


def test_a_one_node_config_on_several_nodes_is_refused(config: Path) -> None:
    """Each node would run a one-node job of its own, into one run directory."""
    config.write_text(config.read_text().replace("nproc-per-node: 8", "nproc-per-node: 8, "
                                                 "nnodes: 1"))
    with pytest.raises(ConfigError, match=r"runs babysit on 4 nodes, but launch\.nnodes is 1"):
        plan.from_file(config, slurm=SlurmStep.from_env(STEP))


def test_several_babysitters_on_a_node_are_refused(config: Path) -> None:
    with pytest.raises(ConfigError, match=r"runs 32 tasks on 4 node.*--ntasks-per-node=1"):
        plan.from_file(config, slurm=SlurmStep.from_env({**STEP, "SLURM_STEP_NUM_TASKS": "32"}))
