"""``ucp.dcp.Reader``: a DCP ``StorageReader`` over any UCP checkpoint.

``torch.distributed.checkpoint.load(state, storage_reader=ucp.dcp.Reader(path))`` loads a UCP
checkpoint, whether :class:`ucp.dcp.Writer` or ``ucp.save`` wrote it: ``read_metadata`` reads and
checks the manifest (``store.reader.read_manifest``) and derives DCP's ``Metadata`` from it
(:func:`ucp.dcp.mapping.dcp_view`: FQNs from the state tree, chunks from the pieces).
``read_data`` turns DCP's read items into ``ucp.loading.partial`` targets (a box of a logical
tensor each) and fills them as ``ucp.load(into=...)`` does: only the pieces that intersect them,
straight into the tensor's memory where the layout allows, every piece's CRC-32C checked
(``verify=False`` skips that), data files' sizes and safetensors headers checked against the
manifest.

Plain values are kept as JSON in the manifest. DCP's planner interface takes them as a byte stream
it deserializes with ``torch.load``: the reader makes that stream in memory (``torch.save`` of the
value decoded from the JSON), so nothing read from storage is ever unpickled.
"""

from __future__ import annotations

import contextlib
import io
import os
from typing import Any, Iterator

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from aio import AioConfig
from reshard.box import Box
from ucp.dcp.mapping import DcpView, dcp_view
from ucp.errors import LayoutMismatchError
from ucp.format.manifest import MANIFEST_NAME, Manifest
from ucp.loading.partial import Target, read_targets
from ucp.store.reader import read_manifest
from ucp.store.storage import Storage, as_aio_config, open_storage


class Reader(StorageReader):
    """Read the UCP checkpoint at ``path`` for ``torch.distributed.checkpoint.load`` (see the module doc).

    ``verify``: check every piece's CRC-32C as it is read (the default). ``aio_config`` and
    ``storage_options`` as for ``ucp.load``. A ``checkpoint_id`` given to ``dcp.load`` replaces ``path``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        verify: bool = True,
        aio_config: AioConfig | dict[str, Any] | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self.verify = verify
        self.aio_config = as_aio_config(aio_config)
        self.storage_options = storage_options
        self.manifest: Manifest | None = None
        self._view: DcpView | None = None

    @property
    def checkpoint_id(self) -> str:
        return self.path

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
        self.manifest, self._view = None, None

    # ``**options``, not ``**kwargs``: DCP retries a failed read_metadata(rank=...) as a "rank-local" read when
    # the signature names ``kwargs``, which would only repeat the error under another message.
    def read_metadata(self, *args: Any, **options: Any) -> Metadata:
        """DCP's metadata, derived from the checked manifest (NotACheckpointError naming the path when absent)."""
        with self._storage() as (storage, name):
            manifest = read_manifest(storage, name)
            source = storage.describe(f"{name}/{MANIFEST_NAME}")
        self.manifest, self._view = manifest, dcp_view(manifest, source=source)
        return self._view.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self._view is None:
            self.read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Fill every tensor item from the pieces it needs (CRC-checked); hand plain values to the planner."""
        if self._view is None or self.manifest is None:
            self.read_metadata()
        view, manifest = self._view, self.manifest
        assert view is not None and manifest is not None
        targets: list[Target] = []
        filled: list[tuple[ReadItem, torch.Tensor]] = []
        for item in plan.items:
            fqn = item.storage_index.fqn
            if item.type == LoadItemType.BYTE_IO:
                if fqn not in view.values:
                    raise LayoutMismatchError(f"{fqn!r}: DCP asks for a plain value; {self.path} holds a tensor there")
                stream = io.BytesIO()
                torch.save(view.value(fqn), stream)  # made here from JSON: DCP's planner torch.loads it
                stream.seek(0)
                planner.load_bytes(item, stream)
                continue
            name = view.tensors.get(fqn)
            if name is None:
                raise LayoutMismatchError(f"{fqn!r}: DCP asks for a tensor; {self.path} holds a plain value there")
            dest = planner.resolve_tensor(item).detach()
            if tuple(dest.shape) != tuple(item.lengths):
                raise LayoutMismatchError(
                    f"{fqn!r}: the planner resolved a read of {list(item.lengths)} to a tensor of shape {list(dest.shape)}"
                )
            chunk = item.storage_index.offset or torch.Size([0] * len(item.lengths))
            box = Box(tuple(a + b for a, b in zip(chunk, item.storage_offsets)), tuple(item.lengths))
            targets.append(Target(name, dest, box, (fqn,)))
            filled.append((item, dest))
        if targets:
            with self._storage() as (storage, name):
                read_targets(storage, name, manifest, targets, verify=self.verify)
        for item, dest in filled:
            planner.commit_tensor(item, dest)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        text = os.fspath(checkpoint_id)
        return "://" in text or os.path.isfile(os.path.join(text, MANIFEST_NAME))

    @contextlib.contextmanager
    def _storage(self) -> Iterator[tuple[Storage, str]]:
        storage, name = open_storage(self.path, storage_options=self.storage_options, aio_config=self.aio_config)
        with storage:
            yield storage, name
