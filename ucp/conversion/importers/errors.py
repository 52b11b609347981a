"""Errors of the importers: the foreign checkpoint is unreadable, unsupported, or unsafe to unpickle.

Defined in :mod:`ucp.errors` with the rest of the hierarchy (each a :class:`ucp.CheckpointError`,
a ``ValueError``), so callers catching "this checkpoint is bad" catch these too; ``file`` names the
foreign file at fault. Re-exported here for the importers.
"""

from __future__ import annotations

from ucp.errors import ForeignCheckpointError, UnknownFormatError, UnsafePickleError

__all__ = ["ForeignCheckpointError", "UnknownFormatError", "UnsafePickleError"]
