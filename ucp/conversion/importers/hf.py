"""Import Hugging Face safetensors weights: one ``model.safetensors``, or a sharded set with its index.

Result: ``{"model": {name: tensor}}`` in the stored dtypes; the metadata records the folder's
``config.json`` as ``hf_config`` (and ``generation_config.json``, and where its tokenizer files are:
:func:`ucp.conversion.hf_meta.source_files`), so the export back is a loadable model folder.

Each file is opened with ``safetensors.safe_open`` (which validates its header) and memory-mapped; the tensors are views of
the mapping, so a model larger than RAM converts without being read into memory first.

For ``convert`` (``on_disk``) the tensors are byte ranges of the files instead (:mod:`.stored`), copied
without torch: its import takes longer than converting a small model.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ucp.conversion.importers.common import Imported, Progress, inside
from ucp.conversion.importers.errors import ForeignCheckpointError, UnknownFormatError
from ucp.conversion.importers.stored import NeedsTorch, StoredTensor
from ucp.format.dtypes import DTYPE_NAMES, itemsize, torch_dtype

if TYPE_CHECKING:  # torch is imported where tensors are made: the on-disk path never needs it
    import torch

INDEX = "model.safetensors.index.json"


def weight_files(path: str | os.PathLike[str]) -> list[Path]:
    """The safetensors files of ``path``: a file, an index file, or a directory holding either."""
    p = Path(path)
    if p.is_dir():
        if (p / INDEX).is_file():
            return weight_files(inside(p, p / INDEX))
        if (p / "model.safetensors").is_file():
            return [inside(p, p / "model.safetensors")]
        found = sorted(p.glob("*.safetensors"))
        if len(found) == 1:
            return [inside(p, found[0])]
        raise UnknownFormatError(
            f"{str(p)!r} holds no model.safetensors or {INDEX} ({len(found)} other .safetensors files)", file=str(p)
        )
    if p.name.endswith(".index.json"):
        try:
            index = json.loads(p.read_text())
            shards = list(index["weight_map"].values())
            not_names = [n for n in shards if not isinstance(n, str)]
            if not_names:
                raise TypeError(f"shard names must be strings, not {repr(not_names[0])[:40]}")
            names = sorted(set(shards))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ForeignCheckpointError(
                f"file {str(p)!r} is not a safetensors index (weight_map): {exc}", file=str(p)
            ) from None
        for n in names:
            if "/" in n or n.startswith(".."):
                raise ForeignCheckpointError(f"file {str(p)!r} names a shard outside its folder: {n!r}", file=str(p))
        return [inside(p.parent, p.parent / n) for n in names]
    if p.suffix == ".safetensors":
        return [p]
    raise UnknownFormatError(f"{str(p)!r} is not a safetensors file, index or folder", file=str(p))


def _header(file: Path) -> tuple[int, dict[str, Any]]:
    with open(file, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        return 8 + n, json.loads(fh.read(n))


def _checked_header(file: Path) -> tuple[list[str], int, dict[str, Any]]:
    """(tensor names, where the data starts, the header) of a safetensors file whose header
    ``safe_open`` accepts (offsets in bounds, contiguous, matching shapes and dtypes)."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="numpy") as f:  # validates the header; imports no torch
            keys = list(f.keys())
        data_start, header = _header(file)
    except FileNotFoundError:
        raise ForeignCheckpointError(f"file {str(file)!r} is missing", file=str(file)) from None
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise ForeignCheckpointError(
            f"file {str(file)!r} is not a readable safetensors file: {exc}", file=str(file)
        ) from None
    return keys, data_start, header


# safetensors refuses headers larger than this (its HeaderTooLarge)
MAX_HEADER_BYTES = 100_000_000


def _laid_out_header(file: Path) -> tuple[list[str], int, dict[str, Any]]:
    """:func:`_checked_header` for the byte-copy path, without ``safe_open`` (whose ``framework="numpy"``
    imports numpy, ~0.1 s of a one-shot ``ucp convert``): the same checks on what the copy relies on — the
    header a JSON object within the file, every tensor a dtype, a shape and ``data_offsets`` whose length is
    the shape's elements times the dtype's size, the tensors back to back from the data start to the file's
    end. A dtype this version does not name is left to the torch path (``NeedsTorch``), where ``safe_open``
    checks it. Names sorted, as ``safe_open`` lists them."""
    where = f"file {str(file)!r}"

    def bad(reason: str) -> ForeignCheckpointError:
        return ForeignCheckpointError(f"{where} is not a readable safetensors file: {reason}", file=str(file))

    try:
        with open(file, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size < 8:
                raise bad(f"{size} bytes, too short for a header")
            (n,) = struct.unpack("<Q", fh.read(8))
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise bad(f"header length {n} runs past the file's {size} bytes or the {MAX_HEADER_BYTES}-byte limit")
            header = json.loads(fh.read(n))
    except FileNotFoundError:
        raise ForeignCheckpointError(f"{where} is missing", file=str(file)) from None
    except (ValueError, RecursionError) as exc:  # JSON (UnicodeDecodeError is a ValueError)
        raise bad(f"header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    meta = header.get("__metadata__")
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise bad("'__metadata__' must map strings to strings")
    spans = []
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        fields: dict[str, Any] = entry if isinstance(entry, dict) else {}
        dtype: Any = fields.get("dtype")
        shape: Any = fields.get("shape")
        offsets: Any = fields.get("data_offsets")
        if not (
            isinstance(dtype, str)
            and _naturals(shape)
            and _naturals(offsets)
            and len(offsets) == 2
            and offsets[0] <= offsets[1]
        ):
            raise bad(f"tensor {key!r} needs a dtype, a shape and data_offsets [begin, end], got {str(entry)[:200]}")
        begin, end = offsets
        if dtype in DTYPE_NAMES and end - begin != math.prod(shape) * itemsize(dtype):
            raise bad(
                f"tensor {key!r}: data_offsets span {end - begin} bytes, its {dtype} shape {shape} needs "
                f"{math.prod(shape) * itemsize(dtype)}"
            )
        spans.append((begin, end, key))
    pos = 0
    for begin, end, key in sorted(spans):
        if begin != pos:
            raise bad(f"tensor {key!r} starts at data byte {begin}, not {pos} (tensors lie back to back)")
        pos = end
    if 8 + n + pos != size:
        raise bad(f"the tensors end at byte {8 + n + pos}, the file at {size}")
    return sorted(k for k in header if k != "__metadata__"), 8 + n, header


def _naturals(value: Any) -> bool:
    """Whether ``value`` is a JSON list of non-negative integers."""
    return isinstance(value, list) and all(type(v) is int and v >= 0 for v in value)


def _stored(file: Path) -> dict[str, StoredTensor]:
    """All tensors of one file as byte ranges of it; NeedsTorch for what a byte copy should not take
    (a dtype this version does not name, an empty tensor)."""
    keys, data_start, header = _laid_out_header(file)
    out: dict[str, StoredTensor] = {}
    for key in keys:
        entry = header[key]
        shape = tuple(int(s) for s in entry["shape"])
        if entry["dtype"] not in DTYPE_NAMES:
            raise NeedsTorch(f"tensor {key!r} has dtype {entry['dtype']!r}")
        if 0 in shape:
            raise NeedsTorch(f"tensor {key!r} is empty")
        out[key] = StoredTensor(str(file), data_start + int(entry["data_offsets"][0]), entry["dtype"], shape)
    return out


def _mapped(file: Path) -> dict[str, torch.Tensor]:
    """All tensors of one file as views of a private read-only-in-practice mapping of it."""
    import torch

    keys, data_start, header = _checked_header(file)
    size = file.stat().st_size
    storage = torch.UntypedStorage.from_file(str(file), shared=False, nbytes=size)
    raw = torch.empty(0, dtype=torch.uint8).set_(storage)  # type: ignore[arg-type]  # torch types from_file as _StorageBase
    out: dict[str, torch.Tensor] = {}
    for key in keys:
        entry = header[key]
        dtype = torch_dtype(entry["dtype"])
        begin, end = (data_start + int(o) for o in entry["data_offsets"])
        chunk = raw[begin:end]
        if begin % dtype.itemsize:
            chunk = chunk.clone()  # misaligned for a dtype view: copy this one tensor
        out[key] = chunk.view(dtype).view([int(s) for s in entry["shape"]])
    return out


def read_hf(
    path: str | os.PathLike[str],
    *,
    trust_pickle: bool = False,
    progress: Progress | None = None,
    on_disk: bool = False,
) -> Imported:
    """Read safetensors weights into ``{"model": {name: tensor}}`` (``trust_pickle`` is unused: no pickles).

    ``on_disk``: the leaves are :class:`.stored.StoredTensor` byte ranges of the files (no torch), unless
    one cannot be (then torch tensors, as without it). A UCP checkpoint folder is refused: its data files
    are safetensors too, but importing them as weights would drop its state tree, step and sharding.
    """
    if (Path(path) / "manifest.json").is_file():
        raise UnknownFormatError(
            f"{str(path)!r} is a UCP checkpoint already (it holds manifest.json); there is nothing to import",
            file=str(path),
        )
    files = weight_files(path)
    if on_disk:
        try:
            return _read(path, files, _stored, progress)
        except NeedsTorch:
            pass
    return _read(path, files, _mapped, progress)


def _read(path: str | os.PathLike[str], files: list[Path], tensors: Any, progress: Progress | None) -> Imported:
    """The weights of ``files``, each file's tensors given by ``tensors(file)`` (stored or mapped)."""
    model: dict[str, Any] = {}
    for i, file in enumerate(files):
        for key, tensor in tensors(file).items():
            if key in model:
                raise ForeignCheckpointError(
                    f"file {str(file)!r}: tensor {key!r} also appears in an earlier shard", tensor=key, file=str(file)
                )
            model[key] = tensor
        if progress:
            progress(i + 1, len(files), file.name)
    root = Path(path)
    index = root / INDEX if root.is_dir() else root
    if index.name.endswith(".index.json") and index.is_file():
        listed = set(json.loads(index.read_text())["weight_map"])
        if listed != set(model):
            missing, extra = sorted(listed - set(model)), sorted(set(model) - listed)
            raise ForeignCheckpointError(
                f"file {str(index)!r}: weight_map and the shards disagree (listed but "
                f"missing: {missing[:5]}, present but unlisted: {extra[:5]})",
                file=str(index),
            )
    from ucp.conversion.hf_meta import source_files

    # a save_pretrained folder's config.json (and generation config, tokenizer location): what
    # ``ucp export --format hf`` writes back so that from_pretrained loads the export
    meta = source_files(root if root.is_dir() else root.parent)
    return Imported(
        state={"model": model},
        step=None,
        metadata={"source": {"format": "hf", "path": str(root.resolve()), "files": [f.name for f in files]}, **meta},
    )
