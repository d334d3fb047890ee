"""Crash-safe small-file writes: a reader sees the old file or the new one, never a torn one."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from babysit.checkpoints.layout import MANIFEST_NAME, TMP_SUFFIX


def fsync_dir(path: Path) -> None:
    """Flush a directory entry (a rename or unlink) to disk; no-op where that is impossible."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        # Some filesystems (and Windows) refuse fsync on a directory; the rename is still atomic.
        pass
    finally:
        os.close(fd)


def atomic_write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path`` atomically.

    The temp file lives in the same directory (a rename is only atomic within one filesystem), is
    fsynced before ``os.replace`` so the new name never points at unwritten blocks, and the
    directory is fsynced after so the rename itself survives a power loss.
    """
    data = (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TMP_SUFFIX)
    try:
        # mkstemp creates 0600; these files are for people and other tools to read too.
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def uncommit_and_remove(ckpt_dir: Path) -> None:
    """Delete a checkpoint directory so that no crash can leave it looking committed.

    The manifest goes first (and the directory is fsynced): from then on a crash leaves an
    incomplete directory, which ``Catalog.clean_incomplete`` removes, never a committed one with
    files missing.
    """
    manifest = ckpt_dir / MANIFEST_NAME
    if manifest.exists():
        manifest.unlink()
        fsync_dir(ckpt_dir)
    shutil.rmtree(ckpt_dir, ignore_errors=True)
