"""Read a ``torch.save`` zip archive without torch: its pickle through a strict allow-list, its
tensors as :class:`~ucp.conversion.importers.stored.StoredTensor` byte ranges of the archive.

A ``torch.save`` file (torch >= 1.6) is an uncompressed zip: ``<prefix>/data.pkl`` pickles the
object, and each storage is a member ``<prefix>/data/<key>`` whose bytes are the elements as they
are in memory. Reading one here never imports torch and never builds a foreign object:

* the unpickler's ``find_class`` resolves only the names below (a subset of what
  ``torch.load(weights_only=True)`` allows, plus the three inert DeepSpeed stand-ins that
  :mod:`.pickles` also registers); any other name stops the read;
* tensors come out as byte ranges, checked to lie inside their storage's member.

Anything this reader does not know (another global, a legacy non-zip file, a compressed or
big-endian archive, a non-contiguous view) raises :class:`~ucp.conversion.importers.stored.NeedsTorch`,
and the caller falls back to :func:`ucp.conversion.importers.pickles.load_torch` — which applies torch's own
allow-list and gives the usual errors (UnsafePickleError naming the classes, unless
``trust_pickle``). So this path only ever accepts less than the torch path does.
"""

from __future__ import annotations

import collections
import io
import math
import os
import pickle
import struct
import zipfile
from typing import Any

from ucp.conversion.importers.errors import ForeignCheckpointError
from ucp.conversion.importers.stored import NeedsTorch, StoredTensor
from ucp.format.dtypes import itemsize


class AttributeBag:
    """Stand-in for a pickled object that only carries attributes (DeepSpeed's LossScaler, fragment_address)."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"AttributeBag({self.__dict__!r})"


class StageNumber(int):
    """Stand-in for DeepSpeed's ZeroStageEnum, pickled as ``ZeroStageEnum(<int>)``."""


# The global names DeepSpeed pickles for its three harmless classes.
DEEPSPEED_NAMES: dict[str, type] = {
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": AttributeBag,
    "deepspeed.utils.tensor_fragment.fragment_address": AttributeBag,
    "deepspeed.runtime.zero.config.ZeroStageEnum": StageNumber,
}

# torch's typed storage classes (how a storage's dtype is pickled) -> ucp dtype names.
STORAGE_DTYPES: dict[str, str] = {
    "FloatStorage": "F32",
    "DoubleStorage": "F64",
    "HalfStorage": "F16",
    "BFloat16Storage": "BF16",
    "LongStorage": "I64",
    "IntStorage": "I32",
    "ShortStorage": "I16",
    "CharStorage": "I8",
    "ByteStorage": "U8",
    "BoolStorage": "BOOL",
}

# How far a zip's members may inflate: ``INFLATE_RATIO`` times the archive's size plus ``INFLATE_SLACK``,
# per member and for the compressed members together. torch.save writes every member stored (not
# compressed), so a real archive's members never exceed its size; the slack leaves room for small
# hand-made archives. Without the bound, a 2 MB archive whose data.pkl is 2 GiB of deflated zeros
# made the readers (zipfile here, torch.load's miniz) allocate the 2 GiB, several times over.
INFLATE_RATIO = 4
INFLATE_SLACK = 16 << 20

_LOCAL_HEADER = struct.Struct("<4s5H3L2H")  # a zip member's local file header (30 bytes)
_LOCAL_MAGIC = b"PK\x03\x04"


class _Sealed:
    """Objects this reader hands to the pickle: a BUILD on one (setting its attributes) is refused,
    so a crafted pickle cannot repoint a storage or change what a storage name means."""

    def __setstate__(self, state: Any) -> None:
        raise NeedsTorch(f"a pickle that sets the attributes of a {type(self).__name__}")


class _StorageType(_Sealed):
    """What ``torch.FloatStorage`` & co. unpickle to here: just the dtype."""

    def __init__(self, dtype: str) -> None:
        self.dtype = dtype


class _Storage(_Sealed):
    """One storage of the archive: ``nbytes`` bytes at ``offset`` of the file."""

    def __init__(self, file: str, offset: int, nbytes: int, dtype: str) -> None:
        self.file, self.offset, self.nbytes, self.dtype = file, offset, nbytes, dtype


def _ints(values: Any) -> tuple[int, ...]:
    """A size or stride as ints; NeedsTorch for anything else (a float would be silently truncated)."""
    if not isinstance(values, tuple) or not all(type(v) is int for v in values):
        raise NeedsTorch("a tensor with a malformed size or stride")
    return values


def _rebuild_tensor_v2(
    storage: Any,
    storage_offset: Any,
    size: Any,
    stride: Any,
    requires_grad: Any = False,
    backward_hooks: Any = None,
    metadata: Any = None,
) -> StoredTensor:
    """torch._utils._rebuild_tensor_v2, for contiguous tensors: the tensor's byte range in its storage."""
    if not isinstance(storage, _Storage):
        raise NeedsTorch("a tensor whose storage is not an archive member")
    if metadata:  # a negated or conjugated view: its bytes are not its values
        raise NeedsTorch(f"a tensor with view metadata {str(metadata)[:80]}")
    shape, strides, first = _ints(size), _ints(stride), storage_offset
    if type(first) is not int or len(shape) != len(strides) or first < 0 or any(s < 0 for s in shape):
        raise NeedsTorch("a tensor with a malformed size, stride or offset")
    expected, step = [], 1
    for s in reversed(shape):
        expected.append(step)
        step *= s
    if math.prod(shape) and any(n > 1 and a != b for n, a, b in zip(shape, strides, reversed(expected))):
        raise NeedsTorch("a non-contiguous tensor view")
    size_of = itemsize(storage.dtype)
    if (first + math.prod(shape)) * size_of > storage.nbytes:
        raise NeedsTorch("a tensor that reaches past the end of its storage")
    return StoredTensor(storage.file, storage.offset + first * size_of, storage.dtype, shape)


def _rebuild_parameter(data: Any, requires_grad: Any = False, backward_hooks: Any = None) -> Any:
    return data


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    """torch._tensor._rebuild_from_type_v2 for a plain torch.Tensor: its Python attributes (DeepSpeed's
    ``ds_id``) are dropped, as nothing an importer reads lives there."""
    if new_type is not _TENSOR or func is not _rebuild_tensor_v2 or not isinstance(args, tuple):
        raise NeedsTorch("a tensor subclass")
    return func(*args)


_TENSOR = object()  # what torch.Tensor unpickles to here: only a marker for _rebuild_from_type_v2

_ALLOWED: dict[str, Any] = {
    "torch._utils._rebuild_tensor_v2": _rebuild_tensor_v2,
    "torch._utils._rebuild_parameter": _rebuild_parameter,
    "torch._tensor._rebuild_from_type_v2": _rebuild_from_type_v2,
    "torch.Tensor": _TENSOR,
    "torch.Size": tuple,
    "collections.OrderedDict": collections.OrderedDict,
    **{f"torch.{name}": _StorageType(dtype) for name, dtype in STORAGE_DTYPES.items()},
    **DEEPSPEED_NAMES,
}


class _ArchiveUnpickler(pickle.Unpickler):
    def __init__(self, data: Any, archive: "_Archive") -> None:
        super().__init__(data)
        self.archive = archive

    def find_class(self, module: str, name: str) -> Any:
        key = f"{module}.{name}"
        if key not in _ALLOWED:
            raise NeedsTorch(f"the pickle names {key}")
        return _ALLOWED[key]

    def persistent_load(self, pid: Any) -> Any:
        if not (
            isinstance(pid, tuple)
            and len(pid) == 5
            and pid[0] == "storage"
            and isinstance(pid[1], _StorageType)
            and isinstance(pid[2], str)
        ):
            raise NeedsTorch(f"a persistent id {str(pid)[:80]}")
        return self.archive.storage(pid[2], pid[1].dtype, pid[4])


def inflate_limit(archive_size: int) -> int:
    """The most bytes one member, or all compressed members together, may inflate to (see INFLATE_RATIO)."""
    return INFLATE_RATIO * archive_size + INFLATE_SLACK


def check_member_sizes(source: str | io.BytesIO, *, where: str, file: str) -> None:
    """Refuse a zip archive whose members would inflate beyond :func:`inflate_limit` of its size.

    Judged from the central directory before any member is read: a stored member must declare the
    size it stores, a compressed one at most the limit (and all compressed ones together too). The
    readers then never allocate more than that, whatever a member claims: zipfile stops at the
    declared size (and a bomb's CRC then fails), and torch.load sizes its buffers from it.
    ForeignCheckpointError names ``where`` and the member. A source that is not a zip (a legacy
    torch file) is left to its reader.
    """
    if isinstance(source, io.BytesIO):
        size = len(source.getbuffer())
    else:
        size = os.path.getsize(source)
    try:
        with zipfile.ZipFile(source) as zf:
            infos = zf.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        return
    finally:
        if isinstance(source, io.BytesIO):
            source.seek(0)
    limit = inflate_limit(size)
    inflated = 0
    for info in infos:
        if info.compress_type == zipfile.ZIP_STORED:
            if info.file_size != info.compress_size:
                raise ForeignCheckpointError(
                    f"{where}: zip member {info.filename!r} is stored uncompressed but declares "
                    f"{info.file_size} bytes for the {info.compress_size} it holds",
                    file=file,
                )
            continue
        inflated += info.file_size
        if info.file_size > limit or inflated > limit:
            raise ForeignCheckpointError(
                f"{where}: zip member {info.filename!r} inflates to {info.file_size} bytes "
                f"({inflated} for the compressed members so far), more than the {limit} allowed "
                f"for a {size}-byte archive (a zip bomb?); torch.save never compresses its members",
                file=file,
            )


class _Archive:
    """The zip's members, and where each storage's bytes start in the file."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.storages: dict[str, _Storage] = {}
        check_member_sizes(path, where=f"file {path!r}", file=path)
        with zipfile.ZipFile(path) as zf:
            infos = zf.infolist()
        self.members = {i.filename: i for i in infos}
        if len(self.members) != len(infos):
            raise NeedsTorch("two zip members with one name")
        pickles = [n for n in self.members if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pickles) != 1:
            raise NeedsTorch("no single <prefix>/data.pkl member")
        self.prefix = pickles[0][: -len("data.pkl")]
        self.size = os.path.getsize(path)
        order = self.members.get(self.prefix + "byteorder")
        if order is not None and self.read(order) != b"little":
            raise NeedsTorch("a big-endian archive")

    def read(self, info: zipfile.ZipInfo) -> bytes:
        """A member's bytes, read no further than :func:`inflate_limit` whatever the member claims."""
        limit = inflate_limit(self.size)
        with zipfile.ZipFile(self.path) as zf, zf.open(info) as fh:
            data = fh.read(limit + 1)
        if len(data) > limit:
            raise ForeignCheckpointError(
                f"file {self.path!r}: zip member {info.filename!r} inflates past {limit} bytes (a zip bomb?)",
                file=self.path,
            )
        return data

    def data_offset(self, info: zipfile.ZipInfo) -> int:
        """Where a stored member's bytes start: after its local header, name and extra field."""
        with open(self.path, "rb") as fh:
            head = os.pread(fh.fileno(), _LOCAL_HEADER.size, info.header_offset)
        if len(head) != _LOCAL_HEADER.size:
            raise NeedsTorch(f"member {info.filename!r}: truncated local header")
        fields = _LOCAL_HEADER.unpack(head)
        if fields[0] != _LOCAL_MAGIC:
            raise NeedsTorch(f"member {info.filename!r}: bad local header")
        return info.header_offset + _LOCAL_HEADER.size + fields[-2] + fields[-1]

    def storage(self, key: str, dtype: str, numel: Any) -> _Storage:
        """Storage ``key``; each key is one storage (a second reference in another dtype is refused)."""
        if key in self.storages:
            known = self.storages[key]
            if known.dtype != dtype:
                raise NeedsTorch(f"storage {key!r} referenced as {known.dtype} and {dtype}")
            return known
        info = self.members.get(f"{self.prefix}data/{key}")
        if info is None or info.compress_type != zipfile.ZIP_STORED:
            raise NeedsTorch(f"storage {key!r} is missing or compressed")
        if type(numel) is not int or numel * itemsize(dtype) != info.file_size:
            raise NeedsTorch(f"storage {key!r}: its member does not hold {numel} {dtype} elements")
        offset = self.data_offset(info)
        if offset + info.file_size > self.size:
            raise NeedsTorch(f"storage {key!r} reaches past the end of the file")
        self.storages[key] = _Storage(self.path, offset, info.file_size, dtype)
        return self.storages[key]


def read_archive(path: str | os.PathLike[str]) -> Any:
    """The object a ``torch.save`` zip archive holds, its tensors as byte ranges of ``path``.

    Raises NeedsTorch for anything outside the strict subset described in the module docstring.
    """
    try:
        archive = _Archive(os.fspath(path))
        data = archive.read(archive.members[archive.prefix + "data.pkl"])
        return _ArchiveUnpickler(io.BytesIO(data), archive).load()
    except (NeedsTorch, ForeignCheckpointError):
        raise
    except Exception as exc:  # noqa: BLE001 - a damaged zip or pickle: let torch's reader give its error
        raise NeedsTorch(f"not read here ({type(exc).__name__}: {exc})") from None
