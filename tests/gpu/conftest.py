"""The GPU suite: babysit on a real NVIDIA GPU. One command on any CUDA machine::

    .venv/bin/pip install -e '.[dev,gpu]'        # a CUDA build of torch, and nvidia-ml-py
    .venv/bin/pytest -m gpu tests/gpu -v -rs

Every test here is marked ``gpu`` (in its module's ``pytestmark``) and, where torch sees no
CUDA device, skipped at collection with the reason, before any process, model or CUDA context is
made: on a CPU machine (CI) the whole folder costs the import of its modules. What each test
checks: docs/gpu.md.
"""

from __future__ import annotations

import pytest
import torch


def cuda_missing() -> str | None:
    """Why this machine cannot run the GPU suite, or None when it can."""
    if torch.version.cuda is None:
        return f"CUDA not available: torch {torch.__version__} is not a CUDA build"
    if not torch.cuda.is_available():
        return (f"CUDA not available: torch {torch.__version__} (CUDA {torch.version.cuda}) "
                "sees no GPU (no driver, or CUDA_VISIBLE_DEVICES hides them)")
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = cuda_missing()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
