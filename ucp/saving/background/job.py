"""The messages of a background save: one rank's job (:class:`WriteJob`, JSON: the plan, names, the
state tree — never tensor bytes), the post-commit call, and the writer process's error replies."""

from __future__ import annotations

import itertools
import logging
from typing import Any

from pydantic import BaseModel, ConfigDict

from aio import AioConfig
from reshard.box import Box, FlatRange
from ucp import errors as _errors
from ucp.errors import CheckpointError, CommitError
from ucp.saving.options import DEFAULTS
from ucp.saving.plan import SavePlan
from ucp.store import commit as _commit
from ucp.store.file_ranges import FileRange
from ucp.store.storage import Storage, open_storage

log = logging.getLogger(__name__)


class PieceSpec(BaseModel):
    """A planned piece, as JSON."""

    model_config = ConfigDict(extra="forbid")
    name: str
    offset: int
    length: int
    box: tuple[list[int], list[int]] | None = None  # (offsets, shape)
    flat: tuple[int, int] | None = None  # (start, stop)
    entry: str | None = None  # header entry name when not ``name``
    arena: int | None = None  # a streamed plan: where the piece's bytes start in the (compact) arena
    source: list[FileRange] | None = None  # ... or the files the writer reads them from (a StreamedShard's)

    def region(self) -> Box | FlatRange:
        if self.box is not None:
            return Box.of(*self.box)
        assert self.flat is not None
        return FlatRange(*self.flat)


class PlanSpec(BaseModel):
    """What the writer needs of a :class:`~ucp.saving.plan.SavePlan` (the header is already in the arena image).

    ``streamed`` (a save of StreamedShards with a ``source``, :func:`ucp.saving.snapshot_modes.start_streamed_process`):
    the arena is not the file's image but holds the header (its first ``data_start`` bytes) and the other pieces'
    bytes (at each piece's ``arena``); the writer reads the streamed pieces from their ``source`` files."""

    model_config = ConfigDict(extra="forbid")
    file: str
    file_size: int
    pieces: list[PieceSpec]
    streamed: bool = False
    data_start: int = 0

    @classmethod
    def of(cls, plan: SavePlan) -> "PlanSpec":
        assert plan.file is not None
        pieces = []
        for p in plan.pieces:
            r = p.region
            if isinstance(r, Box):
                pieces.append(
                    PieceSpec(
                        name=p.name,
                        offset=p.offset,
                        length=p.length,
                        entry=p.entry,
                        box=(list(r.offsets), list(r.shape)),
                    )
                )
            else:
                pieces.append(
                    PieceSpec(name=p.name, offset=p.offset, length=p.length, entry=p.entry, flat=(r.start, r.stop))
                )
        return cls(file=plan.file, file_size=plan.file_size, pieces=pieces)


class PostCommit(BaseModel):
    """A function (``"ucp.module:function"``) rank 0's writer calls with ``kwargs`` after the commit."""

    model_config = ConfigDict(extra="forbid")
    call: str
    kwargs: dict[str, Any] = {}


class StoreHandshake(BaseModel):
    """Where the ranks of a save that share no directory meet (a node-local tier's remote root):
    :mod:`ucp.saving.background.store_handshake`."""

    model_config = ConfigDict(extra="forbid")
    url: str
    storage_options: dict[str, Any] | None = None


class WriteJob(BaseModel):
    """One rank's part of one asynchronous save."""

    model_config = ConfigDict(extra="forbid")
    id: int
    path: str  # the checkpoint path as the user gave it
    name: str  # its last component (the final directory, relative to the storage root)
    temp: str  # the temporary directory, relative to the storage root
    temp_identity: tuple[int, int] | None = None  # (st_dev, st_ino) of the temporary directory, local storage only
    storage_options: dict[str, Any] | None = None
    aio_config: dict[str, Any] | None = None
    rank: int = 0
    world_size: int = 1
    plan: PlanSpec | None = None  # None: this rank writes no file
    tensors: list[tuple[str, str, list[int]]] = []
    tree: Any = None
    step: int | None = None
    metadata: dict[str, Any] = {}
    mesh: dict[str, int] | None = None
    arena_path: str | None = None  # process mode: the shared-memory file holding the image
    arena_capacity: int = 0
    commit_timeout: float = DEFAULTS.commit_timeout
    post_commit: PostCommit | None = None
    replicas: list[_commit.Replica] = []  # check_replicas: checksums taken when the save was asked for
    handshake: StoreHandshake | None = None  # ranks without a shared directory: they meet on this store

    def open_storage(self) -> tuple[Storage, str]:
        cfg = AioConfig.model_validate(self.aio_config) if self.aio_config is not None else None
        return open_storage(self.path, storage_options=self.storage_options, aio_config=cfg)


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def rebuild_error(msg: dict[str, Any]) -> BaseException:
    """The writer process's error, as the same kind of exception where we can."""
    kind, text = msg.get("type", "Error"), msg.get("message", "")
    if msg.get("errno") is not None:
        return OSError(msg["errno"], msg.get("strerror") or text, msg.get("filename"))
    cls = getattr(_errors, kind, None)
    if isinstance(cls, type) and issubclass(cls, CommitError):
        return cls(text, ranks=msg.get("ranks", ()), reason=msg.get("reason"))
    if isinstance(cls, type) and issubclass(cls, CheckpointError):
        try:
            return cls(text)
        except TypeError:  # a class with other fields (UnsafePickleError): the message says it all
            pass
    return CommitError(f"{kind}: {text}", ranks=msg.get("ranks", ()), reason=text)


def error_message(job_id: int, exc: BaseException) -> dict[str, Any]:
    msg: dict[str, Any] = {"op": "error", "id": job_id, "type": type(exc).__name__, "message": str(exc)}
    if isinstance(exc, OSError) and exc.errno is not None:
        msg.update(errno=exc.errno, strerror=exc.strerror, filename=exc.filename)
    if isinstance(exc, CommitError):
        msg.update(ranks=list(exc.ranks), reason=exc.reason)
    return msg


_ids = itertools.count(1)


def next_job_id() -> int:
    return next(_ids)
