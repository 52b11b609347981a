"""Write an imported state whose tensors are still on disk (:mod:`.stored`): a byte copy, no torch.

The foreign files are described as if they were a checkpoint — a manifest whose pieces are the
stored byte ranges (no CRCs: the foreign format has none) — and :func:`ucp.conversion.reshape.rewrite`
writes that consolidated, one piece per tensor, in one file: the same streaming, memory budget,
O_DIRECT writes, CRC-32C on the way out and atomic commit as a reshape.
"""

from __future__ import annotations

import os
from pathlib import Path

from reshard.box import Box, FlatRange, check_exact_cover
from ucp.conversion.importers.common import Imported
from ucp.conversion.importers.errors import ForeignCheckpointError
from ucp.conversion.importers.stored import StoredLeaf, StoredTensor, is_stored
from ucp.conversion.reshape import Progress, Source, consolidated, rewrite
from ucp.format.manifest import FORMAT_VERSION, FileInfo, Manifest, Piece, TensorEntry, Topology, now_utc
from ucp.format.tree import encode_state
from ucp.store.commit import creator
from ucp.store.storage import open_storage


def foreign_manifest(imported: Imported) -> tuple[Manifest, Path]:
    """A manifest describing ``imported``'s stored tensors as pieces of files, and the folder its file
    names are relative to.

    Raises ForeignCheckpointError when a tensor's parts do not cover it exactly once (the layout
    code should make that impossible; a copy must never leave bytes unwritten).
    """
    encoded = encode_state(imported.state, is_leaf=is_stored)
    parts = {leaf.name: _parts(leaf.value) for leaf in encoded.leaves}
    paths = {t.file for leaf_parts in parts.values() for t, _ in leaf_parts}
    root = Path(os.path.commonpath([os.path.dirname(os.path.abspath(p)) for p in paths])) if paths else Path(".")
    files: dict[str, FileInfo] = {}
    tensors: dict[str, TensorEntry] = {}
    for leaf in encoded.leaves:
        value = leaf.value
        assert isinstance(value, (StoredTensor, StoredLeaf))  # encode_state(is_leaf=is_stored) kept them whole
        pieces, regions = [], []
        for t, start in parts[leaf.name]:
            rel = os.path.relpath(os.path.abspath(t.file), root)
            if rel not in files:
                files[rel] = FileInfo.model_construct(rank=0, size=os.path.getsize(t.file))
            region = Box.full(value.shape) if start is None else FlatRange(start, start + t.numel())
            pieces.append(Piece.from_region(region, file=rel, offset=t.offset, length=t.nbytes, crc32c=0))
            regions.append(region)
        if isinstance(value, StoredLeaf):
            why = check_exact_cover(regions, value.shape)
            if why is not None:
                raise ForeignCheckpointError(
                    f"tensor {leaf.name!r}: its parts in {sorted({p.file for p in pieces})} "
                    f"do not cover it exactly once: {why}",
                    tensor=leaf.name,
                    file=os.path.join(root, pieces[0].file),
                )
        tensors[leaf.name] = TensorEntry.model_construct(dtype=value.dtype, shape=list(value.shape), pieces=pieces)
    manifest = Manifest.model_construct(
        format_version=FORMAT_VERSION,
        creator=creator(),
        created=now_utc(),
        step=imported.step,
        topology=Topology.model_construct(world_size=1, mesh=None),
        files=files,
        tensors=tensors,
        state=encoded.tree,
        metadata=imported.metadata,
    )
    return manifest, root


def write_stored(
    imported: Imported, dst: str, *, overwrite: bool = False, progress: Progress | None = None
) -> Manifest:
    """Copy ``imported`` (leaves on disk) into a consolidated UCP checkpoint at ``dst``; its manifest."""
    manifest, root = foreign_manifest(imported)
    storage, name = open_storage(str(root))
    with storage:
        new, _ = rewrite(
            Source(storage, name, manifest, verify=False),
            dst,
            consolidated(manifest),
            metadata=dict(imported.metadata),
            mesh=None,
            overwrite=overwrite,
            progress=progress,
        )
    return new


def _parts(value: object) -> list[tuple[StoredTensor, int | None]]:
    """A leaf's stored parts with their first element; None for a whole tensor (one box piece)."""
    if isinstance(value, StoredTensor):
        return [(value, None)]
    assert isinstance(value, StoredLeaf)
    return list(value.parts)
