"""A /dev/shm too small for the memory copies, for real: babysit run in a mount namespace of
its own whose /dev/shm is Docker's default, 64 MiB, with an FSDP2 job whose copies need more.
The run says so once, at the first copy, and what to change; it trains on without them, and
``babysit status`` says why there are none (``checkpoints/capacity.py``)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from babysit.supervisor.commands.status import status_main
from tests.conftest import FAST_POLICY, WORKERS, babysit_env, journal

pytestmark = pytest.mark.e2e

WIDTH = 131072
"""About 28 MiB of model and Adam state (216 bytes a unit): three copies, 85 MiB, do not fit
in 64 MiB."""
SHM_64M = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
           'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$@"', "shm-64m"]
"""A command's prefix: it runs with a /dev/shm of 64 MiB of its own (gone with it), in a mount
namespace this test makes; the machine's own /dev/shm is not touched."""


def test_a_dev_shm_too_small_for_the_copies_is_said_once_with_what_to_change(
        tmp_path: Path) -> None:
    if subprocess.run([*SHM_64M, "true"], capture_output=True).returncode:
        pytest.skip("no mount namespace with a tmpfs of its own here (needs root)")
    done, run_dir = _run_under(SHM_64M, tmp_path, "--fsdp", "--width", str(WIDTH),
                               "--steps", "6")

    [off] = journal(run_dir, "memory_copy_off")
    why = off["why"]
    assert "more than the" in why and "free in /dev/shm there" in why, why
    assert "--shm-size=128m" in why and "checkpoints.memory_every_steps: 0" in why
    assert done.stdout.count("babysit: no memory copies:") == 1
    assert f"babysit: no memory copies: {why}" in done.stdout
    assert not journal(run_dir, "memory_copy") and not journal(run_dir, "memory_copy_failed")
    assert journal(run_dir, "run_finished")[-1]["exit_code"] == 0
    out = io.StringIO()
    assert status_main(str(run_dir), False, out) == 0
    assert f"no copies: {why}" in out.getvalue()


def test_a_node_without_a_writable_dev_shm_says_where_its_folder_went_instead(
        tmp_path: Path) -> None:
    """A read-only /dev/shm (some containers'): the node's folder goes to the temporary
    folder, on disk, and the run says so once."""
    read_only = [*SHM_64M[:6], 'mount -t tmpfs -o ro,size=1m tmpfs /dev/shm && exec "$@"',
                 "shm-ro"]
    if subprocess.run([*read_only, "true"], capture_output=True).returncode:
        pytest.skip("no mount namespace with a tmpfs of its own here (needs root)")
    done, run_dir = _run_under(read_only, tmp_path, "--steps", "4")
    [fallback] = journal(run_dir, "shared_memory_fallback")
    folder = Path(fallback["path"])
    assert folder.parent == Path(tempfile.gettempdir()) and not folder.exists()
    assert done.stdout.count("babysit: no shared memory:") == 1
    assert (f"babysit: no shared memory: /dev/shm is not writable: memory copies and step "
            f"marks go to {folder.parent} instead, on disk (give the node a writable "
            f"/dev/shm)") in done.stdout


def _run_under(prefix: list[str], tmp_path: Path, *args: str
               ) -> tuple[subprocess.CompletedProcess[str], Path]:
    """``babysit run`` of two ranks of ``tiny_train.py args`` (no pause between steps, memory
    copies every 2 steps), started under ``prefix`` (a /dev/shm of its own); it must succeed.
    Returns the finished process and the run directory."""
    run_dir, config = tmp_path / "run", tmp_path / "run.yaml"
    config.write_text(
        f"launch:\n  script: {WORKERS / 'tiny_train.py'}\n  nproc-per-node: 2\n"
        f"  args: {json.dumps([*args, '--step-sleep', '0'])}\n  warm_standby: false\n"
        f"run_dir: {run_dir}\n"
        "checkpoints: {every_steps: 100, memory_every_steps: 2, async_save: false}\n"
        f"policy: {{name: {FAST_POLICY}}}\n")
    done = subprocess.run([*prefix, sys.executable, "-m", "babysit", "run", str(config)],
                          cwd=tmp_path, env=babysit_env(), capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    return done, run_dir
