"""Detection and decision: detectors, the policy schema, the rules engine and replay.

The public surface the supervisor uses::

    load_policy(name_or_path, overrides) -> Policy        raises PolicyError
    Rules(policy).on_finding(finding, now) -> Remedy
    Pipeline(policy).observe(record) -> list[Decision]    (detectors + rules, as replay runs them)
    classify(exit_code, signal, log_tail, step, previous) -> CrashVerdict
    run_replay(curve_path, policy, as_json, out) -> int   (``babysit replay``)

The names are imported lazily: ``policies.types`` is imported by the worker and by the
supervisor's hot path, and must not drag pydantic and yaml in with it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from policies.detectors import CrashVerdict, classify
    from policies.loader import PolicyError, builtin_names, load_policy
    from policies.replay import Decision, Pipeline, run_replay
    from policies.rules import Rules
    from policies.schema import Policy

_LAZY = {
    "CrashVerdict": "policies.detectors",
    "classify": "policies.detectors",
    "PolicyError": "policies.loader",
    "builtin_names": "policies.loader",
    "load_policy": "policies.loader",
    "Decision": "policies.replay",
    "Pipeline": "policies.replay",
    "run_replay": "policies.replay",
    "Rules": "policies.rules",
    "Policy": "policies.schema",
}

__all__ = [
    "CrashVerdict",
    "Decision",
    "Pipeline",
    "Policy",
    "PolicyError",
    "Rules",
    "builtin_names",
    "classify",
    "load_policy",
    "run_replay",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'policies' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
