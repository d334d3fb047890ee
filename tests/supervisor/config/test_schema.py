"""Config errors a user can make: each names the file, the key path and what to do, and
``babysit validate`` prints them without a traceback."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from babysit.supervisor.commands.cli import main
from babysit.supervisor.config import plan
from babysit.supervisor.config import schema as config
from tests.conftest import WORKERS


def error_of(path: Path, **kw: object) -> str:
    with pytest.raises(config.ConfigError) as info:
        plan.from_file(path, **kw)  # type: ignore[arg-type]
    return str(info.value)


def test_valid_config_resolves_paths_against_its_folder(write_config, tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("print('hi')\n")
    path = write_config("launch:\n  script: train.py\n  nproc-per-node: 2\nrun_dir: out\n")
    p = plan.from_file(path)
    assert p.script == tmp_path / "train.py"
    assert p.config.launch.nproc_per_node == 2
    assert p.world_size == 2
    assert p.name == "run"


def test_dash_and_underscore_spellings_are_equal(write_config, tmp_path: Path) -> None:
    (tmp_path / "t.py").write_text("")
    a = plan.from_file(write_config("launch: {script: t.py, nproc_per_node: 3, node-rank: 0}\n"))
    b = plan.from_file(write_config("launch: {script: t.py, nproc-per-node: 3}\n", "b.yaml"))
    assert a.config.launch == b.config.launch


def test_env_names_are_kept_verbatim(write_config, tmp_path: Path) -> None:
    (tmp_path / "t.py").write_text("")
    p = plan.from_file(write_config("launch: {script: t.py, env: {MY-VAR: '1', A_B: x}}\n"))
    assert p.config.launch.env == {"MY-VAR": "1", "A_B": "x"}


def test_unknown_key_names_path_and_suggests(write_config, tmp_path: Path) -> None:
    (tmp_path / "t.py").write_text("")
    msg = error_of(write_config("launch:\n  script: t.py\n  nproc_per_nod: 2\n"))
    assert "run.yaml: launch.nproc_per_nod: unknown key" in msg
    assert "Did you mean 'nproc_per_node'?" in msg


def test_unknown_top_level_key_lists_known_keys(write_config) -> None:
    msg = error_of(write_config("launch: {script: t.py}\nzzz: 1\n"))
    assert "zzz: unknown key" in msg and "launch" in msg


def test_wrong_type_names_key_and_value(write_config, tmp_path: Path) -> None:
    (tmp_path / "t.py").write_text("")
    msg = error_of(write_config("launch:\n  script: t.py\n  nproc-per-node: two\n"))
    assert "launch.nproc_per_node" in msg and "'two'" in msg and "babysit schema" in msg


def test_missing_launch_section(write_config) -> None:
    msg = error_of(write_config("run_dir: x\n"))
    assert "launch: required key is missing" in msg


def test_script_and_module_are_exclusive(write_config) -> None:
    msg = error_of(write_config("launch: {script: a.py, module: pkg.train}\n"))
    assert "exactly one of launch.script" in msg


def test_missing_script_says_where_it_looked(write_config, tmp_path: Path) -> None:
    msg = error_of(write_config("launch: {script: trian.py}\n"))
    assert "launch.script: file 'trian.py' not found" in msg
    assert str(tmp_path / "trian.py") in msg


def test_unwritable_run_dir(write_config, tmp_path: Path) -> None:
    # A path under a regular file can never be created, whoever runs the test.
    (tmp_path / "t.py").write_text("")
    msg = error_of(write_config(f"launch: {{script: t.py}}\nrun_dir: {tmp_path}/t.py/run\n"))
    assert "run_dir: cannot write" in msg and "is a file, not a folder" in msg


def test_broken_yaml_names_line(write_config) -> None:
    msg = error_of(write_config("launch:\n  script: t.py\n   bad: [\n"))
    assert "run.yaml: line" in msg and "invalid YAML" in msg


def test_non_mapping_yaml(write_config) -> None:
    assert "expected a mapping" in error_of(write_config("- a\n- b\n"))


def test_missing_file() -> None:
    assert "no such file" in error_of(Path("/nonexistent/run.yaml"))


def test_several_problems_are_all_reported(write_config) -> None:
    msg = error_of(write_config("launch:\n  script: t.py\n  nnodes: 1:x\n  bogus: 1\n"))
    assert "launch.nnodes" in msg and "launch.bogus" in msg


def test_validate_prints_errors_without_traceback(write_config, capsys) -> None:
    path = write_config("launch:\n  script: missing.py\n")
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("babysit: error:") and "Traceback" not in err


def test_validate_ok(write_config, capsys) -> None:
    path = write_config(f"launch: {{script: {WORKERS / 'tiny_train.py'}, nproc-per-node: 2}}\n")
    assert main(["validate", str(path)]) == 0
    assert "OK" in capsys.readouterr().out


def test_schema_documents_every_field(capsys) -> None:
    assert main(["schema", "--json"]) == 0
    schema = json.loads(capsys.readouterr().out)
    launch = schema["$defs"]["LaunchConfig"]["properties"]
    assert "nproc_per_node" in launch
    undocumented = [
        f"{name}.{field}"
        for name, model in schema["$defs"].items() if "properties" in model
        for field, spec in model["properties"].items() if not spec.get("description")
    ]
    assert undocumented == []


def test_cli_rejects_args_after_config(write_config, capsys) -> None:
    path = write_config("launch: {script: t.py}\n")
    assert main(["run", str(path), "--lr", "1"]) == 2
    assert "launch.args" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["demo.yaml", "demo-spike.yaml", "demo-hang.yaml"])
def test_shipped_configs_validate(name: str, capsys) -> None:
    from tests.conftest import ROOT

    assert main(["validate", str(ROOT / "configs" / name)]) == 0
    assert "OK" in capsys.readouterr().out


def test_run_refuses_to_start_when_a_fast_check_fails(tmp_path: Path, capsys) -> None:
    script = tmp_path / "train.py"
    script.write_text("import no_such_module_xyz\n")
    assert main(["run", "--run-dir", str(tmp_path / "run"), str(script)]) == 1
    out = capsys.readouterr().out
    assert "no_such_module_xyz" in out and "not starting" in out and "--skip-doctor" in out
    assert not (tmp_path / "run").exists()  # refused before anything was created


def test_a_run_dir_owned_by_someone_else_is_refused(write_config, tmp_path: Path) -> None:
    (tmp_path / "t.py").write_text("")
    if os.geteuid() == 0:
        theirs, owner = tmp_path / "theirs", 65534
        theirs.mkdir()
        os.chown(theirs, owner, owner)  # nobody's
    else:
        theirs, owner = Path("/"), 0  # root's, and we are not root
    msg = error_of(write_config(f"launch: {{script: t.py}}\nrun_dir: {theirs}\n"))
    assert "run_dir:" in msg and f"belongs to uid {owner}" in msg and "choose another" in msg


def test_torchrun_style_runs_checkpoint_by_default_and_the_flag_overrides(
        write_config, tmp_path: Path) -> None:
    from babysit.supervisor.commands.cli import DEFAULT_CHECKPOINT_EVERY, _plan, build_parser

    def checkpoints(*argv: str) -> config.CheckpointConfig:
        args = build_parser().parse_args(["run", "--run-dir", str(tmp_path / "r"), *argv])
        return _plan(args).config.checkpoints

    script = str(WORKERS / "plain_train.py")
    default = checkpoints("--nproc-per-node", "2", script, "--steps", "5")
    # No config to set a cadence: a fixed start, then the measured advice takes over.
    assert (default.every_steps, default.cadence.auto) == (DEFAULT_CHECKPOINT_EVERY, True)
    # The user's number is the user's word: no auto adoption; 0 saves nothing.
    given = checkpoints("--checkpoint-every", "7", script)
    assert (given.every_steps, given.cadence.auto) == (7, False)
    assert checkpoints("--checkpoint-every", "0", script).every_steps == 0
    # With a config: it overrides checkpoints.every_steps and keeps the section's other keys.
    path = write_config(f"launch: {{script: {script}}}\n"
                        "checkpoints: {every_steps: 50, keep: 9}\n")
    from_file = checkpoints("--checkpoint-every", "20", str(path))
    assert (from_file.every_steps, from_file.keep) == (20, 9)
    assert main(["run", "--checkpoint-every", "-1", script]) == 2
    # One default: a config that says nothing of checkpoints keeps state as the command line
    # does, and says so; `auto` is the same; 0 turns it off, and says that.
    bare = checkpoints(str(write_config(f"launch: {{script: {script}}}\n")))
    assert bare == default == config.CheckpointConfig.model_validate({"every_steps": "auto"})
    assert DEFAULT_CHECKPOINT_EVERY == config.DEFAULT_EVERY_STEPS
    assert "keeping a checkpoint every 100 steps, then as this run's costs advise" in bare.said()
    assert "the last completed step after a fault" in bare.said()
    off = checkpoints(str(write_config(f"launch: {{script: {script}}}\n"
                                       "checkpoints: {every_steps: 0}\n")))
    assert "keeping no state (checkpoints.every_steps: 0)" in off.said()



def test_one_node_rendezvous_is_static_several_are_c10d_and_a_choice_is_kept(
        write_config, tmp_path: Path) -> None:
    # torchrun's static rendezvous on one node: its store without c10d's join protocol.
    (tmp_path / "train.py").write_text("print('hi')\n")
    one = plan.from_file(write_config("launch: {script: train.py}\n"))
    assert one.config.launch.rdzv_backend is None and one.config.launch.rendezvous == "static"
    many = config.LaunchConfig(script="train.py", nnodes="1:4")
    assert many.rendezvous == "c10d"
    chosen = config.LaunchConfig(script="train.py", rdzv_backend="c10d")
    assert chosen.rendezvous == "c10d"
    from babysit.supervisor.node.launcher import torchrun_command

    cmd = torchrun_command(one.config.launch, one.script, python="python", rdzv_id="r-0",
                           rdzv_endpoint="127.0.0.1:29500", log_dir=tmp_path)
    assert cmd[cmd.index("--rdzv-backend") + 1] == "static"
    assert cmd[cmd.index("--node-rank") + 1] == "0"  # the static rendezvous reads it
    node = config.LaunchConfig(script="train.py", nnodes="2", node_rank=1)
    cmd = torchrun_command(node, Path("train.py"), python="python", rdzv_id="r-0",
                           rdzv_endpoint="10.0.0.1:29400", log_dir=tmp_path)
    # c10d ignores it (the rendezvous orders the nodes), and torchrun warns that it does.
    assert "--node-rank" not in cmd and cmd[cmd.index("--rdzv-backend") + 1] == "c10d"
