"""NaN / Inf: any rank reporting a non-finite loss or grad norm is CRITICAL at once.

Stateless by nature: there is no baseline to learn, and one NaN is enough. It fires on every
step that carries a non-finite value; the rules' cooldown keeps repeats from acting twice.
Calling rules: call ``observe`` once per merged ``StepRecord``; it looks at every rank's own
values (not the merged mean), so it can name the ranks that went bad first.
"""

from __future__ import annotations

import math
from typing import Any

from babysit.policies.detectors._base import DetectorConfig
from babysit.policies.types import Finding, Incident, Severity, StepRecord
from babysit.policies.wording import said_ranks


class NonFiniteConfig(DetectorConfig):
    check_grad_norm: bool = True
    """Also treat a non-finite grad norm as fatal. Turn off only for runs that rely on a
    dynamic loss scaler, which skips such steps by itself."""


class NonFiniteDetector:
    """Names the ranks whose loss or grad norm is NaN or infinite; see the module docstring."""

    name = "nonfinite"

    def __init__(self, config: NonFiniteConfig | None = None) -> None:
        self.config = config or NonFiniteConfig()

    def observe(self, record: StepRecord) -> Finding | None:
        bad: dict[str, dict[str, str]] = {}
        for r in record.ranks:
            fields = {"loss": r.loss}
            if self.config.check_grad_norm:
                fields["grad_norm"] = r.grad_norm
            for key, value in fields.items():
                if value is not None and not math.isfinite(value):
                    # repr() keeps 'nan' / 'inf' / '-inf' readable and JSON-safe.
                    bad.setdefault(key, {})[str(r.rank)] = repr(value)
        if not bad:
            return None
        ranks = tuple(sorted({int(k) for per in bad.values() for k in per}))
        what = " and ".join(sorted(bad))
        return Finding(
            incident=Incident.NONFINITE,
            detector=self.name,
            severity=Severity.CRITICAL,
            step=record.step,
            onset_step=record.step,
            onset_cursor=record.cursor,
            ranks=ranks,
            message=f"non-finite {what} at step {record.step} on {said_ranks(ranks)}",
            evidence=bad,
        )

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        del d
