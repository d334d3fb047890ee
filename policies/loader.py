"""Loading a policy: a built-in by name or a YAML file by path, plus overrides.

Errors a user can cause (a typo, a wrong type, an absurd value, a missing file) raise
``PolicyError`` with one paragraph per problem: which file, which key path, what was wrong and
what to do. Never a pydantic traceback.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails, PydanticUndefined

from babysit.policies.schema import Policy

BUILTIN_DIR = Path(__file__).resolve().parent


class PolicyError(Exception):
    """A policy could not be loaded; the message says where and what to do."""


def builtin_names() -> list[str]:
    return sorted(p.stem for p in BUILTIN_DIR.glob("*.yaml"))


def load_policy(name_or_path: str, overrides: dict[str, Any] | None = None) -> Policy:
    """Load a built-in policy (``"default"``) or a YAML file (``"my/policy.yaml"``).

    ``overrides`` deep-merge over the file, e.g. ``{"detectors": {"loss_spike": {"patience":
    8}}}``; dotted keys are accepted too (``{"detectors.loss_spike.patience": 8}``).
    """
    path = _resolve(name_or_path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise PolicyError(f"Cannot read policy file {path}: {e.strerror}. Check the path and "
                          "its permissions.") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        raise PolicyError(f"Policy file {path} is not valid YAML{where}: {problem}. Fix the "
                          "syntax there (indentation and ':' after keys are the usual "
                          "suspects).") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise PolicyError(f"Policy file {path} must hold a mapping of sections (detectors, "
                          f"incidents, rollback, crash, budget), not a {type(data).__name__}.")
    expanded = _expand(overrides or {})
    # Merge over the schema's defaults rather than validating the file alone: a file that sets
    # only `incidents.straggler.cooldown_s` must keep that incident's default ladder, not fall
    # back to the generic Response defaults.
    merged = _deep_merge(_deep_merge(Policy().model_dump(mode="json"), data), expanded)
    try:
        return Policy.model_validate(merged)
    except ValidationError as e:
        raise PolicyError(
            "\n\n".join(_explain(err, path, expanded) for err in e.errors())
        ) from None


def _resolve(name_or_path: str) -> Path:
    looks_like_path = any(c in name_or_path for c in "/\\") or name_or_path.endswith(
        (".yaml", ".yml"))
    if looks_like_path:
        path = Path(name_or_path).expanduser()
        if not path.is_file():
            raise PolicyError(f"Policy file {path} does not exist. Give an existing YAML file "
                              f"or a built-in policy name ({', '.join(builtin_names())}).")
        return path
    path = BUILTIN_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        close = difflib.get_close_matches(name_or_path, builtin_names(), n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise PolicyError(f"No built-in policy named '{name_or_path}'.{hint} Built-ins: "
                          f"{', '.join(builtin_names())}; or give the path of a YAML file.")
    return path


def _expand(overrides: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in overrides.items():
        parts = str(key).split(".")
        node = out
        for part in parts[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = node[part] = {}
            node = child
        leaf = parts[-1]
        if isinstance(value, dict):
            node[leaf] = _deep_merge(node.get(leaf, {}) if isinstance(node.get(leaf), dict)
                                     else {}, _expand(value))
        else:
            node[leaf] = value
    return out


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _in_overrides(loc: tuple[str | int, ...], overrides: dict[str, Any]) -> bool:
    node: Any = overrides
    for part in loc:
        in_list = isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node)
        if not (in_list or (isinstance(node, dict) and part in node)):
            return False
        node = node[part]
    return True


def _model_at(loc: tuple[str | int, ...]) -> tuple[type[BaseModel] | None, FieldInfo | None]:
    """The model that holds ``loc``'s last key, and that key's field (if it is one)."""
    model: type[BaseModel] | None = Policy
    field: FieldInfo | None = None
    for i, part in enumerate(loc):
        if model is None or not isinstance(part, str):
            return (model, None) if i == len(loc) - 1 else (None, None)
        field = model.model_fields.get(part)
        if i == len(loc) - 1:
            return model, field
        ann = field.annotation if field else None
        model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
    return model, field


def _explain(err: ErrorDetails, path: Path, overrides: dict[str, Any]) -> str:
    loc = tuple(err["loc"])
    key = ".".join(str(p) for p in loc) or "(top level)"
    source = "the overrides" if _in_overrides(loc, overrides) else f"policy file {path}"
    kind = err["type"]
    if kind == "extra_forbidden":
        model, _ = _model_at(loc)
        known = sorted(model.model_fields) if model else []
        close = difflib.get_close_matches(str(loc[-1]), known, n=1)
        hint = f" Did you mean '{'.'.join(str(p) for p in (*loc[:-1], close[0]))}'?" \
            if close else ""
        return (f"Unknown key '{key}' in {source}.{hint} Valid keys there: "
                f"{', '.join(known)}. Fix the spelling or remove the key.")
    got = err.get("input")
    shown = f" (got {got!r})" if kind != "missing" and not isinstance(got, dict) else ""
    msg = err["msg"].removeprefix("Value error, ")
    _, field = _model_at(loc)
    ann = field.annotation if field is not None else None
    if kind in ("model_type", "dict_type"):
        todo = "It must be a mapping of keys, laid out as in policies/default.yaml."
    elif isinstance(ann, type) and issubclass(ann, BaseModel):
        todo = "Change the fields named above so that they agree."
    elif field is not None and field.default is not PydanticUndefined:
        default = field.default.value if hasattr(field.default, "value") else field.default
        todo = f"Set a valid value, or remove the key to use the default ({default!r})."
    else:
        todo = "Set a valid value."
    if kind == "enum" and isinstance(got, str):
        expected = [a.strip(" '") for a in str(err.get("ctx", {}).get("expected", "")).replace(
            " or ", ",").split(",")]
        close = difflib.get_close_matches(got, [e for e in expected if e], n=1)
        if close:
            todo = f"Did you mean '{close[0]}'? " + todo
    return f"Invalid value for '{key}' in {source}{shown}: {msg}. {todo}"
