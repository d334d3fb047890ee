"""The one base of every config model babysit reads from YAML (the run config, the policy, each
detector's and each service's section): frozen, unknown keys rejected, and each field's
docstring kept, so ``babysit schema`` and the config reference print what the code declares.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class DashedSection(Section):
    """A section whose own keys may be written with dashes, as on torchrun's command line
    (``nproc-per-node``); they are read as underscores."""

    @model_validator(mode="before")
    @classmethod
    def _dashes_to_underscores(cls, data: Any) -> Any:
        # Only this model's own keys are normalised; values such as launch.env keep their names.
        if isinstance(data, dict):
            return {k.replace("-", "_") if isinstance(k, str) else k: v for k, v in data.items()}
        return data
