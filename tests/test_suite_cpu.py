"""benchmarks/suite_cpu.py: the CPU of the processes a test ran is counted as that test's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT


def test_a_tests_child_processes_cpu_is_counted_under_its_file(tmp_path: Path) -> None:
    (tmp_path / "test_burn.py").write_text(
        "import subprocess, sys\n"
        "def test_burns():\n"
        "    subprocess.run([sys.executable, '-c', 'sum(range(20_000_000))'], check=True)\n"
        "def test_idle():\n"
        "    pass\n")
    folder = tmp_path / "measured"
    env = {"BABYSIT_SUITE_CPU": str(folder), "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    ran = subprocess.run([sys.executable, "-m", "pytest", "-p", "benchmarks.suite_cpu", "-q",
                          "-p", "no:cacheprovider", str(tmp_path / "test_burn.py")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    shown = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "suite_cpu.py"),
                            str(folder)], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    [row] = [line.split() for line in shown.stdout.splitlines() if "test_burn.py" in line]
    wall, cpu, tests = float(row[0]), float(row[1]), int(row[2])
    assert tests == 2 and cpu > 0.2 and wall >= cpu * 0.5
    assert "2 tests in 1 files" in shown.stdout
    empty = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "suite_cpu.py"),
                            str(tmp_path / "none")], capture_output=True, text=True, timeout=60)
    assert empty.returncode == 1 and "run pytest with -p benchmarks.suite_cpu" in empty.stderr
