"""Where each weight's bytes lie on disk: a Hugging Face safetensors directory or a UCP checkpoint.

A source answers, per tensor, its dtype, shape and the byte *runs* that make it up: (file, offset,
length, destination offset in the consolidated row-major tensor). A safetensors tensor is one run;
a UCP tensor saved in pieces (sharded ranks, boxes) is the planner's coalesced copies. Nothing is
read but headers and manifests: the executor issues O_DIRECT reads of the runs (or, for weights on
an object store, ranged GETs: :mod:`training.inference.files`).

Every header is checked against the file it heads (offsets inside the file, lengths matching shape
times item size) before any read, so a header that lies fails here, naming the file and tensor.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Any, Mapping

from training.inference.errors import WeightSourceError
from training.inference.files import LOCAL, Files, files_for
from ucp.format.dtypes import DTYPE_NAMES, itemsize

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit


@dataclass(frozen=True)
class Run:
    """``length`` bytes at ``offset`` of ``file`` are bytes ``[dst, dst + length)`` of the tensor."""

    file: str
    offset: int
    length: int
    dst: int


@dataclass(frozen=True)
class TensorSource:
    """One weight: safetensors dtype name, shape and the runs covering its ``nbytes`` exactly once."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    runs: tuple[Run, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)

    @property
    def single(self) -> Run | None:
        """The run when the tensor is one contiguous range of one file."""
        if len(self.runs) == 1 and self.runs[0].dst == 0 and self.runs[0].length == self.nbytes:
            return self.runs[0]
        return None


class WeightSource:
    """A mapping of tensor name to :class:`TensorSource`, plus the directory (or URL prefix) holding config
    files, the :class:`~training.inference.files.Files` its runs are read through and, for a UCP
    checkpoint, its manifest's metadata."""

    def __init__(
        self,
        root: str,
        tensors: Mapping[str, TensorSource],
        kind: str,
        *,
        files: Files = LOCAL,
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        self.root = root
        self.tensors = dict(tensors)
        self.kind = kind
        self.files = files
        self.metadata = metadata

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def __getitem__(self, name: str) -> TensorSource:
        try:
            return self.tensors[name]
        except KeyError:
            raise WeightSourceError(f"{self.root}: no tensor {name!r} in the {self.kind} weights") from None

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def open_weights(path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> WeightSource:
    """The weights at ``path``: a UCP checkpoint (has manifest.json) or a safetensors directory/file; a local
    path or an ``s3://`` URL (``storage_options``: :class:`ucp.store.s3.S3Options`)."""
    text = os.fspath(path)
    try:
        files = files_for(text, storage_options)
    except ValueError as exc:
        raise WeightSourceError(str(exc)) from None
    root = text.rstrip("/") if files.remote else os.path.abspath(text)
    if not files.exists(root):
        raise WeightSourceError(
            f"{root}: no such object or prefix" if files.remote else f"{root}: no such file or directory"
        )
    if files.isfile(os.path.join(root, "manifest.json")):
        return ucp_source(root, storage_options)
    return safetensors_source(root, files)


# -- Hugging Face safetensors -------------------------------------------------------------------


def safetensors_source(path: str, fs: Files = LOCAL) -> WeightSource:
    """A single ``.safetensors`` file, a directory with ``model.safetensors``, or a sharded directory
    whose ``model.safetensors.index.json`` maps tensors to shard files."""
    if fs.isfile(path):
        root, files = os.path.dirname(path), [path]
        expected: dict[str, set[str]] | None = None
    else:
        root = path
        index = os.path.join(root, INDEX_NAME)
        if fs.isfile(index):
            expected = _read_index(index, fs)
            files = [os.path.join(root, f) for f in sorted(expected)]
            for f in files:
                if not fs.isfile(f):
                    raise WeightSourceError(
                        f"{f}: shard named in {index} is missing (it holds {len(expected[os.path.basename(f)])} tensors, "
                        f"e.g. {sorted(expected[os.path.basename(f)])[0]!r})"
                    )
        else:
            expected = None
            single = os.path.join(root, SINGLE_NAME)
            files = (
                [single]
                if fs.isfile(single)
                else sorted(os.path.join(root, f) for f in fs.listdir(root) if f.endswith(".safetensors"))
            )
            if not files:
                raise WeightSourceError(f"{root}: no {SINGLE_NAME}, {INDEX_NAME} or other .safetensors file")
    tensors: dict[str, TensorSource] = {}
    for f in files:
        for t in read_safetensors_header(f, fs):
            if t.name in tensors:
                raise WeightSourceError(f"{f}: tensor {t.name!r} also stored in {tensors[t.name].runs[0].file}")
            tensors[t.name] = t
        if expected is not None:
            have = {t for t, src in tensors.items() if src.runs[0].file == f}
            want = expected[os.path.basename(f)]
            if want - have:
                raise WeightSourceError(
                    f"{f}: the index maps {sorted(want - have)[:3]} to this shard, whose header lacks them"
                )
    return WeightSource(root, tensors, "safetensors", files=fs)


def _read_index(index: str, fs: Files = LOCAL) -> dict[str, set[str]]:
    """Shard file -> the tensor names the index maps to it."""
    try:
        doc = json.loads(fs.read(index, 0, MAX_HEADER_BYTES) if not fs.remote else fs.read(index))
        weight_map = doc["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise WeightSourceError(f"{index}: not a valid safetensors index ({exc})") from None
    out: dict[str, set[str]] = {}
    for tensor, shard in weight_map.items():
        if not isinstance(shard, str) or os.path.basename(shard) != shard:
            raise WeightSourceError(f"{index}: tensor {tensor!r} maps to {shard!r}, not a file name in the directory")
        out.setdefault(shard, set()).add(tensor)
    return out


def read_safetensors_header(file: str, fs: Files = LOCAL) -> list[TensorSource]:
    """The tensors of one safetensors file, every entry checked against the file's size."""
    try:
        size = fs.size(file)
        with contextlib.nullcontext() if fs.remote else open(file, "rb") as fh:  # a local file: opened once
            head = fs.read(file, 0, 8) if fh is None else fh.read(8)
            if len(head) < 8:
                raise WeightSourceError(f"{file}: {size} bytes, too short for a safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise WeightSourceError(f"{file}: header length {n} runs past the end of the file ({size} bytes)")
            raw = fs.read(file, 8, n) if fh is None else fh.read(n)
    except OSError as exc:
        raise WeightSourceError(f"{file}: cannot read ({exc.strerror})") from None
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise WeightSourceError(f"{file}: safetensors header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise WeightSourceError(f"{file}: safetensors header is not a JSON object")
    data_start = 8 + n
    out = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        out.append(_entry(file, name, entry, data_start, size))
    return out


def _entry(file: str, name: str, entry: Any, data_start: int, size: int) -> TensorSource:
    where = f"{file}: tensor {name!r}"
    if not isinstance(entry, dict):
        raise WeightSourceError(f"{where}: header entry is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_NAMES:
        raise WeightSourceError(f"{where}: unknown dtype {dtype!r}")
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise WeightSourceError(f"{where}: bad shape {shape!r}")
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(isinstance(o, int) for o in offsets)
        and 0 <= offsets[0] <= offsets[1]
    ):
        raise WeightSourceError(f"{where}: bad data_offsets {offsets!r}")
    begin, end = offsets
    want = math.prod(shape) * itemsize(dtype)
    if end - begin != want:
        raise WeightSourceError(
            f"{where}: header gives {end - begin} bytes for shape {shape} of {dtype}, which needs {want}"
        )
    if data_start + end > size:
        raise WeightSourceError(
            f"{where}: header places it at bytes [{data_start + begin}, {data_start + end}), "
            f"past the end of the file ({size} bytes): truncated or lying header"
        )
    return TensorSource(name, dtype, tuple(shape), (Run(file, data_start + begin, want, 0),))


# -- UCP checkpoints ----------------------------------------------------------------------------


def ucp_source(path: str, storage_options: dict[str, Any] | None = None) -> WeightSource:
    """Consolidated tensors of a UCP checkpoint in any layout, through the reshard planner.

    Every data file must exist with the manifest's size and its safetensors header must agree with
    the manifest (the reader's own checks), before any byte of weights is planned.
    """
    from reshard.box import Box
    from reshard.plan import SourcePiece, plan
    from reshard.resolve import LocalBuffer, Slot
    from ucp.errors import CheckpointError
    from ucp.store.reader import check_data_files, pieces_by_file, read_and_check_header, read_manifest
    from ucp.store.storage import open_storage

    storage, name = open_storage(path, storage_options=storage_options)
    try:
        with storage:
            manifest = read_manifest(storage, name)
            check_data_files(storage, name, manifest)
            for file, pieces in pieces_by_file(manifest).items():
                read_and_check_header(storage, name, file, manifest.files[file].size, pieces)
    except CheckpointError as exc:
        raise WeightSourceError(f"{path}: {exc}") from None
    tensors: dict[str, TensorSource] = {}
    for tname, entry in manifest.tensors.items():
        size = itemsize(entry.dtype)
        shape = tuple(entry.shape)
        sources = [SourcePiece(os.path.join(path, p.file), p.offset, p.region(), size) for p in entry.pieces]
        whole = Box((0,) * len(shape), shape)
        try:
            p = plan([LocalBuffer(tname, shape, (Slot(tname, whole, whole),))], {tname: sources}, {tname: shape})
        except ValueError as exc:
            raise WeightSourceError(f"{path}: tensor {tname!r}: {exc}") from None
        if p.fills:
            raise WeightSourceError(f"{path}: tensor {tname!r}: stored pieces leave elements unfilled ({p.fills[0]})")
        runs = tuple(Run(c.file, c.offset, c.nbytes, c.start * size) for c in p.copies)
        tensors[tname] = TensorSource(tname, entry.dtype, shape, runs)
    files = files_for(path, storage_options)
    return WeightSource(path, tensors, "UCP checkpoint", files=files, metadata=manifest.metadata)
