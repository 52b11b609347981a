"""Errors of the checkpoint layer: one hierarchy, every message naming what is at fault.

Every error UCP raises on purpose derives from :class:`CheckpointError`, a ``ValueError``,
so callers can catch "this checkpoint (or this request, save, export, bench) failed" in one
place, apart from plain I/O failures (``OSError``, e.g. ``aio.AioError``) which mean the
storage itself failed. The whole tree lives here, importing nothing, so that every layer
(and the command line, without torch) can raise and catch it; each class is also ``ucp.<Name>``::

    CheckpointError
    ├── NotACheckpointError            no manifest.json at the path
    │   └── UnknownFormatError         not a checkpoint of any format the importers know
    ├── ManifestError                  manifest.json invalid or inconsistent
    │   └── UnsupportedFormatError     a format_version this reader does not know
    ├── MissingDataError               a data file the manifest lists is missing
    ├── CorruptCheckpointError         stored bytes disagree with the manifest
    ├── LayoutMismatchError            load(into=...) does not fit the checkpoint
    ├── UnsupportedStateError          the state dict holds something the format cannot store
    ├── SnapshotChangedError           a tensor changed while a deferred snapshot read it
    ├── SnapshotAborted                the snapshot feeding a background write failed
    ├── CowUnavailable                 copy-on-write snapshots cannot run here
    ├── CommitError                    a save could not be committed (``ranks``, ``reason``)
    ├── DestinationError               where to write is in the way (exists, not a checkpoint, holds the source)
    ├── ForeignCheckpointError         a DeepSpeed / DCP / Hugging Face checkpoint is unreadable
    │   ├── UnknownFormatError
    │   └── UnsafePickleError          a pickle wants classes outside the allow-list
    ├── ExportError                    an export cannot proceed (option, tensor, destination)
    └── BenchError                     a bench could not run or read back wrong bytes
        └── RawToolError               fio or dd failed
"""

from __future__ import annotations

from collections.abc import Iterable


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
    """The structure given to ``load(into=...)`` does not fit the checkpoint (a missing key, an unexpected one
    under ``strict``, another shape), or a tensor asked of ``ucp.open`` is not in it."""


class UnsupportedStateError(CheckpointError):
    """The state dict holds something the format cannot store (a dtype, a value type, a key type)."""


class SnapshotChangedError(CheckpointError):
    """A tensor changed in place while a deferred snapshot (``snapshot="background"`` / ``"none"``) read it.

    The state itself was storable (this is not an :class:`UnsupportedStateError`): the training
    loop wrote to it before the save had read it; wait on the save first, or snapshot eagerly."""


class SnapshotAborted(CheckpointError):
    """The snapshot feeding a background write failed or its process died before it was complete."""


class CowUnavailable(CheckpointError):
    """Copy-on-write snapshots cannot run here (the reason says why); saves copy before returning instead."""


class CommitError(CheckpointError):
    """A save could not be committed: a rank failed, or the ranks' pieces do not fit together.

    ``ranks``: the ranks whose failure (or disagreement) stopped the commit, sorted; empty when no
    rank is to blame (e.g. a refused post-commit call). ``reason``: what went wrong, without the
    "save of X failed on rank N" framing of the message.
    """

    def __init__(
        self,
        message: str,
        *,
        ranks: Iterable[int] = (),
        reason: str | None = None,
        tensor: str | None = None,
        file: str | None = None,
        offset: int | None = None,
    ) -> None:
        super().__init__(message, tensor=tensor, file=file, offset=offset)
        self.ranks: tuple[int, ...] = tuple(sorted(set(ranks)))
        self.reason: str = message if reason is None else reason


class StorageError(CheckpointError):
    """The storage refused or failed a request: an object store's credentials, a missing bucket, a
    transfer whose retries ran out. The message names the URL of the object at fault."""


class DestinationError(CheckpointError):
    """Where a save, convert, reshape or export would write is in the way: it exists (and overwriting
    was not asked for), is not a checkpoint that may be replaced, or is or holds the source."""


class ForeignCheckpointError(CheckpointError):
    """A foreign checkpoint (DeepSpeed, DCP, Hugging Face) is missing files, malformed or unsupported."""


class UnknownFormatError(ForeignCheckpointError, NotACheckpointError):
    """The source path is not a checkpoint of any format the importers know (or not the one asked for)."""


class UnsafePickleError(ForeignCheckpointError):
    """A pickle wants globals outside the allow-list; ``--trust-pickle`` would run a full unpickle."""

    def __init__(self, file: str, globals_: list[str], *, where: str | None = None) -> None:
        """``where`` describes the pickle when it is not a whole file (e.g. a byte range of one)."""
        names = ", ".join(globals_) if globals_ else "(classes it rebuilds dynamically)"
        super().__init__(
            f"{where or f'file {file!r}'} needs classes outside the safe allow-list: {names}. Loading it would run "
            "arbitrary code from the file; if you trust it, pass --trust-pickle (trust_pickle=True) "
            "to allow a full unpickle",
            file=file,
        )
        self.globals = list(globals_)


class ExportError(CheckpointError):
    """An export cannot proceed; the message names the option, tensor or file at fault."""


class BenchError(CheckpointError):
    """A bench could not run, or a method read back wrong bytes."""


class BenchOptionError(BenchError):
    """A bench was asked for something it cannot run (an unknown method, a bad world size): bad input."""


class RawToolError(BenchError):
    """fio or dd failed; the message has its command line and stderr."""


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
