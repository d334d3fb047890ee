"""`babysit schema` is a reference a person reads, and docs/config.md / docs/policy.md are that
same text: regenerated here and compared, so they can never drift from the field docstrings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import BaseModel

from babysit.policies.schema import Policy
from babysit.supervisor.commands.cli import main
from babysit.supervisor.config import reference
from babysit.supervisor.config.schema import RunConfig
from tests.conftest import ROOT

DOCS = ROOT / "docs"


@pytest.mark.parametrize(("name", "build", "command"), [
    ("config.md", reference.config_reference, "babysit schema --write docs/config.md"),
    ("policy.md", reference.policy_reference, "babysit schema --policy --write docs/policy.md"),
])
def test_the_docs_are_the_generated_reference(name: str, build, command: str) -> None:
    assert (DOCS / name).read_text() == build(), f"docs/{name} is stale: run `{command}`"


def leaves(model: type[BaseModel], path: str = "") -> list[str]:
    out = []
    for name, field in model.model_fields.items():
        sub = f"{path}.{name}" if path else name
        nested = reference._model_of(field.annotation)
        if field.exclude:  # derived from another key, never written by the user
            continue
        if nested is None:
            out.append(sub)
        else:
            out += leaves(nested, f"{sub}[]" if reference._is_list(field.annotation) else sub)
    return out


def test_every_key_has_its_type_default_and_meaning() -> None:
    text = reference.config_reference()
    for key in leaves(RunConfig):
        (line,) = [ln for ln in text.splitlines() if ln.startswith(f"- `{key}`: ")]
        assert "Default: `" in line or "Required." in line, line
        after = text.split(line + "\n", 1)[1]
        assert after.startswith("  ") and len(after.split("\n")[0]) > 10, key  # a meaning
    assert "- `prometheus.port`: int, >= 0, <= 65535. Default: `9478`." in text
    assert "- `launch.nproc_per_node`: int or \"auto\" | \"cpu\" | \"gpu\". Default: `1`." in text
    assert "## `alerts.sinks[]`" in text and "- `alerts.sinks[].name`: string. Required." in text
    assert all(len(ln) <= 100 for ln in text.splitlines() if not ln.startswith("- `"))
    policy = reference.policy_reference()
    # Each incident's own defaults, not the model's: the ladders differ.
    hang = next(ln for ln in policy.splitlines() if ln.startswith("- `incidents.hang.ladder`"))
    assert hang.endswith('Default: `["relaunch", "relaunch", "stop"]`.')
    assert len(leaves(Policy)) == policy.count("\n- `")


def test_the_cli_prints_the_reference_and_json_on_request(tmp_path: Path, capsys) -> None:
    assert main(["schema"]) == 0
    assert capsys.readouterr().out == (DOCS / "config.md").read_text()
    assert main(["schema", "--policy", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["title"] == "Policy"
    assert main(["schema", "--policy", "--write", str(tmp_path / "p.md")]) == 0
    assert (tmp_path / "p.md").read_text() == (DOCS / "policy.md").read_text()
