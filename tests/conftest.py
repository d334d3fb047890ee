"""Shared fixtures. End-to-end tests run the real ``babysit`` CLI as a subprocess, which runs real
torchrun with real gloo workers; nothing in the process path is faked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
WORKERS = Path(__file__).resolve().parent / "workers"


def babysit_env() -> dict[str, str]:
    env = dict(os.environ)
    # The workers import the worker API from this checkout even when it is not installed.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run_babysit(*args: str, cwd: Path, timeout: float = 120,
                **kw: Any) -> subprocess.CompletedProcess[str]:
    """Run the real CLI as a subprocess and wait for it."""
    return subprocess.run([sys.executable, "-m", "supervisor.cli", *args], cwd=cwd,
                          env=babysit_env(), capture_output=True, text=True, timeout=timeout,
                          **kw)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture
def write_config(tmp_path: Path):
    """Write a YAML config into tmp_path and return its path."""

    def write(text: str, name: str = "run.yaml") -> Path:
        path = tmp_path / name
        path.write_text(text)
        return path

    return write
