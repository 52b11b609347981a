"""Export to Hugging Face safetensors: ``model.safetensors``, or shards plus ``model.safetensors.index.json``.

Each output file is written front to back in one pass: its safetensors header is
computed up front from the tensors' shapes and dtypes (no data needed), then the
tensors are read in memory-bounded batches and appended in header order through
an aio ``FileWriter`` (fsync'd on close). Within a file tensors are laid out by
descending item size, so every tensor starts at a multiple of its item size.

Shards follow the Hugging Face convention: ``model-00001-of-00003.safetensors``
..., filled greedily in checkpoint order, each holding at most ``max_shard_size``
bytes of tensor data (a single larger tensor gets a shard of its own); the index
maps every tensor name to its file, with ``metadata.total_size`` the bytes of all
tensor data. When everything fits in one shard the output is a single
``model.safetensors`` and no index.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from aio import AioConfig, shared_handle
from ucp.conversion.exporters.options import ExportError
from ucp.conversion.exporters.selection import ExportTensor, Selection
from ucp.conversion.exporters.stream import one_by_one, read_batches
from ucp.format.manifest import Manifest
from ucp.format.regions import RawArray
from ucp.store.storage import Storage

CONSOLIDATED = "model.safetensors"
INDEX = "model.safetensors.index.json"
Progress = Callable[[int, int, str], None]


def shard_name(index: int, count: int) -> str:
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def plan_shards(tensors: Sequence[ExportTensor], max_shard_size: int | None) -> list[list[ExportTensor]]:
    """Consecutive groups of at most ``max_shard_size`` output bytes (a larger tensor alone)."""
    if max_shard_size is None:
        return [list(tensors)]
    shards: list[list[ExportTensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.out_nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.out_nbytes
    return shards


def file_layout(tensors: Sequence[ExportTensor]) -> tuple[bytes, list[ExportTensor]]:
    """(the file's first bytes: u64 header length + JSON header, the tensors in data order)."""
    ordered = sorted(tensors, key=lambda t: (-t.out_itemsize, t.out_name))
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    pos = 0
    for t in ordered:
        header[t.out_name] = {
            "dtype": t.out_dtype_name,
            "shape": list(t.shape),
            "data_offsets": [pos, pos + t.out_nbytes],
        }
        pos += t.out_nbytes
    text = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)  # data starts 8-byte aligned
    return struct.pack("<Q", len(text)) + text, ordered


def export_hf(
    storage: Storage,
    name: str,
    manifest: Manifest,
    selection: Selection,
    out_dir: Path,
    *,
    max_shard_size: int | None,
    budget: int,
    verify: bool,
    progress: Progress | None = None,
    transforms: Mapping[str, Callable[[Any], Any]] | None = None,
) -> list[str]:
    """Write ``selection`` into ``out_dir``; returns the file names written (index last).
    ``transforms``: by output name, a function of a tensor's bytes returning the bytes to write instead
    (the same length: a reordering, as :mod:`.gpt_map` does to a fused QKV)."""
    for t in selection.tensors:
        if t.out_name == "__metadata__":  # safetensors' own header key: the file would not parse
            raise ExportError(
                f"tensor {t.name!r} would be exported as '__metadata__', a name safetensors "
                "reserves; export another section, or rename it in the state dict"
            )
    shards = plan_shards(selection.tensors, max_shard_size)
    names = [CONSOLIDATED] if len(shards) == 1 else [shard_name(i, len(shards)) for i in range(len(shards))]
    layouts = [file_layout(s) for s in shards]
    values = one_by_one(
        read_batches(
            storage,
            name,
            manifest,
            [t for _, ordered in layouts for t in ordered],
            budget=budget,
            verify=verify,
            raw=True,
        )
    )
    io = shared_handle(AioConfig())
    total, done = selection.nbytes, 0
    for file, (head, ordered) in zip(names, layouts):
        size = len(head) + sum(t.out_nbytes for t in ordered)
        with io.writer(out_dir / file, size_hint=size, fsync=True) as w:
            w.write(head)
            for t in ordered:
                got, value = next(values)
                assert got is t, "tensors are read in file order"
                if t.entry.numel:
                    data = _bytes(value)
                    if transforms and t.out_name in transforms:
                        data = transforms[t.out_name](data)
                    w.write(data)
                del value
                done += t.out_nbytes
                if progress is not None:
                    progress(done, total, t.out_name)
        if w.size != size:
            raise OSError(f"{file}: wrote {w.size} bytes, expected {size}")
    if len(shards) > 1:
        weight_map = {t.out_name: file for file, shard in zip(names, shards) for t in shard}
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        _write_small(out_dir / INDEX, json.dumps(index, indent=2, ensure_ascii=False).encode() + b"\n")
        names.append(INDEX)
    return names


def _bytes(value: Any) -> Any:  # a buffer: memoryview or numpy.ndarray
    """A value from ``read_batches`` as flat bytes: a raw array of stored bytes, or a (cast) torch tensor."""
    if isinstance(value, RawArray):
        return value.data
    import torch

    return value.contiguous().reshape(-1).view(torch.uint8).numpy()


def _write_small(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
