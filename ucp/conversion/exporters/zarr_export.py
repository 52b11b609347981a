"""Export to a zarr v3 group: one compressed, chunked array per tensor.

Layout (documented in docs/import-export.md):

* one array per tensor, directly under the group, named by the tensor's output
  name (dots kept: ``layers.0.attn.qkv.weight``; flat names keep a 1:1 map with
  tensor names, which a hierarchy cannot when one name is a prefix of another).
  ``%``, ``/`` and ``\\`` are written ``%25``, ``%2F`` and ``%5C`` (zarr reads a ``\\`` as a
  ``/``: unescaped it would nest the array); a name of only dots, the name
  ``zarr.json`` (the group's metadata file), or one starting with ``__`` (reserved by
  zarr v3) has those characters escaped the same way;
* global shape and dtype; dtypes numpy lacks are stored as their raw bits:
  bfloat16 as ``uint16``, the float8 types as ``uint8``. Every array carries
  ``attrs["ucp_dtype"]`` (the torch dtype name it holds, e.g. ``"bfloat16"``)
  and ``attrs["ucp_name"]`` (the tensor name); ``read_tensor`` undoes the bit view;
* chunked along dim 0 to about ``chunk_bytes`` per chunk (further dims are split
  only when one row along dim 0 is larger), compressed with zstd or blosc (zstd
  inside, byte shuffle) through zarr v3 codecs, every chunk written (no chunk is
  skipped for equalling the fill value, so -0.0 and NaN payloads survive);
* group attributes ``attrs["ucp"]``: the source checkpoint (path, step,
  format_version, creator), the section exported, the cast dtype, and
  ``tensors``: output name → array name.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

import numpy as np
import torch

from ucp.conversion.exporters.options import ExportError
from ucp.conversion.exporters.selection import ExportTensor, Selection
from ucp.conversion.exporters.stream import one_by_one, read_batches
from ucp.format.manifest import Manifest
from ucp.store.storage import Storage

Compressor = Literal["zstd", "blosc", "none"]
DEFAULT_CHUNK_BYTES = 32 << 20
DEFAULT_LEVELS = {"zstd": 3, "blosc": 5}
Progress = Callable[[int, int, str], None]

# torch dtypes with no numpy equivalent, stored as unsigned integers of the same width.
_RAW_BITS: dict[torch.dtype, torch.dtype] = {torch.bfloat16: torch.uint16}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"):
    if hasattr(torch, _name):
        _RAW_BITS[getattr(torch, _name)] = torch.uint8


def dtype_text(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def stored_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy dtype a tensor of ``dtype`` is stored as (its raw bits where numpy lacks it)."""
    return torch.empty(0, dtype=_RAW_BITS.get(dtype, dtype)).numpy().dtype


def as_numpy(value: torch.Tensor) -> np.ndarray:
    """A contiguous tensor as the numpy array zarr stores (no copy)."""
    value = value.contiguous()
    raw = _RAW_BITS.get(value.dtype)
    return (value.view(raw) if raw is not None else value).numpy()


def read_tensor(array: Any) -> torch.Tensor:
    """A zarr array written by this exporter, back as a torch tensor of its original dtype."""
    data = torch.from_numpy(np.array(array[...]))  # a copy: contiguous, writable, 0-d kept 0-d
    dtype = getattr(torch, array.attrs.get("ucp_dtype", ""), None)
    return data.view(dtype) if isinstance(dtype, torch.dtype) and dtype != data.dtype else data


def array_name(name: str) -> str:
    """A valid zarr v3 node name for tensor ``name`` (see the module docstring)."""
    out = name.replace("%", "%25").replace("/", "%2F").replace("\\", "%5C")
    if out.startswith("__"):
        out = "%5F" + out[1:]
    if not out or set(out) == {"."} or out == "zarr.json":  # the group's own metadata file is taken
        out = out.replace(".", "%2E") or "%00"
    return out


def chunk_shape(shape: Sequence[int], itemsize: int, chunk_bytes: int) -> tuple[int, ...]:
    """Chunks of about ``chunk_bytes``: as many dim-0 rows as fit; split later dims only when a row is larger."""
    shape = tuple(shape)
    chunks: list[int] = []
    for i, n in enumerate(shape):
        row = itemsize * math.prod(shape[i + 1 :])
        if row == 0 or row * n <= chunk_bytes:
            return tuple(chunks + [max(1, m) for m in shape[i:]])
        if row <= chunk_bytes:
            return tuple(chunks + [max(1, chunk_bytes // row)] + [max(1, m) for m in shape[i + 1 :]])
        chunks.append(1)
    return tuple(chunks)


def codecs(compressor: Compressor, level: int | None) -> list[Any] | None:
    """The zarr v3 compressor codecs for ``compressor`` (None: stored uncompressed)."""
    from zarr.codecs import BloscCodec, ZstdCodec

    if compressor not in ("zstd", "blosc", "none"):
        raise ExportError(f"compressor: unknown compressor {compressor!r} (choose from zstd, blosc, none)")
    if compressor == "none":
        return None
    lvl = DEFAULT_LEVELS[compressor] if level is None else level
    if isinstance(lvl, bool) or not isinstance(lvl, int) or (compressor == "blosc" and not 0 <= lvl <= 9):
        # blosc takes 0-9 but only fails at the first chunk; bools pass as ints: both refused before any work
        raise ExportError(
            f"compressor {compressor!r}: level {level!r} is not accepted"
            + (" (blosc levels are 0-9)" if compressor == "blosc" else " (an integer)")
        )
    try:
        return [ZstdCodec(level=lvl)] if compressor == "zstd" else [BloscCodec(cname="zstd", clevel=lvl)]
    except (TypeError, ValueError) as exc:
        raise ExportError(f"compressor {compressor!r}: level {level!r} is not accepted: {exc}") from None


def export_zarr(
    storage: Storage,
    name: str,
    manifest: Manifest,
    selection: Selection,
    out_dir: Path,
    *,
    source: str,
    cast: torch.dtype | None,
    budget: int,
    verify: bool,
    compressor: Compressor = "zstd",
    level: int | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    progress: Progress | None = None,
) -> list[str]:
    """Write ``selection`` as a zarr v3 group at ``out_dir``; returns the array names."""
    import zarr

    compressors = codecs(compressor, level)
    if chunk_bytes <= 0:
        raise ExportError(f"chunk size must be positive, got {chunk_bytes}")
    names = {t.out_name: array_name(t.out_name) for t in selection.tensors}
    if len(set(names.values())) != len(names):
        raise ExportError("two tensor names map to the same zarr array name after escaping")
    group = zarr.open_group(os.fspath(out_dir), mode="w", zarr_format=3)
    group.attrs["ucp"] = {
        "source": source,
        "step": manifest.step,
        "format_version": manifest.format_version,
        "creator": manifest.creator,
        "section": selection.section,
        "cast_dtype": dtype_text(cast) if cast is not None else None,
        "tensors": names,
    }
    total, done = selection.nbytes, 0
    values = one_by_one(read_batches(storage, name, manifest, selection.tensors, budget=budget, verify=verify))
    for t, value in values:
        _write_array(group, names[t.out_name], t, as_numpy(value), compressors, chunk_bytes)
        del value
        done += t.out_nbytes
        if progress is not None:
            progress(done, total, t.out_name)
    return list(names.values())


def _write_array(
    group: Any, key: str, t: ExportTensor, data: np.ndarray, compressors: list[Any] | None, chunk_bytes: int
) -> None:
    chunks = chunk_shape(t.shape, data.dtype.itemsize, chunk_bytes)
    try:
        array = group.create_array(
            key,
            shape=t.shape,
            dtype=data.dtype,
            chunks=chunks,
            compressors=compressors,
            fill_value=np.zeros((), dtype=data.dtype)[()],
            config={"write_empty_chunks": True},
            attributes={"ucp_name": t.out_name, "ucp_dtype": dtype_text(t.torch_out_dtype)},
        )
        if data.ndim == 0:
            array[...] = data
            return
        step = chunks[0]
        for start in range(0, t.shape[0], step):  # chunk-aligned slabs: no chunk is read back and rewritten
            array[start : start + step] = data[start : start + step]
    except ExportError:
        raise
    except Exception as exc:
        raise ExportError(f"tensor {t.name!r}: writing zarr array {key!r} failed: {type(exc).__name__}: {exc}") from exc
