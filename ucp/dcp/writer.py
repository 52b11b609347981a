"""``ucp.dcp.Writer``: a DCP ``StorageWriter`` that writes an ordinary UCP checkpoint.

``torch.distributed.checkpoint.save(state, storage_writer=ucp.dcp.Writer(path))`` runs DCP's own
planning (flattening, deduplication of replicated tensors, DTensor/ShardedTensor chunks) and
hands each rank the chunks it writes. This writer turns them into what ``ucp.save`` writes, with
``ucp.save``'s own code:

* ``prepare_global_plan`` (coordinator): names every tensor (:func:`ucp.dcp.mapping.tensor_names`),
  creates the temporary directory (``store.commit.make_temp_dir``, locked as in flight) and sends
  both to the ranks in their plans' ``storage_data``;
* ``write_data`` (every rank): its chunks become ``ShardedTensor`` leaves, planned
  (``saving.plan.plan_save``: aligned safetensors layout) and written
  (``store.writer.write_rank_file``: O_DIRECT through ``aio``, CRC-32C on the way out) into
  ``rank-<k>.safetensors``; each chunk's piece record goes back to the coordinator in its
  ``WriteResult``; plain values go back as JSON (never pickled, see :mod:`ucp.dcp.mapping`);
* ``finish`` (coordinator): the pieces become ``store.commit.RankReport``\\ s,
  ``store.commit.build_manifest`` merges and checks them, ``store.commit.commit`` writes
  manifest.json and swaps the directory in atomically.

So the result is a UCP checkpoint like any other (``ucp.load``, ``ucp verify``, ``ucp reshape``,
``ucp export``), and :class:`ucp.dcp.Reader` (or ``ucp.load``) reads it back. DCP tells a writer
nothing of a failed save: the ``.<name>.tmp-*`` directory of one is removed when the coordinator's
writer starts its next save or is released (a one-rank save's at once, when its own write fails);
a process killed mid-save leaves it behind, as ``ucp.save`` does, for ``CheckpointManager`` to clean.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from aio import AioConfig
from ucp.dcp.mapping import dtype_of, state_tree, tensor_names, value_node
from ucp.errors import CheckpointError, CommitError, UnsupportedStateError
from ucp.format.manifest import Manifest, Piece, now_utc
from ucp.format.sharding import ShardedTensor, Shards
from ucp.format.tree import Leaf
from ucp.saving.plan import PLAN_CACHE, plan_save
from ucp.saving.snapshot import snapshot
from ucp.saving.sync_save import check_step_and_metadata
from ucp.store import commit as _commit
from ucp.store.storage import Storage, as_aio_config, open_storage
from ucp.store.writer import write_rank_file

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankPlan:
    """What the coordinator tells each rank in its plan's ``storage_data``."""

    temp: str  # the save's temporary directory, relative to the checkpoint's parent
    rank: int
    world_size: int
    names: dict[str, str]  # FQN -> logical tensor name, for this rank's tensor items


@dataclass(frozen=True)
class Written:
    """A ``WriteResult.storage_data``: the piece written for one chunk."""

    file: str
    file_size: int
    tensor: str
    piece: dict[str, Any]  # the manifest piece, as JSON


@dataclass(frozen=True)
class PlainValue:
    """A ``WriteResult.storage_data``: a plain value's state-tree node (JSON)."""

    node: Any


class Writer(StorageWriter):
    """Write a ``torch.distributed.checkpoint.save`` as a UCP checkpoint at ``path`` (see the module doc).

    ``step`` and ``metadata`` go into the manifest as ``ucp.save`` records them; ``aio_config`` and
    ``storage_options`` (an fsspec path's options) as for ``ucp.save``. A ``checkpoint_id`` given to
    ``dcp.save`` replaces ``path``. Every rank must see the same directory (a shared file system),
    as for ``ucp.save``. Non-tensor values must be plain JSON-like data (UnsupportedStateError
    otherwise): they are stored as JSON, never pickled.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        step: int | None = None,
        metadata: dict[str, Any] | None = None,
        aio_config: AioConfig | dict[str, Any] | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        check_step_and_metadata(step, metadata)
        self.path = os.fspath(path)
        self.step = step
        self.metadata: dict[str, Any] = dict(metadata or {})
        self.aio_config = as_aio_config(aio_config)
        self.storage_options = storage_options
        self.is_coordinator = False
        self.manifest: Manifest | None = None  # the committed manifest (coordinator, after finish)
        self._temp: str | None = None  # the temporary directory of the save in progress (coordinator)
        self._temp_path = self.path  # ... of the checkpoint at this path
        self._names: dict[str, str] = {}
        self._lock_fd: int | None = None

    @property
    def checkpoint_id(self) -> str:
        return self.path

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._abandon()
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
        self._names, self.manifest = {}, None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives") is False and _world_size() > 1:
            raise CheckpointError(
                "ucp.dcp.Writer needs dcp.save(use_collectives=True): the ranks' pieces are committed "
                "together into one manifest by the coordinator"
            )
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Refuse dtypes the format cannot hold before anything is written."""
        for item in plan.items:
            if item.tensor_data is not None:
                dtype_of(item.tensor_data.properties.dtype, item.index.fqn)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Name the tensors, create the temporary directory, and tell every rank both."""
        if any(not p.usable for p in plans):
            raise CheckpointError(
                "ucp.dcp.Writer does not support DefaultSavePlanner(enable_plan_caching=True): every save "
                "needs a fresh temporary directory, sent to the ranks in their plans"
            )
        fqns = dict.fromkeys(i.index.fqn for p in plans for i in p.items if i.type != WriteItemType.BYTE_IO)
        names = tensor_names(list(fqns))
        self._abandon()
        with self._storage() as (storage, name):
            if storage.exists(name):
                _commit.check_replaceable(storage, name)  # fail now, not after writing everything
            temp = _commit.make_temp_dir(storage, name)
            self._lock_fd = _commit.lock_temp(storage, temp)
        self._temp, self._temp_path, self._names = temp, self.path, names
        out = []
        for rank, p in enumerate(plans):
            mine = {i.index.fqn: names[i.index.fqn] for i in p.items if i.type != WriteItemType.BYTE_IO}
            out.append(dataclasses.replace(p, storage_data=RankPlan(temp, rank, len(plans), mine)))
        return out

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's chunks as one data file; plain values go back to the coordinator as JSON."""
        info = plan.storage_data
        if not isinstance(info, RankPlan):
            raise CheckpointError("ucp.dcp.Writer: the save plan lacks the writer's storage data (prepare_global_plan)")
        try:
            results = self._write(info, plan, planner)
        except BaseException:
            if info.world_size == 1:  # no other rank writes into the temporary directory: remove it now
                self._abandon()
            raise
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def _write(self, info: RankPlan, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        results: list[WriteResult] = []
        chunks: dict[str, list[WriteItem]] = {}
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                node = value_node(item.index.fqn, _lookup(planner, item))
                results.append(WriteResult(index=item.index, size_in_bytes=0, storage_data=PlainValue(node)))
            else:
                chunks.setdefault(item.index.fqn, []).append(item)
        leaves = [_leaf(info.names[fqn], fqn, items, planner) for fqn, items in chunks.items()]
        if leaves:
            save_plan = plan_save(leaves, info.rank, info.world_size, cache=PLAN_CACHE)
            with self._storage() as (storage, _):
                records = write_rank_file(
                    storage, f"{info.temp}/{save_plan.file}", save_plan, snapshot(save_plan, leaves)
                )
            items = list(chunks.values())
            assert save_plan.file is not None  # every leaf is this rank's to write
            for planned, (tensor, piece) in zip(save_plan.pieces, records):
                item = items[planned.leaf][planned.part or 0]
                written = Written(save_plan.file, save_plan.file_size, tensor, piece.model_dump(mode="json"))
                results.append(WriteResult(index=item.index, size_in_bytes=piece.length, storage_data=written))
        return results

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Merge every rank's pieces into the manifest, check it, and commit the checkpoint atomically."""
        temp = self._temp
        if temp is None:
            raise CheckpointError("ucp.dcp.Writer.finish: no save in progress (prepare_global_plan was not run)")
        try:
            with self._storage() as (storage, name):
                try:
                    reports = self._reports(metadata, results)
                    manifest = _commit.build_manifest(
                        reports,
                        world_size=len(results),
                        step=self.step,
                        metadata=self.metadata,
                        mesh=None,
                        created=now_utc(),
                    )
                    _commit.commit(storage, temp, name, manifest)
                except BaseException:
                    _commit.abort(storage, temp)
                    raise
        finally:
            self._release()
            self._temp = None  # committed, or removed by abort
        self.manifest = manifest

    def _reports(self, metadata: Metadata, results: list[list[WriteResult]]) -> list[_commit.RankReport]:
        values: dict[str, Any] = {}
        reports = []
        for rank, written in enumerate(results):
            file, size, pieces = None, 0, []
            for r in written:
                data = r.storage_data
                if isinstance(data, PlainValue):
                    values[r.index.fqn] = data.node
                elif isinstance(data, Written):
                    file, size = data.file, data.file_size
                    pieces.append((data.tensor, Piece.model_validate(data.piece)))
                else:
                    raise CommitError(
                        f"rank {rank} returned a write result ucp.dcp.Writer did not make ({r.index.fqn!r})",
                        ranks=(rank,),
                        reason="foreign write result",
                    )
            reports.append(_commit.RankReport(rank=rank, file=file, file_size=size, pieces=pieces, state={"dict": {}}))
        nodes: dict[str, Any] = {}
        tensors: list[tuple[str, str, list[int]]] = []
        paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else None
        listed = metadata.state_dict_metadata
        order = [f for f in paths if f in listed] if paths is not None else []  # the state dict's own order
        for fqn in dict.fromkeys(order + list(listed)):
            md = listed[fqn]
            if isinstance(md, TensorStorageMetadata):
                name = self._names.get(fqn)
                if name is None:  # a tensor no rank planned to write: DCP lists its chunks, nobody wrote them
                    raise CommitError(f"tensor {fqn!r}: no rank wrote it", ranks=(), reason="unwritten tensor")
                nodes[fqn] = {"tensor": name}
                tensors.append((name, dtype_of(md.properties.dtype, fqn), list(md.size)))
            elif fqn in values:
                nodes[fqn] = values[fqn]
            else:
                raise CommitError(f"{fqn!r}: no rank wrote its value", ranks=(), reason="unwritten value")
        tree = state_tree(nodes, paths)
        reports[0] = reports[0].model_copy(update={"tensors": tensors, "state": tree})
        return reports

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    @contextlib.contextmanager
    def _storage(self) -> Iterator[tuple[Storage, str]]:
        storage, name = open_storage(self.path, storage_options=self.storage_options, aio_config=self.aio_config)
        with storage:
            yield storage, name

    def _release(self) -> None:
        _commit.close_fd(self._lock_fd)
        self._lock_fd = None

    def _abandon(self) -> None:
        """Remove the temporary directory of a save that never reached :meth:`finish` and drop its lock.

        DCP calls ``finish`` only when every rank's ``write_data`` succeeded, and tells the writer nothing
        otherwise; by the time it raises, every rank's ``write_data`` has returned (the coordinator gathered
        their results), so nothing writes into the directory any more. Called when the writer starts
        another save or is released; best effort, as ``ucp.save``'s abort is.
        """
        temp, self._temp = self._temp, None
        self._release()
        if temp is None:
            return
        try:
            storage, _ = open_storage(self._temp_path, storage_options=self.storage_options)
            with storage:
                _commit.abort(storage, temp)
        except Exception as exc:  # pragma: no cover - e.g. at interpreter exit; CheckpointManager cleans leftovers
            log.warning("could not remove %s of an unfinished save: %s", temp, exc)

    def __del__(self) -> None:  # the writer of a save DCP gave up on
        self._abandon()


def _leaf(name: str, fqn: str, items: list[WriteItem], planner: SavePlanner) -> Leaf:
    """This rank's chunks of one tensor as a ShardedTensor (or Shards of several), each written by this rank."""
    parts = []
    for item in items:
        assert item.tensor_data is not None  # a tensor item
        chunk = item.tensor_data.chunk
        data = planner.resolve_data(item)
        if not isinstance(data, torch.Tensor):
            raise UnsupportedStateError(f"{fqn!r}: the planner resolved a tensor item to {type(data).__name__}")
        if tuple(data.shape) != tuple(chunk.sizes):
            raise UnsupportedStateError(
                f"{fqn!r}: the planner resolved a chunk of size {list(chunk.sizes)} to a tensor of shape {list(data.shape)}"
            )
        parts.append(ShardedTensor(local=data, global_shape=tuple(item.tensor_data.size), offsets=tuple(chunk.offsets)))
    return Leaf(name, (fqn,), parts[0] if len(parts) == 1 else Shards(parts))


def _lookup(planner: SavePlanner, item: WriteItem) -> Any:
    """A plain value as it is in the state dict (not DCP's pickle of it)."""
    lookup = getattr(planner, "lookup_object", None)
    if lookup is None:
        raise UnsupportedStateError(
            f"{item.index.fqn!r}: ucp.dcp.Writer stores plain values as JSON and reads them with the planner's "
            f"lookup_object, which {type(planner).__name__} lacks (use DefaultSavePlanner or a subclass)"
        )
    return lookup(item.index)


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
