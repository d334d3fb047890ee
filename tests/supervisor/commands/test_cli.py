"""A torchrun command line works under ``babysit run`` as it is: every option of this torch's
``torch.distributed.run`` is accepted, and its output reads as cleanly as under torchrun. And
which runs get their first torchrun started ahead (``node.ahead.Early``)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.run import get_args_parser

from babysit.supervisor.commands import cli
from babysit.supervisor.commands.cli import _launch_overrides, build_parser
from babysit.supervisor.config import schema
from babysit.supervisor.node.launcher import newest_state, rank_prefix, split_rank

SAMPLE = {"nnodes": "1", "nproc_per_node": "2", "node_rank": "0", "master_port": "29500",
          "max_restarts": "1", "monitor_interval": "0.5", "start_method": "spawn",
          "local_ranks_filter": "0,1", "numa_binding": "node", "redirects": "3", "tee": "3",
          "shutdown_timeout": "30"}


def torchrun_options() -> list[argparse.Action]:
    return [a for a in get_args_parser()._actions
            if a.option_strings and a.dest != "help"]


@pytest.mark.parametrize("action", torchrun_options(), ids=lambda a: a.option_strings[0])
def test_every_torchrun_option_is_accepted(action: argparse.Action,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    for spelling in action.option_strings:
        argv = ["run", spelling]
        if action.nargs != 0:
            argv.append(SAMPLE.get(action.dest, "x"))
        args = build_parser().parse_args([*argv, "train.py", "--lr", "1"])
        assert args.target == "train.py" and args.args == ["--lr", "1"]
        _launch_overrides(args)  # accepted, or noted on stderr: never an error


def test_unmodelled_options_reach_torchrun_and_modelled_ones_the_config() -> None:
    args = build_parser().parse_args(
        ["run", "--local-ranks-filter", "0", "--signals-to-handle", "SIGTERM",
         "--virtual-local-rank", "--nproc-per-node", "2", "train.py"])
    overrides = _launch_overrides(args)
    assert overrides["torchrun_args"] == ["--virtual-local-rank", "--signals-to-handle",
                                          "SIGTERM"]
    config = schema.parse({"launch": {"script": "train.py", **overrides}}, "command line")
    assert config.launch.local_ranks_filter == [0]


def test_options_babysit_owns_are_noted_not_refused(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["run", "-t", "3", "--log-dir", "/tmp/x", "train.py"])
    assert "torchrun_args" not in _launch_overrides(args)
    err = capsys.readouterr().err
    assert "--tee ignored" in err and "--log-dir ignored" in err


def test_torchrun_prefixes_inside_a_redrawn_bar_are_removed() -> None:
    # torchrun prefixes every read of the rank's log; tqdm's partial lines are read in pieces.
    raw = ("[default1]:Epoch 0:  10%|█         | 1/10 [00:00<00:01]\r[default1]:Epoch 0:  20%|██"
           "        | 2/10 [00:00<00:01]\r[default1]:Epoch 0: 100%|██████████| 10/10 [00:01<00:00]")
    line = split_rank(raw, rank_prefix())
    assert line.rank == 1 and "[default" not in line.text
    assert newest_state(line.text) == "Epoch 0: 100%|██████████| 10/10 [00:01<00:00]"
    assert split_rank("[trainer3]:hello", rank_prefix("trainer")) == split_rank(
        "[default3]:hello", rank_prefix())
    assert split_rank("[default0]:hi", rank_prefix("trainer")).rank is None  # not a worker's


def test_a_config_that_turns_torchrun_ahead_off_gets_no_first_torchrun_started_ahead(
        tmp_path: Path) -> None:
    def wanted(text: str | None, *args: str) -> bool:
        target = tmp_path / "run.yaml"
        if text is not None:
            target.write_text(text)
        return cli._early_wanted(cli.build_parser().parse_args(["run", *args, str(target)]))

    assert wanted("launch: {script: t.py}\n")
    assert not wanted("launch: {script: t.py, torchrun_ahead: false}\n")
    assert not wanted("launch: {script: t.py, python: /opt/other/bin/python}\n")
    assert wanted(f"launch: {{script: t.py, python: {sys.executable}}}\n")
    # What the config's own reading reports is left to it: started, then stopped if unfit.
    assert wanted("launch: [not, a, mapping]\n") and wanted("{{ not yaml")
    (tmp_path / "run.yaml").unlink()
    assert wanted(None)
    assert cli._early_wanted(cli.build_parser().parse_args(["run", "train.py"]))


def test_options_after_the_config_file_are_read_as_before_it(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    """As torchrun users type them (and the Kubernetes recipe does): ``babysit run train.yaml
    --nnodes 2 ...``. One given on both sides takes the later value."""
    for key in [k for k in os.environ if k.startswith("SLURM")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("BABYSIT_SECRET", "a secret of at least sixteen characters")
    (tmp_path / "train.py").write_text("")
    config = tmp_path / "train.yaml"
    config.write_text(f"launch: {{script: {tmp_path / 'train.py'}, nnodes: 4}}\n")

    def plan(*argv: str) -> Any:
        return cli._plan(build_parser().parse_args(["run", *argv]))

    after = plan(str(config), "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "h0:29400",
                 "--run-dir", str(tmp_path / "r"), "--spares", "1", "--max-restarts", "3")
    before = plan("--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "h0:29400",
                  "--run-dir", str(tmp_path / "r"), "--spares", "1", "--max-restarts", "3",
                  str(config))
    assert after.config == before.config and after.run_dir == before.run_dir
    assert after.config.launch.nnodes == "2" and after.node_rank == 1
    assert after.config.nodes.spares == 1 and after.run_dir == tmp_path / "r" / "nodes" / "1"
    both = plan("--node-rank", "0", str(config), "--node-rank", "1", "--rdzv-endpoint", "h:1",
                "--run-dir", str(tmp_path / "r"))
    assert both.node_rank == 1


def test_what_follows_a_config_file_and_is_no_option_says_where_it_goes(
        tmp_path: Path) -> None:
    config = tmp_path / "train.yaml"
    config.write_text("launch: {script: train.py}\n")
    args = build_parser().parse_args(["run", str(config), "--nnodes", "2", "--lr", "3e-4"])
    with pytest.raises(cli.UsageError) as raised:
        cli._plan(args)
    assert "--lr 3e-4" in str(raised.value) and "launch.args" in str(raised.value)
    assert "--nnodes" not in str(raised.value)  # that one was read
