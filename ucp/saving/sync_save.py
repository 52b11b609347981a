"""``ucp.save``: plan, snapshot, write, commit — the synchronous save.

The four steps are separate functions so that an asynchronous save can run
(a) and (b) on the training thread and (c) and (d) in the background:

(a) ``plan.plan_save(leaves, rank, world_size) -> SavePlan`` — which pieces this
    rank writes and the file layout (pure; cached by layout in ``plan.PLAN_CACHE``).
    ``leaves`` come from ``tree.encode_state(state_dict)``, which also gives the
    JSON state tree.
(b) ``snapshot.snapshot(plan, leaves) -> list[memoryview]`` — each piece's bytes
    as a contiguous CPU byte view (here: views on the tensors themselves;
    ``snapshot.local_tensor`` / ``host_contiguous`` / ``tensor_bytes`` are the parts;
    ``snapshot.write_views`` adds a ``StreamedShard``'s parts, made as they are written).
(c) ``writer.write_rank_file(storage, rel_path, plan, views) -> [(name, Piece)]`` —
    header then pieces through the storage's writer (``aio`` for local paths), CRC-32C
    computed on the way out by ``writer.CrcChain``.
(d) ``commit.make_temp_dir(storage, name) -> temp``, ``commit.RankReport`` (what each
    rank sends), ``commit.build_manifest(reports, ...) -> Manifest`` (merged and checked),
    ``commit.commit(storage, temp, name, manifest) -> bytes`` (manifest written, atomic
    swap), ``commit.abort(storage, temp)``.

:func:`save_with` strings them together for one rank, with the collectives
(broadcast of the temp dir, gather of RankReports as JSON, broadcast of the outcome)
done through a :class:`~ucp.dist.Group`.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Callable

from aio import AioConfig
from ucp.dist import Group, resolve_group
from ucp.errors import UnsupportedStateError
from ucp.format.manifest import Manifest
from ucp.format.tree import encode_state
from ucp.saving.dtensor import lower_leaves, with_record
from ucp.saving.plan import PLAN_CACHE, SavePlan, plan_save
from ucp.saving.snapshot import replica_checksums, write_views
from ucp.store import commit as _commit
from ucp.store.storage import Storage, as_aio_config, open_storage
from ucp.store.writer import write_rank_file

log = logging.getLogger(__name__)


def save(
    state_dict: dict[str, Any],
    path: str | os.PathLike[str],
    *,
    step: int | None = None,
    metadata: dict[str, Any] | None = None,
    process_group: Any = None,
    aio_config: AioConfig | dict[str, Any] | None = None,
    storage_options: dict[str, Any] | None = None,
    mesh: dict[str, int] | None = None,
    check_replicas: bool = False,
) -> Manifest:
    """Save ``state_dict`` as a checkpoint directory at ``path``, atomically; returns its manifest.

    Under torch.distributed every rank of ``process_group`` (default: the world) calls
    this with its own state dict; each writes its own file in parallel and rank 0
    commits. ``mesh`` (axis name -> size, product = world size) is recorded in the
    manifest's topology. An existing checkpoint at ``path`` is replaced atomically.

    A DTensor (FSDP2, tensor parallelism, any DeviceMesh whose ranks are the process group's) is saved as
    the regions its local shard holds, replicas once, its placement recorded in ``metadata['dtensor']``;
    ``Partial`` placements are refused (``ucp.saving.dtensor``).

    Replicated data is taken from one rank: a plain tensor (held whole by every rank) is written
    by the rank the planner assigns it to (spreading bytes over ranks), a shard by its replica 0;
    plain values and ``step``/``metadata``/``mesh`` are rank 0's. With ``check_replicas`` every
    other rank checksums its copies and the save fails (nothing committed) when one differs from
    the bytes written, naming the tensor and both ranks — a cheap guard against replicas that
    drifted apart (it costs one CRC-32C pass over the replicated bytes each rank does not write).
    A rank that fails makes every rank raise; nothing is committed.
    """
    group = resolve_group(process_group)
    try:
        _check_args(step, metadata, mesh, group)
        storage, name = open_storage(path, storage_options=storage_options, aio_config=as_aio_config(aio_config))
    except BaseException as exc:
        if group.distributed:
            _fail_together(group, exc)
        raise
    with storage:
        return save_with(
            storage,
            name,
            state_dict,
            group,
            step=step,
            metadata=metadata or {},
            mesh=mesh,
            check_replicas=check_replicas,
        )


def _fail_together(group: Group, error: BaseException) -> None:
    """A rank that failed before its save began still takes part in the save's three collectives
    (the temp dir's broadcast, the reports' gather, the outcome's broadcast) with an error report,
    so that every rank gives up at once instead of waiting for it until the collective times out."""
    group.broadcast(None)  # rank 0: "no temporary directory", which fails the others' writes too
    group.gather(_commit.RankReport(rank=group.rank, error=_describe(error)).model_dump_json())
    group.broadcast((None, f"rank {group.rank}: {_describe(error)}", (group.rank,)) if group.rank == 0 else None)


def check_step_and_metadata(step: Any, metadata: Any) -> None:
    """UnsupportedStateError unless ``step`` is an int (not a bool) or None and ``metadata`` None or a dict of
    str keys that is plain JSON; ``ucp.save``, async saves and the DCP writer check their arguments with this."""
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        raise UnsupportedStateError(f"step must be an int or None, got {step!r}")
    if metadata is not None:
        if not isinstance(metadata, dict) or not all(isinstance(k, str) for k in metadata):
            raise UnsupportedStateError("metadata must be a dict with str keys")
        try:
            json.dumps(metadata, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise UnsupportedStateError(f"metadata must be plain JSON (no NaN): {exc}") from None


def _check_args(step: Any, metadata: Any, mesh: Any, group: Group) -> None:
    check_step_and_metadata(step, metadata)
    if mesh is not None:
        ok = isinstance(mesh, dict) and all(
            isinstance(k, str) and isinstance(v, int) and v >= 1 for k, v in mesh.items()
        )
        prod = 1
        for v in mesh.values() if ok else ():
            prod *= v
        if not ok or prod != group.world_size:
            raise UnsupportedStateError(f"mesh {mesh!r} must map axis names to sizes multiplying to {group.world_size}")


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def save_with(
    storage: Storage,
    name: str,
    state_dict: dict[str, Any],
    group: Group,
    *,
    step: int | None,
    metadata: dict[str, Any],
    mesh: dict[str, int] | None,
    before_swap: Callable[[], None] | None = None,
    check_replicas: bool = False,
) -> Manifest:
    """One rank's part of a save into an open storage (see the module docstring for the steps).

    Errors on one rank never leave the others waiting: every rank takes part in every
    collective and reports its error; all ranks then raise.
    """
    local_error: BaseException | None = None
    plan: SavePlan | None = None
    leaves: list = []
    tree: Any = None
    try:
        encoded = encode_state(state_dict)
        leaves, records = lower_leaves(encoded.leaves, group)  # DTensors: this rank's regions
        tree, metadata = encoded.tree, with_record(metadata, records)
        plan = plan_save(leaves, group.rank, group.world_size, cache=PLAN_CACHE)
    except BaseException as exc:
        local_error = exc
        if not group.distributed:
            raise

    temp = None
    lock_fd: int | None = None  # rank 0 marks the save in flight, so no cleaner takes it for a leftover
    if group.rank == 0 and (local_error is None or storage.renames):  # in place: never retire the old one for nothing
        try:
            temp = _commit.make_temp_dir(storage, name)
            lock_fd = _commit.lock_temp(storage, temp)
        except BaseException as exc:
            local_error = local_error or exc
            if not group.distributed:
                raise
    try:
        return _write_and_commit(
            storage,
            name,
            group,
            group.broadcast(temp),
            plan,
            leaves,
            tree,
            local_error,
            step=step,
            metadata=metadata,
            mesh=mesh,
            before_swap=before_swap,
            check_replicas=check_replicas,
        )
    except BaseException:
        if group.rank == 0:  # e.g. a collective failed as a peer died: rank 0 knows the temp dir, nobody else
            _commit.abort(storage, temp)
        raise
    finally:
        _commit.close_fd(lock_fd)


def _write_and_commit(
    storage: Storage,
    name: str,
    group: Group,
    temp: str | None,
    plan: SavePlan | None,
    leaves: list,
    tree: Any,
    local_error: BaseException | None,
    *,
    step: int | None,
    metadata: dict[str, Any],
    mesh: dict[str, int] | None,
    before_swap: Callable[[], None] | None,
    check_replicas: bool = False,
) -> Manifest:
    """Steps (b)-(e) on every rank: write this rank's file into ``temp``, gather the reports, commit."""

    report = _commit.RankReport(rank=group.rank)
    if local_error is None and temp is not None and plan is not None:
        try:
            views = write_views(plan, leaves)
            records = write_rank_file(storage, f"{temp}/{plan.file}", plan, views) if plan.file else []
            replicas = (
                [_commit.Replica.of(*r) for r in replica_checksums(leaves, group.rank, group.world_size)]
                if check_replicas
                else []
            )
            report = _commit.RankReport(
                rank=group.rank,
                file=plan.file,
                file_size=plan.file_size,
                tensors=[(n, d, list(s)) for n, d, s in plan.tensors],
                pieces=records,
                state=tree,
                replicas=replicas,
            )
        except BaseException as exc:
            local_error = exc
            if not group.distributed:
                _commit.abort(storage, temp)
                raise
    if local_error is not None:
        report = _commit.RankReport(rank=group.rank, error=_describe(local_error))
    elif temp is None:
        report = _commit.RankReport(rank=group.rank, error="rank 0 could not create the temporary directory")

    committer = _commit.CollectiveCommit(
        storage, temp, name, group, step=step, metadata=metadata, mesh=mesh, before_swap=before_swap
    )
    try:
        manifest = committer.commit(report)
    except BaseException:
        if local_error is None:
            raise
    if local_error is not None:  # this rank's own error says more than "the save failed"
        raise local_error
    return manifest
