"""Errors of the importers: the foreign checkpoint is unreadable, unsupported, or unsafe to unpickle.

They derive from :class:`ucp.CheckpointError` (a ``ValueError``), so callers catching "this
checkpoint is bad" catch these too; ``file`` names the foreign file at fault.
"""

from __future__ import annotations

from ucp.errors import CheckpointError


class ForeignCheckpointError(CheckpointError):
    """A foreign checkpoint (DeepSpeed, DCP, Hugging Face) is missing files, malformed or unsupported."""


class UnknownFormatError(ForeignCheckpointError):
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
