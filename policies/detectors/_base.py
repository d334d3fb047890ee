"""What every detector config shares: frozen, unknown keys rejected, field docstrings kept.

Each detector declares its config next to itself (one docstring per field); the policy schema
(``policies/schema.py``) composes them, so the YAML, ``babysit schema`` and the code read the
same declaration.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class DetectorConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


def r4(x: float) -> float:
    """Evidence numbers are for people: four significant digits are plenty."""
    return float(f"{x:.4g}")
