"""manifest.json: the pydantic models of docs/format.md, and the reader's checks.

``Manifest.to_json`` is the only way a writer turns a :class:`Manifest` into bytes:
the canonical serialization, sealed (format version 2) by a CRC-32C of those bytes
in the member ``manifest_crc32c``. ``parse_manifest`` is the only way a reader turns
bytes into a :class:`Manifest`: it checks the size, the format version, then the
schema (pydantic, strict, unknown fields refused), then everything the schema cannot
say (counts, file names, bounds, exact coverage, the state tree), and last the seal.
Whatever the input, it returns a valid manifest or raises a :class:`~ucp.errors.ManifestError`.
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from datetime import datetime, timezone
from typing import Any

import crc32c as _crc32c
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from reshard.box import Box, FlatRange, check_exact_cover
from ucp.errors import ManifestError, UnsupportedFormatError, where
from ucp.format.dtypes import DTYPE_NAMES, itemsize
from ucp.format.tree import ENTRY_SEP, check_tree, is_reserved

FORMAT_VERSION = 2  # what writers write; 2 added the manifest's own checksum
READABLE_VERSIONS = (1, 2)  # what readers accept: version 1 is version 2 without the checksum
MANIFEST_NAME = "manifest.json"
CHECKSUM_FIELD = "manifest_crc32c"  # the last member of a version-2 manifest (docs/format.md)
MAX_NDIM = 64
MAX_BYTES = 1 << 62  # per tensor and per file: anything larger is a corrupt manifest
# What a manifest may declare: far above any real checkpoint (a 256 MiB manifest holds ~2M pieces),
# low enough that reading one is bounded in memory and time (linear in its size) whatever it claims.
MAX_MANIFEST_BYTES = 256 << 20
MAX_FILES = 1 << 20
MAX_TENSORS = 1 << 20
MAX_PIECES = 1 << 22  # all tensors together
_STRICT = ConfigDict(extra="forbid", strict=True)


class BoxModel(BaseModel):
    model_config = _STRICT
    offsets: list[int]
    shape: list[int]


class FlatModel(BaseModel):
    model_config = _STRICT
    start: int
    stop: int


class Piece(BaseModel):
    """One contiguous run of bytes of a data file holding part of a tensor."""

    model_config = _STRICT
    file: str
    offset: int = Field(description="absolute byte offset in the file")
    length: int = Field(description="bytes")
    box: BoxModel | None = Field(None, exclude_if=lambda v: v is None)
    flat: FlatModel | None = Field(None, exclude_if=lambda v: v is None)
    crc32c: int
    entry: str | None = Field(
        None, exclude_if=lambda v: v is None, description="safetensors header entry name; None: the tensor name"
    )

    @model_validator(mode="after")
    def _one_place(self) -> "Piece":
        if (self.box is None) == (self.flat is None):
            raise ValueError("a piece needs exactly one of 'box' and 'flat'")
        return self

    def region(self) -> Box | FlatRange:
        if self.box is not None:
            return Box(tuple(self.box.offsets), tuple(self.box.shape))
        assert self.flat is not None
        return FlatRange(self.flat.start, self.flat.stop)

    def local_shape(self) -> list[int]:
        """The piece's shape in its data file's safetensors header."""
        if self.box is not None:
            return list(self.box.shape)
        assert self.flat is not None
        return [self.flat.stop - self.flat.start]

    @classmethod
    def from_region(
        cls, region: Box | FlatRange, *, file: str, offset: int, length: int, crc32c: int, entry: str | None = None
    ) -> "Piece":
        """A piece from a writer's own (already typed) values; skips pydantic validation for speed."""
        if isinstance(region, Box):
            box = BoxModel.model_construct(
                offsets=[int(v) for v in region.offsets], shape=[int(v) for v in region.shape]
            )
            return cls.model_construct(
                file=file, offset=int(offset), length=int(length), box=box, flat=None, crc32c=int(crc32c), entry=entry
            )
        flat = FlatModel.model_construct(start=int(region.start), stop=int(region.stop))
        return cls.model_construct(
            file=file, offset=int(offset), length=int(length), box=None, flat=flat, crc32c=int(crc32c), entry=entry
        )


class TensorEntry(BaseModel):
    model_config = _STRICT
    dtype: str
    shape: list[int]
    pieces: list[Piece]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)


class FileInfo(BaseModel):
    model_config = _STRICT
    rank: int
    size: int


class Topology(BaseModel):
    model_config = _STRICT
    world_size: int
    mesh: dict[str, int] | None = None


class Manifest(BaseModel):
    """The whole manifest.json. Build with ``parse_manifest`` (reading) or the commit step (writing)."""

    model_config = _STRICT
    format_version: int
    creator: str
    created: datetime
    step: int | None = None
    topology: Topology
    files: dict[str, FileInfo]
    tensors: dict[str, TensorEntry]
    state: Any
    metadata: dict[str, Any] = Field(default_factory=dict)
    manifest_crc32c: int | None = Field(
        None,
        exclude=True,
        repr=False,
        description="accepted in the JSON (version 2) and dropped: parse_manifest checks the seal, to_json computes it",
    )

    @model_validator(mode="after")
    def _forget_seal(self) -> "Manifest":
        """A manifest in memory is its content, not the bytes it was read from: equal content, equal manifests."""
        if self.manifest_crc32c is not None:
            self.manifest_crc32c = None
            self.model_fields_set.discard(CHECKSUM_FIELD)
        return self

    def to_json(self) -> bytes:
        """The bytes of manifest.json, the one serialization every writer uses: the canonical bytes
        (:meth:`canonical_bytes`) and, from format version 2 on, their CRC-32C as the last member
        ``manifest_crc32c`` (so the file minus that member is exactly what the checksum covers)."""
        body = self.canonical_bytes()
        if self.format_version < 2:
            return body
        assert body.endswith(b"\n}\n")
        return body[:-3] + f',\n "{CHECKSUM_FIELD}": {_crc32c.crc32c(body)}\n}}\n'.encode()

    def canonical_bytes(self) -> bytes:
        """The manifest's canonical form, which its checksum covers: UTF-8 JSON, members in schema
        order, one line per file, tensor and piece (readable, diffable), compact inside a line.

        A function of the content alone: parsing the bytes and serializing again gives them back,
        whatever the whitespace or string escapes of the file read, so a reader recomputes it.
        Raises ValueError for content JSON cannot hold (NaN, unpaired surrogates)."""

        def dump(v: Any) -> str:
            return json.dumps(v, ensure_ascii=False, allow_nan=False)

        def block(entries: list[str]) -> str:
            return "{}" if not entries else "{\n" + ",\n".join("  " + e for e in entries) + "\n }"

        def tensor(t: TensorEntry) -> str:
            head = f'{{"dtype": {dump(t.dtype)}, "shape": {dump(t.shape)}, "pieces": ['
            if not t.pieces:
                return head + "]}"
            return head + "\n" + ",\n".join("   " + p.model_dump_json() for p in t.pieces) + "]}"

        fields = {
            "format_version": dump(self.format_version),
            "creator": dump(self.creator),
            "created": dump(self.model_dump(mode="json", include={"created"})["created"]),
            "step": dump(self.step),
            "topology": self.topology.model_dump_json(),
            "files": block([f"{dump(k)}: {v.model_dump_json()}" for k, v in self.files.items()]),
            "tensors": block([f"{dump(k)}: {tensor(v)}" for k, v in self.tensors.items()]),
            "state": dump(self.state),
            "metadata": dump(self.metadata),
        }
        return ("{\n" + ",\n".join(f" {dump(k)}: {v}" for k, v in fields.items()) + "\n}\n").encode()

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def now_utc() -> datetime:
    return datetime.now(timezone.utc).replace(microsecond=0)


# -- reading and checking ------------------------------------------------------------------------


def parse_manifest(data: bytes | str, *, source: str = MANIFEST_NAME) -> Manifest:
    """Parse and fully check manifest bytes; raises ManifestError (UnsupportedFormatError) on any problem.

    Version 2 manifests must carry ``manifest_crc32c``, the CRC-32C of their canonical bytes;
    version 1 manifests (written before it existed) must not. The checksum is checked last:
    it guards against corruption, not forgery, so every other check runs on any input first
    and says precisely what is wrong; a mismatch then catches a change that is still valid.
    """
    size = len(data.encode() if isinstance(data, str) else data)
    if size > MAX_MANIFEST_BYTES:
        raise ManifestError(too_large(source, size))
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError, TypeError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ManifestError(f"{source}: not valid JSON ({type(exc).__name__}: {str(exc)[:200]})") from None
    if not isinstance(raw, dict):
        raise ManifestError(f"{source}: must hold a JSON object, got {type(raw).__name__}")
    version, seal = raw.get("format_version"), raw.get(CHECKSUM_FIELD)
    has_seal = CHECKSUM_FIELD in raw
    del raw
    if isinstance(version, bool) or not isinstance(version, int):
        raise ManifestError(f"{source}: 'format_version' must be an integer, got {version!r}"[:300])
    if version not in READABLE_VERSIONS:
        raise UnsupportedFormatError(
            f"{source}: format_version {version} is not supported by this reader (it reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))})"
        )
    try:
        manifest = Manifest.model_validate_json(data)
    except ValidationError as exc:
        raise ManifestError(f"{source}: does not match the schema: {_short(exc)}") from None
    if has_seal != (version >= 2) or (has_seal and seal is None):  # the schema let any int or null through
        missing = f"has '{CHECKSUM_FIELD}', which version 1 lacks" if version < 2 else f"lacks '{CHECKSUM_FIELD}'"
        raise ManifestError(f"{source}: format_version {version} {missing}")
    check_manifest(manifest, source=source)
    if seal is not None:
        why = _seal_error(manifest, seal, source)
        if why is not None:
            raise ManifestError(why)
    return manifest


def seal(data: bytes | str | dict[str, Any]) -> bytes:
    """Manifest JSON (or its parsed dict) as a version-2 writer writes it: canonical, with a fresh
    ``manifest_crc32c``. For a manifest changed on purpose (metadata fixed by hand, a test building
    a hostile checkpoint, whose seal a forger would compute too): only the schema is checked, so
    content the other checks refuse can be sealed and then refused by them on reading."""
    text = json.dumps(data) if isinstance(data, dict) else data
    try:
        manifest = Manifest.model_validate_json(text)
    except ValidationError as exc:
        raise ManifestError(f"cannot seal a manifest that does not match the schema: {_short(exc)}") from None
    return manifest.model_copy(update={"format_version": FORMAT_VERSION, CHECKSUM_FIELD: None}).to_json()


def too_large(source: str, size: int) -> str:
    """The message for a manifest over :data:`MAX_MANIFEST_BYTES` (readers check before reading it)."""
    return (
        f"{source}: {size} bytes, over the {MAX_MANIFEST_BYTES} byte limit for a manifest "
        "(far larger than any manifest UCP writes)"
    )


def _seal_error(manifest: Manifest, seal: int, source: str) -> str | None:
    """Why ``seal`` is not the CRC-32C of ``manifest``'s canonical bytes, or None."""
    try:
        actual = _crc32c.crc32c(manifest.canonical_bytes())
    except (ValueError, TypeError, RecursionError) as exc:
        return f"{source}: content cannot be serialized again to check {CHECKSUM_FIELD} ({type(exc).__name__})"
    if actual != seal:
        return (
            f"{source}: checksum mismatch: {CHECKSUM_FIELD} says {seal}, the content's CRC-32C is {actual} "
            "(the file is corrupt, or was edited by hand)"
        )
    return None


def _short(exc: ValidationError) -> str:
    errs = exc.errors(include_url=False)
    first = errs[0]
    loc = ".".join(str(p) for p in first.get("loc", ()))
    more = f" (and {len(errs) - 1} more)" if len(errs) > 1 else ""
    return f"{loc}: {first.get('msg', '')}"[:300] + more


_PLAIN_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")


def check_file_name(name: str) -> str | None:
    """Why ``name`` is not an acceptable data file name, or None."""
    if not name or len(name) > 255:
        return "empty or longer than 255 characters"
    if name in (".", "..") or ".." in name or "/" in name or "\\" in name or "\0" in name:
        return "must be a plain file name (no '/', '\\', '..')"
    if name == MANIFEST_NAME or not _PLAIN_NAME.match(name):
        return "must be a plain file name of letters, digits, '_', '-', '.' not starting with '.'"
    return None


def check_manifest(m: Manifest, *, source: str = MANIFEST_NAME) -> None:
    """Everything the schema cannot express; raises ManifestError naming the tensor/file at fault."""

    def fail(msg: str) -> ManifestError:
        return ManifestError(f"{source}: {msg}")

    pieces = sum(len(t.pieces) for t in m.tensors.values())
    for what, n, limit in (("files", len(m.files), MAX_FILES), ("tensors", len(m.tensors), MAX_TENSORS)):
        if n > limit:
            raise fail(f"lists {n} {what}, over the limit of {limit}")
    if pieces > MAX_PIECES:
        raise fail(f"lists {pieces} pieces, over the limit of {MAX_PIECES}")
    topo = m.topology
    if not (1 <= topo.world_size <= 1 << 24):
        raise fail(f"topology.world_size {topo.world_size} is out of range")
    if topo.mesh is not None:
        if any(v < 1 for v in topo.mesh.values()) or math.prod(topo.mesh.values()) != topo.world_size:
            raise fail(f"topology.mesh {topo.mesh} does not multiply out to world_size {topo.world_size}")
    if m.step is not None and not (-(1 << 63) <= m.step < 1 << 63):
        raise fail(f"step {m.step} is out of range")

    for fname, info in m.files.items():
        why = check_file_name(fname)
        if why is not None:
            raise fail(f"file name {fname!r} {why}")
        if not (0 <= info.rank < topo.world_size):
            raise fail(f"file {fname!r}: rank {info.rank} outside world_size {topo.world_size}")
        if not (0 <= info.size <= MAX_BYTES):
            raise fail(f"file {fname!r}: size {info.size} is out of range")

    by_file: dict[str, list[tuple[int, int, str, str]]] = defaultdict(list)
    for name, t in m.tensors.items():
        _check_tensor(name, t, m, by_file, fail)

    for fname, spans in by_file.items():
        spans.sort()
        seen: set[str] = set()
        for (start, end, name, entry), nxt in zip(spans, spans[1:] + [None]):
            if entry in seen:
                raise fail(f"{where(name, fname)}: two pieces of the tensor in one file use header entry {entry!r}")
            seen.add(entry)
            if nxt is not None and nxt[0] < end:
                raise fail(f"{where(nxt[2], fname, nxt[0])}: overlaps the bytes of tensor {name!r} [{start}, {end})")

    try:
        refs = check_tree(m.state)
    except ManifestError as exc:  # it names the node ("state['k']: ..."); say which manifest too
        raise fail(str(exc)) from None
    counts: dict[str, int] = defaultdict(int)
    for r in refs:
        counts[r] += 1
        if r not in m.tensors:
            raise fail(f"state refers to tensor {r!r}, which 'tensors' does not list")
        if counts[r] > 1:
            raise fail(f"state refers to tensor {r!r} more than once")
    for name in m.tensors:
        if name not in counts:
            raise fail(f"tensor {name!r} is not referenced by 'state'")


def _is_entry_of(entry: str, name: str) -> bool:
    """``entry`` is ``<name>#<k>`` with k a positive integer written without leading zeros."""
    head, sep, k = entry.rpartition(ENTRY_SEP)
    return head == name and sep == ENTRY_SEP and k.isascii() and k.isdigit() and k[0] != "0"


def _check_tensor(name: str, t: TensorEntry, m: Manifest, by_file: dict, fail: Any) -> None:
    if not name or is_reserved(name):
        raise fail(f"tensor name {name!r} is reserved or empty")
    if t.dtype not in DTYPE_NAMES:
        raise fail(f"{where(name)}: unknown dtype {t.dtype!r}"[:300])
    size = itemsize(t.dtype)
    if len(t.shape) > MAX_NDIM or any(not (0 <= d <= MAX_BYTES) for d in t.shape):
        raise fail(f"{where(name)}: shape {t.shape} is invalid (negative, too large, or over {MAX_NDIM} dims)"[:300])
    numel = math.prod(t.shape)
    if numel * size > MAX_BYTES:
        raise fail(f"{where(name)}: shape {t.shape} is absurdly large")
    regions = []
    for i, p in enumerate(t.pieces):
        here = where(name, p.file, p.offset)
        if p.file not in m.files:
            raise fail(f"{here}: piece {i} names a file that 'files' does not list")
        if not (0 <= p.offset <= MAX_BYTES and 0 <= p.length <= MAX_BYTES):
            raise fail(f"{here}: piece {i} has offset {p.offset} / length {p.length} out of range")
        if not (0 <= p.crc32c < 1 << 32):
            raise fail(f"{here}: piece {i} crc32c {p.crc32c} is not a 32-bit unsigned integer")
        if p.box is not None:
            b = p.box
            if len(b.offsets) != len(t.shape) or len(b.shape) != len(t.shape):
                raise fail(f"{here}: piece {i} box has rank {len(b.offsets)}/{len(b.shape)}, tensor has {len(t.shape)}")
            if any(not (0 <= v <= MAX_BYTES) for v in b.offsets + b.shape):
                raise fail(f"{here}: piece {i} box {b.offsets}+{b.shape} is out of range"[:300])
        else:
            assert p.flat is not None
            if not (0 <= p.flat.start <= p.flat.stop <= numel):
                raise fail(f"{here}: piece {i} flat range [{p.flat.start}, {p.flat.stop}) lies outside [0, {numel})")
        region = p.region()
        if not (isinstance(region, FlatRange) or region.within(t.shape)):
            raise fail(f"{here}: piece {i} box {p.box.offsets}+{p.box.shape} lies outside shape {t.shape}")  # type: ignore[union-attr]
        if p.length != region.numel * size:
            raise fail(f"{here}: piece {i} length {p.length} != {region.numel} elements x {size} bytes ({t.dtype})")
        if p.offset + p.length > m.files[p.file].size:
            raise fail(f"{here}: piece {i} ends at {p.offset + p.length}, past the file's size {m.files[p.file].size}")
        if p.entry is not None and not _is_entry_of(p.entry, name):
            raise fail(f"{here}: piece {i} entry {p.entry!r} is not '{name}{ENTRY_SEP}<k>' (k = 1, 2, ...)"[:300])
        by_file[p.file].append((p.offset, p.offset + p.length, name, p.entry if p.entry is not None else name))
        regions.append(region)
    if len(regions) == 1 and regions[0].numel == numel:  # one piece inside the tensor holding every element
        return
    why = check_exact_cover(regions, t.shape, [f"piece {i} (in {p.file!r})" for i, p in enumerate(t.pieces)])
    if why is not None:
        raise fail(f"{where(name)}: pieces do not cover the tensor exactly once: {why}")
