"""Errors raised by the checkpoint layer.

Every error a user can cause is a ``CheckpointError`` whose message is one paragraph: what
happened, where (path, rank, step) and what to do next::

    CheckpointError               anything the user can fix: an unwritable root, a checkpoint made
     |                            with another world size, a key missing when loading, a failed save
     `- ManifestError             a manifest is missing, unreadable or of an unknown format version

Verification problems (a wrong size or checksum) are not raised: ``verify_manifest`` returns them
as strings, because the supervisor wants to journal them and fall back to an older checkpoint.
"""

from __future__ import annotations


class CheckpointError(Exception):
    """A checkpoint could not be saved, found or loaded for a reason the user can act on."""


class ManifestError(CheckpointError):
    """A checkpoint directory has no readable manifest of a format this version understands."""
