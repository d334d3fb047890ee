"""Loading policies: built-ins, files, overrides, and the errors a user gets for mistakes."""

from __future__ import annotations

from pathlib import Path

import pytest

from babysit.policies.loader import PolicyError, builtin_names, load_policy
from babysit.policies.schema import Policy
from babysit.policies.types import Action


def write(tmp_path: Path, text: str) -> str:
    p = tmp_path / "policy.yaml"
    p.write_text(text)
    return str(p)


def test_builtins_load_and_default_yaml_matches_the_schema_defaults() -> None:
    assert builtin_names() == ["aggressive", "conservative", "default"]
    for name in builtin_names():
        assert isinstance(load_policy(name, {}), Policy)
    spelled_out = load_policy("default", {}).model_dump(exclude={"description"})
    assert spelled_out == Policy().model_dump(exclude={"description"})


def test_conservative_is_slower_to_act_than_aggressive() -> None:
    c, a = load_policy("conservative", {}), load_policy("aggressive", {})
    assert c.detectors.loss_spike.patience > a.detectors.loss_spike.patience
    assert c.budget.max_interventions < a.budget.max_interventions


def test_every_field_has_a_description() -> None:
    missing = []

    def walk(schema: dict, defs: dict, path: str) -> None:
        for name, prop in schema.get("properties", {}).items():
            if not prop.get("description"):
                missing.append(f"{path}{name}")
            ref = prop.get("$ref") or next((a.get("$ref") for a in prop.get("anyOf", [])
                                            if "$ref" in a), None)
            if ref:
                walk(defs[ref.split("/")[-1]], defs, f"{path}{name}.")

    s = Policy.model_json_schema()
    walk(s, s["$defs"], "")
    assert missing == []


def test_partial_file_keeps_the_defaults_of_what_it_does_not_set(tmp_path: Path) -> None:
    p = load_policy(write(tmp_path, "incidents:\n  straggler:\n    cooldown_s: 60\n"), {})
    assert p.incidents.straggler.cooldown_s == 60
    assert p.incidents.straggler.ladder == [Action.ALERT]
    assert p.incidents.straggler.act_on == "warning"


def test_overrides_deep_merge_nested_and_dotted() -> None:
    p = load_policy("default", {"detectors": {"loss_spike": {"patience": 9}},
                                "rollback.lr_factor": 0.25})
    assert p.detectors.loss_spike.patience == 9
    assert p.detectors.loss_spike.window == 64
    assert p.rollback.lr_factor == 0.25


def test_unknown_key_suggests_the_close_match(tmp_path: Path) -> None:
    path = write(tmp_path, "detectors:\n  loss_spike:\n    patince: 8\n")
    with pytest.raises(PolicyError) as e:
        load_policy(path, {})
    msg = str(e.value)
    assert path in msg
    assert "'detectors.loss_spike.patince'" in msg
    assert "Did you mean 'detectors.loss_spike.patience'?" in msg


def test_unknown_key_in_overrides_says_so() -> None:
    with pytest.raises(PolicyError, match=r"'budgte' in the overrides\. Did you mean 'budget'"):
        load_policy("default", {"budgte": {"max_interventions": 3}})


def test_wrong_type(tmp_path: Path) -> None:
    with pytest.raises(PolicyError) as e:
        load_policy(write(tmp_path, "detectors:\n  loss_spike:\n    window: lots\n"), {})
    msg = str(e.value)
    assert "'detectors.loss_spike.window'" in msg and "'lots'" in msg
    assert "valid integer" in msg and "default (64)" in msg


@pytest.mark.parametrize(("key", "value", "expect"), [
    ("detectors.loss_spike.window", -5, "greater than or equal to 8"),
    ("detectors.loss_spike.patience", 0, "greater than or equal to 1"),
    ("detectors.grad_norm.factor", 0, "greater than 1"),
    ("detectors.loss_spike.min_ratio", 0.9, "greater than 1"),
    ("rollback.lr_factor", 0, "greater than 0"),
    ("budget.window_s", -1, "greater than 0"),
    ("detectors.loss_spike.min_history", 500, "must not exceed window"),
    ("crash.backoff_max_s", 1, "must be >= backoff_base_s"),
])
def test_absurd_values_are_rejected_with_the_key_path(key: str, value: object,
                                                      expect: str) -> None:
    with pytest.raises(PolicyError) as e:
        load_policy("default", {key: value})
    msg = str(e.value)
    assert expect in msg
    assert key.rsplit(".", 1)[0] in msg
    assert "Traceback" not in msg and "pydantic" not in msg.lower()


def test_bad_ladder_action_suggests_the_close_match() -> None:
    with pytest.raises(PolicyError) as e:
        load_policy("default", {"incidents.loss_spike.ladder": ["rolback", "stop"]})
    msg = str(e.value)
    assert "'incidents.loss_spike.ladder.0'" in msg and "Did you mean 'rollback'?" in msg


def test_skip_step_outside_grad_spike_is_refused() -> None:
    with pytest.raises(PolicyError, match="skip_step only makes sense for grad_spike"):
        load_policy("default", {"incidents.loss_spike.ladder": ["skip_step"]})


def test_unknown_builtin_lists_the_builtins() -> None:
    with pytest.raises(PolicyError) as e:
        load_policy("defualt", {})
    msg = str(e.value)
    assert "Did you mean 'default'?" in msg
    assert "aggressive, conservative, default" in msg


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="does not exist"):
        load_policy(str(tmp_path / "nope.yaml"), {})


def test_yaml_syntax_error_names_the_line(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match=r"not valid YAML at line 2, column 12"):
        load_policy(write(tmp_path, "description: x\nbudget: max: 3\n"), {})


def test_non_mapping_file(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="must hold a mapping"):
        load_policy(write(tmp_path, "- a\n- b\n"), {})


def test_new_incidents_have_ladders_in_every_builtin() -> None:
    d, c, a = (load_policy(n, {}) for n in ("default", "conservative", "aggressive"))
    assert d.incidents.rank_departure.ladder == [Action.ALERT]
    assert d.incidents.rank_departure.act_on == "warning"
    assert d.incidents.rank_departure.cooldown_s == 600.0
    assert d.incidents.sdc.ladder == [Action.ROLLBACK, Action.STOP]
    assert d.incidents.sdc.act_on == "critical"
    assert c.incidents.sdc.ladder == [Action.STOP]
    assert a.incidents.sdc.ladder == [Action.ROLLBACK, Action.ROLLBACK, Action.STOP]
    assert d.detectors.throughput.metric == "auto"
    assert d.detectors.sdc.self_check_keys == ("probe",)


def test_new_detector_settings_load_and_are_checked() -> None:
    p = load_policy("default", {"detectors.rank_departure.patience": 20,
                                "detectors.sdc.self_check_keys": ["probe", "probe2"],
                                "detectors.throughput.metric": "mfu"})
    assert p.detectors.rank_departure.patience == 20
    assert p.detectors.sdc.self_check_keys == ("probe", "probe2")
    assert p.detectors.throughput.metric == "mfu"
    with pytest.raises(PolicyError, match="must not exceed window"):
        load_policy("default", {"detectors.rank_departure.min_history": 100})
    with pytest.raises(PolicyError) as e:
        load_policy("default", {"detectors.throughput.metric": "flops"})
    assert "'detectors.throughput.metric'" in str(e.value) and "mfu" in str(e.value)


def test_skip_step_is_refused_for_the_new_incidents() -> None:
    for name in ("rank_departure", "sdc"):
        with pytest.raises(PolicyError, match="skip_step only makes sense for grad_spike"):
            load_policy("default", {f"incidents.{name}.ladder": ["skip_step"]})


def test_babysit_schema_policy_documents_the_new_sections(capsys: pytest.CaptureFixture[str]
                                                          ) -> None:
    import json

    from babysit.supervisor.commands.cli import main

    assert main(["schema", "--policy", "--json"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert {"rank_departure", "sdc"} <= set(schema["$defs"]["Incidents"]["properties"])
    assert {"rank_departure", "sdc"} <= set(schema["$defs"]["Detectors"]["properties"])
    assert "metric" in schema["$defs"]["ThroughputConfig"]["properties"]
