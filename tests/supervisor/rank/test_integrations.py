"""``babysit.integrations`` imports a framework only when one of its names is used."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import babysit_env


def test_babysit_never_imports_the_frameworks_by_itself() -> None:
    code = ("import sys, babysit, babysit.integrations, babysit.supervisor.run.loop, "
            "babysit.supervisor.commands.cli; "
            "print(sorted(m for m in ('transformers', 'lightning', 'accelerate') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], env=babysit_env(), capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == "[]"


def test_an_unknown_name_is_an_attribute_error() -> None:
    import babysit.integrations

    with pytest.raises(AttributeError, match="no attribute 'keras_fit'"):
        _ = babysit.integrations.keras_fit
