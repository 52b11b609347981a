"""Step (d) of a save: gather the ranks' piece records, write manifest.json, move the directory in.

Sequence (rank 0 does the file-system work; see docs/format.md for crash windows):

1. :func:`make_temp_dir` creates ``.<name>.tmp-<random>`` next to the final path;
   its name is broadcast so that every rank writes its data file there.
2. Each rank sends a :class:`RankReport` (its piece records, tensor list, state
   tree, or its error) to rank 0.
3. :func:`build_manifest` merges them and checks the result with the same checks
   a reader applies, so a save whose ranks' pieces do not fit together fails here
   instead of producing an unloadable checkpoint.
4. :func:`commit` writes and fsyncs manifest.json, fsyncs the directory, swaps it
   in for any previous checkpoint, fsyncs the parent and deletes the old one.

Steps 2-4 sit behind one interface, :class:`Committer`, with two ways for the ranks to meet:
:class:`CollectiveCommit` (``ucp.save``: a gather to rank 0, the outcome broadcast back) and
:class:`ucp.saving.background.handshake.HandshakeCommit` (background writers, which must not run
collectives: the ranks meet through files in the temporary directory). A save picks one when it starts.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import secrets
from abc import ABC, abstractmethod
from collections import defaultdict
from datetime import datetime
from typing import TYPE_CHECKING, Any, Callable

from pydantic import BaseModel, ConfigDict

from ucp.errors import CheckpointError, CommitError, DestinationError, ManifestError
from ucp.format.manifest import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    BoxModel,
    FileInfo,
    FlatModel,
    Manifest,
    Piece,
    TensorEntry,
    Topology,
    check_manifest,
    now_utc,
)
from ucp.format.tree import merge_trees
from ucp.store.storage import Storage

if TYPE_CHECKING:
    from ucp.dist import Group

log = logging.getLogger(__name__)


def creator() -> str:
    try:
        from importlib.metadata import version

        return f"ucp {version('ucp')}"
    except Exception:  # not installed (running from a source tree)
        return "ucp"


class Replica(BaseModel):
    """A region a rank holds but another rank writes, with the CRC-32C of its bytes (``check_replicas``)."""

    model_config = ConfigDict(extra="forbid")
    tensor: str
    box: BoxModel | None = None
    flat: FlatModel | None = None
    crc32c: int

    @classmethod
    def of(cls, tensor: str, region: Any, crc: int) -> "Replica":
        if hasattr(region, "offsets"):
            return cls(tensor=tensor, box=BoxModel(offsets=list(region.offsets), shape=list(region.shape)), crc32c=crc)
        return cls(tensor=tensor, flat=FlatModel(start=region.start, stop=region.stop), crc32c=crc)


class RankReport(BaseModel):
    """What one rank tells rank 0 at commit time."""

    model_config = ConfigDict(extra="forbid")
    rank: int
    error: str | None = None
    file: str | None = None
    file_size: int = 0
    tensors: list[tuple[str, str, list[int]]] = []  # (name, dtype, global shape) of every tensor it holds
    pieces: list[tuple[str, Piece]] = []
    state: Any = None
    replicas: list[Replica] = []  # only with check_replicas


SAVING_MARKER = ".ucp-saving"
"""Object stores: written first under a prefix a save writes in place, deleted after its manifest. A prefix
with it and no manifest is an interrupted save, which a later save may replace (never a checkpoint)."""


def make_temp_dir(storage: Storage, name: str) -> str:
    """Create and return the temporary sibling directory of checkpoint ``name``.

    Where the storage cannot rename (``storage.renames`` False: object stores) the save writes in place:
    ``name`` itself is returned, after any checkpoint there was retired (manifest deleted first, so it
    stops being one at once; see :func:`check_replaceable`) and :data:`SAVING_MARKER` written.
    """
    if not storage.renames:
        if storage.exists(name):
            check_replaceable(storage, name)
            if storage.exists(f"{name}/{MANIFEST_NAME}"):  # no rename: a crash before the commit loses both
                log.warning(
                    "replacing the checkpoint at %s in place: it is gone until the new one commits",
                    storage.describe(name),
                )
            storage.remove_tree(name)
        storage.write_small(f"{name}/{SAVING_MARKER}", b"")
        return name
    temp = f".{name}.tmp-{secrets.token_hex(6)}"
    storage.makedirs(temp)
    return temp


def build_manifest(
    reports: list[RankReport],
    *,
    world_size: int,
    step: int | None,
    metadata: dict[str, Any],
    mesh: dict[str, int] | None,
    created: datetime,
) -> Manifest:
    """Merge the ranks' reports into a checked manifest; CommitError when they do not fit together."""
    failed = [r for r in reports if r.error is not None]
    if failed:
        detail = "; ".join(f"rank {r.rank}: {r.error}" for r in failed)
        raise CommitError(
            f"save failed on {len(failed)} rank(s): {detail}", ranks=[r.rank for r in failed], reason=detail
        )
    declared: dict[str, tuple[str, list[int], int]] = {}
    for r in reports:
        for name, dtype, shape in r.tensors:
            if name in declared and declared[name][:2] != (dtype, list(shape)):
                d, s, other = declared[name]
                raise CommitError(
                    f"tensor {name!r}: rank {other} holds it as {d} {s}, rank {r.rank} as {dtype} {list(shape)}",
                    ranks=(other, r.rank),
                    reason="the ranks hold the tensor with different dtypes or shapes",
                    tensor=name,
                )
            declared.setdefault(name, (dtype, list(shape), r.rank))
    pieces: dict[str, list[Piece]] = defaultdict(list)
    for r in reports:
        for name, piece in r.pieces:
            pieces[name].append(piece)
    tensors = {  # values already typed (this process's plan, or validated RankReports): no re-validation
        name: TensorEntry.model_construct(dtype=dtype, shape=list(shape), pieces=pieces.get(name, []))
        for name, (dtype, shape, _) in declared.items()
    }
    files = {r.file: FileInfo(rank=r.rank, size=r.file_size) for r in reports if r.file is not None}
    manifest = Manifest(
        format_version=FORMAT_VERSION,
        creator=creator(),
        created=created,
        step=step,
        topology=Topology(world_size=world_size, mesh=mesh),
        files=files,
        tensors=tensors,
        state=merge_trees([r.state for r in reports]),
        metadata=metadata,
    )
    try:
        check_manifest(manifest, source="new manifest")
    except ManifestError as exc:
        hint = ""
        if "cover" in str(exc):
            hint = (
                " (plain tensors must be present on every rank; wrap rank-local tensors in "
                "ShardedTensor/FlatShard, and give exactly one replica of each shard replica_id 0)"
            )
        raise CommitError(
            f"the ranks' pieces do not form a valid checkpoint: {exc}{hint}", ranks=(), reason=f"{exc}{hint}"
        ) from None
    check_replicas(reports, manifest)
    return manifest


def check_replicas(reports: list[RankReport], manifest: Manifest) -> None:
    """CommitError when a rank's replica of a region differs from the bytes written for it.

    Each replica is compared with the written piece of the same region (a replica whose region
    no single piece has, e.g. a shard written in another split, is not compared).
    """
    written = {
        (name, p.box.model_dump_json() if p.box else p.flat.model_dump_json()): p  # type: ignore[union-attr]
        for name, entry in manifest.tensors.items()
        for p in entry.pieces
    }
    for r in reports:
        for rep in r.replicas:
            key = (rep.tensor, rep.box.model_dump_json() if rep.box else rep.flat.model_dump_json())  # type: ignore[union-attr]
            piece = written.get(key)
            if piece is not None and piece.crc32c != rep.crc32c:
                where = f"elements {key[1]}" if rep.flat else f"box {key[1]}"
                raise CommitError(
                    f"tensor {rep.tensor!r}: rank {r.rank}'s copy of {where} differs from the one rank "
                    f"{manifest.files[piece.file].rank} wrote (CRC-32C {rep.crc32c:#010x} vs {piece.crc32c:#010x}); "
                    "replicas that should be equal are not: nothing was committed",
                    ranks=(r.rank,),
                    reason="a replica differs from the written copy",
                    tensor=rep.tensor,
                )


def commit(
    storage: Storage, temp: str, name: str, manifest: Manifest, *, before_swap: Callable[[], None] | None = None
) -> bytes:
    """Write the manifest into ``temp`` and make ``temp`` the checkpoint ``name``, replacing any old one.

    Returns the manifest bytes written. ``before_swap`` is a test hook called after the
    manifest is durable, just before the rename. When ``name`` is a symlink (to a checkpoint or an
    empty directory), the link itself is replaced by the new directory and removed; the directory
    it pointed to is left as it was (see ``storage.remove_path``).
    """
    data = manifest.to_json()
    if temp == name:  # in place (no rename): the manifest, one atomic PUT, is the commit
        if before_swap is not None:
            before_swap()
        storage.write_small(f"{name}/{MANIFEST_NAME}", data)
        try:
            storage.remove_file(f"{name}/{SAVING_MARKER}")
        except (OSError, CheckpointError) as exc:  # harmless: readers go by the manifest alone
            log.warning("could not remove %s: %s", storage.describe(f"{name}/{SAVING_MARKER}"), exc)
        return data
    storage.write_small(f"{temp}/{MANIFEST_NAME}", data)
    storage.sync_dir(temp)
    if before_swap is not None:
        before_swap()
    if not storage.exists(name):
        storage.rename(temp, name)
        storage.sync_dir("")
        return data
    check_replaceable(storage, name)
    old = f".{name}.old-{secrets.token_hex(6)}"
    if storage.exchange(temp, name):  # atomic: ``name`` holds the old or the new, never nothing
        storage.sync_dir("")
        try:  # ``temp`` now holds the old checkpoint: give it the name leftovers of old ones have
            storage.rename(temp, old)
        except OSError:
            old = temp
        storage.remove_tree(old)
        return data
    storage.rename(name, old)
    try:
        storage.rename(temp, name)
    except BaseException:
        storage.rename(old, name)  # the old checkpoint goes back: the path never stays empty
        raise
    storage.sync_dir("")
    storage.remove_tree(old)
    return data


class Committer(ABC):
    """How the ranks of one save agree on its outcome and make it the checkpoint: all of it, or nothing.

    Each rank calls :meth:`commit` once, after its data file is durable, with its :class:`RankReport`
    (its pieces, or its error). Rank 0 merges the reports (:func:`build_manifest`) and commits
    (:func:`commit`); every rank gets the same outcome.
    """

    @abstractmethod
    def commit(self, report: RankReport) -> Manifest:
        """Take part in the commit: the committed manifest, or an error on every rank with nothing committed
        (a report with an error fails the save; the temporary directory is then removed)."""


class CollectiveCommit(Committer):
    """``ucp.save``: the reports are gathered to rank 0, which commits and broadcasts the outcome."""

    def __init__(
        self,
        storage: Storage,
        temp: str | None,
        name: str,
        group: "Group",
        *,
        step: int | None,
        metadata: dict[str, Any],
        mesh: dict[str, int] | None,
        before_swap: Callable[[], None] | None = None,
    ) -> None:
        self.storage, self.temp, self.name, self.group = storage, temp, name, group
        self.step, self.metadata, self.mesh = step, metadata, mesh
        self.before_swap = before_swap

    def commit(self, report: RankReport) -> Manifest:
        group, storage = self.group, self.storage
        reports = group.gather(report.model_dump_json() if group.distributed else report)
        outcome: tuple[str | None, str | None, tuple[int, ...]] = (None, None, ())  # (manifest json, error, ranks)
        manifest: Manifest | None = None
        if group.rank == 0:
            assert reports is not None
            parsed = [r if isinstance(r, RankReport) else RankReport.model_validate_json(r) for r in reports]
            try:
                manifest = build_manifest(
                    parsed,
                    world_size=group.world_size,
                    step=self.step,
                    metadata=self.metadata,
                    mesh=self.mesh,
                    created=now_utc(),
                )
                data = commit(storage, self.temp, self.name, manifest, before_swap=self.before_swap)  # type: ignore[arg-type]
                outcome = (data.decode() if group.distributed else None, None, ())
            except BaseException as exc:
                abort(storage, self.temp)
                if not group.distributed:
                    raise
                ranks = exc.ranks if isinstance(exc, CommitError) else (group.rank,)
                outcome = (None, f"{type(exc).__name__}: {exc}", ranks)
        text, error, ranks = group.broadcast(outcome)
        if manifest is not None and error is None:
            return manifest
        if error is not None or text is None:
            raise CommitError(f"saving {storage.describe(self.name)} failed: {error}", ranks=ranks, reason=str(error))
        # rank 0 checked it before committing; here it only needs to become a Manifest again
        return Manifest.model_validate_json(text)


def check_replaceable(storage: Storage, name: str) -> None:
    """Refuse to replace anything but a checkpoint or an empty directory (never delete a user's data)."""
    if storage.exists(f"{name}/{MANIFEST_NAME}"):
        return
    if not storage.renames and storage.exists(f"{name}/{SAVING_MARKER}"):
        return  # an interrupted in-place save
    try:
        entries: list[str] | None = storage.listdir(name)
    except OSError:
        entries = None
    if entries == []:
        return
    raise DestinationError(
        f"{storage.describe(name)} exists and is not a checkpoint (no {MANIFEST_NAME}); refusing to replace it"
    )


def abort(storage: Storage, temp: str | None) -> None:
    """Remove a failed save's temporary directory (best effort: never masks the original error)."""
    if temp is None:
        return
    try:
        storage.remove_tree(temp)
    except Exception as exc:  # pragma: no cover - depends on the file system
        log.warning("could not remove %s: %s", storage.describe(temp), exc)


# -- saves in flight: a lock on their temporary directory ------------------------------------------
# A cleaner (CheckpointManager.clean_leftovers, another manager on the same root) must tell a
# temporary directory of a save in flight from one an interrupted save left behind: every save
# holds a shared flock on its directory until it commits or aborts.


def lock_temp(storage: Storage, temp: str) -> int | None:
    """Mark the save into ``temp`` as in flight (local storage); the fd to close when it ends."""
    path = storage.local_path(temp)
    return lock_dir(path) if path is not None and storage.supports_locks else None


def lock_dir(path: str) -> int | None:
    """Hold a shared flock on a directory (a save in flight); returns the fd to close, None when impossible."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # a cleaner's probe holds it exclusively for an instant at most
    except OSError:
        pass  # no flock on this file system: the save just goes unprotected from cleaners
    return fd


def dir_in_use(path: str) -> bool:
    """Whether some process holds a save-in-flight lock on the directory."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        return exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
    finally:
        os.close(fd)  # also drops our probe lock
    return False


def close_fd(fd: int | None) -> None:
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass
