"""What every detector config shares: frozen, unknown keys rejected, field docstrings kept.

Each detector declares its config next to itself (one docstring per field); the policy schema
(``policies/schema.py``) composes them, so the YAML, ``babysit schema`` and the code read the
same declaration.
"""

from __future__ import annotations

from babysit.policies.section import Section


class DetectorConfig(Section):
    """The base of every detector's config (``policies.section.Section``)."""
