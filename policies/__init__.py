"""Detection and decision: detectors, the policy schema, the rules engine and replay.

The public surface the supervisor uses::

    load_policy(name_or_path, overrides) -> Policy        raises PolicyError
    Rules(policy).on_finding(finding, now) -> Remedy
    Pipeline(policy).observe(record) -> list[ReplayDecision]   (detectors + rules, live and
                                                               in replay)
    classify(exit_code, signal, log_tail, step, previous) -> CrashVerdict
    run_replay(curve_path, policy, as_json, out) -> int   (``babysit replay``)

The names are imported lazily: ``policies.types`` is imported by the worker and by the
supervisor's hot path, and must not drag pydantic and yaml in with it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from babysit.policies.detectors import CrashVerdict, classify
    from babysit.policies.loader import PolicyError, builtin_names, load_policy
    from babysit.policies.pipeline import Pipeline, ReplayDecision
    from babysit.policies.replay import run_replay
    from babysit.policies.rules import Rules
    from babysit.policies.schema import Policy

_LAZY = {
    "CrashVerdict": "babysit.policies.detectors",
    "classify": "babysit.policies.detectors",
    "PolicyError": "babysit.policies.loader",
    "builtin_names": "babysit.policies.loader",
    "load_policy": "babysit.policies.loader",
    "ReplayDecision": "babysit.policies.pipeline",
    "Pipeline": "babysit.policies.pipeline",
    "run_replay": "babysit.policies.replay",
    "Rules": "babysit.policies.rules",
    "Policy": "babysit.policies.schema",
}

__all__ = [
    "CrashVerdict",
    "Pipeline",
    "Policy",
    "PolicyError",
    "ReplayDecision",
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
