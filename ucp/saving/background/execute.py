"""Carrying out one job: write this rank's file from its image, then take part in the file-handshake commit."""

from __future__ import annotations

import importlib
import json
import logging
from typing import Callable

from ucp.errors import CommitError
from ucp.format.manifest import Manifest, Piece
from ucp.saving.background.handshake import HandshakeCommit, hold_alive
from ucp.saving.background.image import DirectImage, Progress, write_image, write_streamed
from ucp.saving.background.job import PostCommit, WriteJob, describe
from ucp.saving.staging import Arena
from ucp.store import commit as _commit
from ucp.store.commit import close_fd
from ucp.store.storage import Storage
from ucp.store.writer import write_rank_file

log = logging.getLogger(__name__)


def execute(
    job: WriteJob,
    storage: Storage,
    arena: Arena | None,
    progress: Progress,
    release_arena: Callable[[], None] = lambda: None,
) -> Manifest:
    """Write this rank's file from the arena, then take part in the file-based commit; the committed manifest."""
    alive = hold_alive(storage, job)
    try:
        return _execute(job, storage, arena, progress, release_arena)
    finally:
        close_fd(alive)


def _execute(
    job: WriteJob, storage: Storage, arena: Arena | None, progress: Progress, release_arena: Callable[[], None]
) -> Manifest:
    error: BaseException | None = None
    report: _commit.RankReport | None = None
    try:
        records: list[tuple[str, Piece]] = []
        if job.plan is not None:
            assert arena is not None
            try:
                rel = f"{job.temp}/{job.plan.file}"
                if isinstance(arena, DirectImage):
                    records = write_rank_file(storage, rel, arena.plan, arena.views)
                    arena.check_unchanged()
                elif job.plan.streamed:  # a writer process reading StreamedShards' files
                    records = write_streamed(storage, rel, job.plan, arena, progress)
                else:
                    records = write_image(storage, rel, job.plan, arena, progress)
            finally:
                release_arena()
        report = _commit.RankReport(
            rank=job.rank,
            file=job.plan.file if job.plan else None,
            file_size=job.plan.file_size if job.plan else 0,
            tensors=job.tensors,
            pieces=records,
            state=job.tree,
            replicas=job.replicas,
        )
    except BaseException as exc:  # noqa: BLE001 - reported, then re-raised
        error = exc
        if job.plan is None:
            release_arena()

    if error is not None:
        report = _commit.RankReport(rank=job.rank, error=describe(error))
    assert report is not None
    try:
        manifest = committer(storage, job).commit(report)
    except BaseException:
        if error is None:
            raise
    if error is not None:  # the commit failed on it; this rank's own error says why
        raise error
    if job.post_commit is not None:
        run_post_commit(job.post_commit, storage.describe(job.name))
    return manifest


def committer(storage: Storage, job: WriteJob) -> _commit.Committer:
    """The ranks meet in the temporary directory, or on the object store where they share no directory."""
    if job.handshake is not None:
        from ucp.saving.background.store_handshake import StoreHandshakeCommit

        return StoreHandshakeCommit(storage, job)
    return HandshakeCommit(storage, job)


def run_post_commit(spec: PostCommit, where: str) -> None:
    module, _, func = spec.call.partition(":")
    if not module.startswith("ucp.") or not func:
        raise CommitError(
            f"refusing post-commit call {spec.call!r} (only ucp functions)", ranks=(), reason="not a ucp function"
        )
    try:
        getattr(importlib.import_module(module), func)(**spec.kwargs)
    except Exception as exc:
        raise CommitError(
            f"{where} is committed, but the step after the commit ({spec.call}) failed: {describe(exc)}",
            ranks=(),  # the save itself committed on every rank
            reason=describe(exc),
        ) from exc


class StorageCache:
    """Keeps one local storage (and its aio engine) per directory and config across saves."""

    def __init__(self) -> None:
        self._local: dict[tuple[str, str], Storage] = {}

    def open(self, job: WriteJob) -> tuple[Storage, bool]:
        """(storage, owned): owned storages are the caller's to close."""
        storage, _ = job.open_storage()
        if not storage.local:  # only local storage holds an aio engine worth keeping
            return storage, True
        key = (storage.root, json.dumps(job.aio_config, sort_keys=True))
        cached = self._local.setdefault(key, storage)
        return cached, False

    def close(self) -> None:
        for s in self._local.values():
            s.close()
        self._local.clear()
