"""Checkpoints: save and load (worker side), manifests and the catalog (supervisor side).

Worker side, collective (every rank calls; torch is imported inside the functions, so importing
this package stays torch-free for the supervisor)::

    handle = save(root, step, cursor, lr_scale, model, optimizer, scheduler, extra, async_save)
    handle.poll()            # async: once per step until True; handle.wait() before exiting
    restored = load(path, model, optimizer, scheduler)   # -> Restored(step, cursor, lr_scale, ...)
    register_external(root, path, step, cursor)          # your own save: one rank, after it ends

Supervisor side (never imports torch)::

    cat = Catalog(root)
    cat.promote(healthy_step, probation_steps); cat.mark_anomaly(onset, window, reason)
    choice = cat.choose_for_rollback(onset)   # verified; .refused says what was skipped and why
    cat.retain(keep_last); cat.clean_incomplete()
"""

from babysit.checkpoints.catalog import Catalog, Checkpoint, Refusal, RollbackChoice, Verdict
from babysit.checkpoints.errors import CheckpointError, ManifestError
from babysit.checkpoints.layout import step_dir
from babysit.checkpoints.load import Restored, load
from babysit.checkpoints.manifest import (
    FileEntry,
    Manifest,
    read_manifest,
    register_external,
    verify_manifest,
)
from babysit.checkpoints.save import SaveHandle, save, wait_pending

__all__ = [
    "Catalog",
    "Checkpoint",
    "CheckpointError",
    "FileEntry",
    "Manifest",
    "ManifestError",
    "Refusal",
    "Restored",
    "RollbackChoice",
    "SaveHandle",
    "Verdict",
    "load",
    "read_manifest",
    "register_external",
    "save",
    "step_dir",
    "verify_manifest",
    "wait_pending",
]
