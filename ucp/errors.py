"""Errors of the checkpoint layer: one hierarchy, every message naming what is at fault.

All derive from :class:`CheckpointError`, a ``ValueError``, so callers can catch
"this checkpoint (or this request) is bad" in one place, apart from plain I/O
failures (``aio.AioError``, an ``OSError``) which mean the storage itself failed.
"""

from __future__ import annotations


class CheckpointError(ValueError):
    """Something about a checkpoint, or a request to save or load one, is wrong.

    ``tensor``, ``file`` and ``offset`` say where, when known (the message says it too).
    """

    def __init__(
        self, message: str, *, tensor: str | None = None, file: str | None = None, offset: int | None = None
    ) -> None:
        super().__init__(message)
        self.tensor = tensor
        self.file = file
        self.offset = offset


class NotACheckpointError(CheckpointError):
    """There is no ``manifest.json`` at the path: not a checkpoint, or a save that never committed."""


class ManifestError(CheckpointError):
    """``manifest.json`` is not valid JSON, does not match the schema, or contradicts itself."""


class UnsupportedFormatError(ManifestError):
    """The manifest's ``format_version`` is one this reader does not know."""


class MissingDataError(CheckpointError):
    """A data file the manifest lists is missing."""


class CorruptCheckpointError(CheckpointError):
    """Stored bytes disagree with the manifest: CRC mismatch, truncated file, inconsistent header."""


class LayoutMismatchError(CheckpointError):
    """The structure given to ``load(into=...)`` does not fit the checkpoint (missing key, other shape)."""


class UnsupportedStateError(CheckpointError):
    """The state dict holds something the format cannot store (a dtype, a value type, a key type)."""


class SnapshotChangedError(UnsupportedStateError):
    """A tensor changed in place while a deferred snapshot (``snapshot="background"`` / ``"none"``) read it."""


class CommitError(CheckpointError):
    """A save could not be committed: a rank failed, or the ranks' pieces do not fit together."""


def where(tensor: str | None = None, file: str | None = None, offset: int | None = None) -> str:
    """'tensor 'x', file 'rank-00000.safetensors', offset 4096' — the location part of a message."""
    parts = []
    if tensor is not None:
        parts.append(f"tensor {tensor!r}")
    if file is not None:
        parts.append(f"file {file!r}")
    if offset is not None:
        parts.append(f"offset {offset}")
    return ", ".join(parts)
