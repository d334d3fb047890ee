"""On a machine without CUDA (CI), the GPU suite skips every test with the reason, cheaply.

``pytest -m gpu tests/gpu`` is the suite's one command on a GPU machine; here it must collect
every GPU test, run none, and say why for each. A test that slipped its ``gpu`` marker would be
deselected and show as missing from the count.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT, babysit_env

GPU = ROOT / "tests" / "gpu"


def gpu_test_count() -> int:
    """How many test functions tests/gpu holds (parametrised ones count once: none are)."""
    return sum(1 for path in GPU.glob("test_*.py")
               for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here: the GPU suite runs")
def test_without_cuda_every_gpu_test_is_skipped_with_the_reason() -> None:
    done = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", str(GPU), "-q", "-rs",
                           "-p", "no:cacheprovider"], cwd=ROOT, env=babysit_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    expected = gpu_test_count()
    assert expected >= 10
    summary = done.stdout.strip().splitlines()[-1]
    assert re.fullmatch(rf"{expected} skipped in [0-9.]+s", summary), summary
    reasons = re.findall(r"^SKIPPED \[\d+\] \S+: (.*)$", done.stdout, re.M)
    assert reasons and all(r.startswith("CUDA not available: ") for r in reasons), reasons
