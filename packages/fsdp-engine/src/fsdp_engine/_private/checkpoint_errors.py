"""The errors of the checkpoint functions (one module, so the file-level code can raise them)."""

from __future__ import annotations

__all__ = [
    "AfterCommitError",
    "CheckpointError",
    "CheckpointIntegrityError",
    "IncompleteCheckpointError",
]


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded as asked (the message names the path or key)."""


class IncompleteCheckpointError(CheckpointError, FileNotFoundError):
    """The directory is not a committed checkpoint: its save never finished (or it is not one)."""


class CheckpointIntegrityError(CheckpointError):
    """A checkpoint's files do not match what its save recorded: damaged, truncated, or copied
    in from another save (the message names the file, and the ranks that found it)."""


class AfterCommitError(CheckpointError):
    """The checkpoint *is* committed and loadable, but a step after the commit rename failed
    (syncing the parent directory, or updating the ``latest`` pointer): the message says which,
    and what ``latest_checkpoint`` returns now."""
