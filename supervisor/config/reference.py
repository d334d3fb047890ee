"""The reference a person reads: every section and key of a pydantic model, with its type,
default and meaning, as Markdown that also reads well in a terminal. Pure.

``babysit schema`` prints ``reference(RunConfig)`` (``--policy``: the policy's); the same text is
kept in ``docs/config.md`` and ``docs/policy.md`` (``babysit schema --write`` regenerates both,
and a test fails when they drift). The meanings are the field docstrings, so the reference
cannot say something the code does not.

Layout: one ``##`` heading per section (a nested model), in declaration order, with the
section's own docstring, then one bullet per key::

    - `checkpoints.keep`: int, >= 1. Default: `3`.
      Checkpoints kept on disk; retention never deletes the newest good one.
"""

from __future__ import annotations

import enum
import inspect
import json
import textwrap
import types
import typing
from collections.abc import Iterator
from typing import Any

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo

WIDTH = 96


def reference(model: type[BaseModel], title: str, intro: str = "") -> str:
    """The whole reference of ``model``: a title, ``intro``, then every section."""
    parts = [f"# {title}", ""]
    if intro:
        parts += [_wrap(intro, ""), ""]
    for path, section, instance, said in _sections(model, "", None, ""):
        if path:
            parts += [f"## `{path}`", ""]
        about = said or _doc(section)
        if about:
            parts += [_wrap(about, ""), ""]
        keys = [_key(path, name, field, instance)
                for name, field in section.model_fields.items()
                if _model_of(field.annotation) is None and not field.exclude]
        if keys:
            parts += [*keys, ""]
    return "\n".join(parts).rstrip() + "\n"


def config_reference() -> str:
    """The run config's reference (``babysit schema``, ``docs/config.md``)."""
    from babysit.supervisor.config.schema import RunConfig

    return reference(RunConfig, "Run config reference", CONFIG_INTRO)


def policy_reference() -> str:
    """The policy's reference (``babysit schema --policy``, ``docs/policy.md``)."""
    from babysit.policies.schema import Policy

    return reference(Policy, "Policy reference", POLICY_INTRO)


CONFIG_INTRO = (
    "Every key of the YAML file `babysit run` reads, generated from the field docstrings in "
    "`supervisor/config/schema.py` (regenerate with `babysit schema --write docs/config.md`; "
    "`babysit schema --json` prints the JSON Schema). Keys may be spelled with dashes or "
    "underscores; unknown keys are errors; relative paths are resolved against the config "
    "file's folder, except `run_dir`. Only `launch` is required.")
POLICY_INTRO = (
    "Every key of a policy file (`policy.name: path/to/policy.yaml`, or `policy.overrides` in "
    "the run config), generated from `policies/schema.py` (regenerate with `babysit schema "
    "--policy --write docs/policy.md`). Built-in policies: `default`, `conservative`, "
    "`aggressive` (`policies/*.yaml`). docs/detection.md explains the detectors and ladders.")


def _sections(model: type[BaseModel], path: str, instance: BaseModel | None,
              said: str) -> Iterator[tuple[str, type[BaseModel], Any, str]]:
    """(dotted path, model, its default instance or None, the docstring of the field holding
    it) for ``model`` and every nested one, depth first in declaration order. A list of models
    is the section ``path[]``."""
    yield path, model, instance, said
    for name, field in model.model_fields.items():
        nested = _model_of(field.annotation)
        if nested is None:
            continue
        sub = f"{path}.{name}" if path else name
        about = field.description or ""
        if _is_list(field.annotation):
            yield from _sections(nested, f"{sub}[]", None, about)
            continue
        default = _default(field, instance, name)
        yield from _sections(nested, sub, default if isinstance(default, BaseModel) else None,
                             about)


def _key(path: str, name: str, field: FieldInfo, instance: Any) -> str:
    full = f"{path}.{name}" if path else name
    kind = _type(field.annotation)
    limits = _limits(field)
    head = f"- `{full}`: {kind}" + (f", {limits}" if limits else "")
    if field.is_required() and instance is None:
        head += ". Required."
    else:
        head += f". Default: `{_show(_default(field, instance, name))}`."
    meaning = field.description or ""
    nested = _model_of(_list_item(field.annotation))
    if nested is not None:
        meaning += f" Each item: see `{full}[]`."
    lines = [head]
    if meaning.strip():
        lines.append(_wrap(meaning.strip(), "  "))
    return "\n".join(lines)


def _default(field: FieldInfo, instance: Any, name: str) -> Any:
    if instance is not None:
        return getattr(instance, name)
    if field.default_factory is not None:
        return field.default_factory()  # type: ignore[call-arg]
    return field.default


def _type(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        names = [_type(a) for a in args if a is not type(None)]
        return " or ".join(names) + (" or none" if type(None) in args else "")
    if origin is typing.Literal:
        return " | ".join(json.dumps(_plain(a)) for a in args)
    if origin in (list, tuple, set):
        return f"list of {_type(args[0])}" if args else "list"
    if origin is dict:
        return f"map of {_type(args[0])} to {_type(args[1])}" if args else "map"
    if inspect.isclass(annotation):
        if issubclass(annotation, enum.Enum):
            return " | ".join(json.dumps(m.value) for m in annotation)
        if issubclass(annotation, BaseModel):
            return "section"
        return {"str": "string", "int": "int", "float": "number", "bool": "bool"}.get(
            annotation.__name__, annotation.__name__)
    return "any" if annotation is Any else str(annotation)


def _limits(field: FieldInfo) -> str:
    out = []
    for m in field.metadata:
        for cls, attr, sign in ((annotated_types.Ge, "ge", ">="), (annotated_types.Gt, "gt", ">"),
                                (annotated_types.Le, "le", "<="), (annotated_types.Lt, "lt", "<")):
            if isinstance(m, cls):
                out.append(f"{sign} {_show(getattr(m, attr))}")
        if isinstance(m, annotated_types.MinLen):
            out.append(f"at least {m.min_length} item(s)")
    return ", ".join(out)


def _show(value: Any) -> str:
    if value is None:
        return "none"
    return json.dumps(_plain(value))


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The model a field holds (itself, optional, or as a list's items), else None."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if inspect.isclass(candidate) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _is_list(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (list, tuple)


def _list_item(annotation: Any) -> Any:
    return typing.get_args(annotation)[0] if _is_list(annotation) else None


def _doc(model: type[BaseModel]) -> str:
    doc = inspect.getdoc(model) or ""
    if model.__doc__ is None or doc == inspect.getdoc(BaseModel):
        return ""
    return doc.split("\n\n")[0].replace("\n", " ")


def _wrap(text: str, indent: str) -> str:
    return "\n".join(textwrap.fill(p.replace("\n", " "), WIDTH, initial_indent=indent,
                                   subsequent_indent=indent, break_on_hyphens=False,
                                   break_long_words=False)
                     for p in text.split("\n\n"))
