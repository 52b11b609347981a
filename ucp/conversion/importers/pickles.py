"""The one place foreign pickles are opened: allow-listed by default, a full unpickle only when trusted.

Foreign checkpoints (DeepSpeed's ``.pt`` files, DCP's ``.metadata``) are pickles, and a plain
unpickle runs whatever code the file names. Here:

* ``torch.save`` files load with ``torch.load(weights_only=True, mmap=True)``: only tensors,
  containers and torch's own rebuild functions, plus inert stand-ins registered under the names of
  DeepSpeed's three harmless classes (a loss scaler and a fragment address, both plain attribute
  bags, and the ZeRO stage enum, an int; see :mod:`.torch_archive`, whose torch-free reader the
  DeepSpeed importer tries first). DeepSpeed itself is never imported.
* plain pickles (DCP's ``.metadata``) go through :func:`load_pickle_allowlisted`, a pickle
  unpickler whose ``find_class`` resolves only the names it is given.

Anything else raises :class:`UnsafePickleError` naming the file and the classes it wants;
``trust_pickle=True`` then allows a full unpickle (logged as a warning). A file that is not a
torch.save archive at all (neither a zip nor a legacy torch file), or a damaged one, raises
:class:`ForeignCheckpointError` and is never unpickled.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
from typing import Any, Callable, Mapping

import torch

from ucp.conversion.importers.errors import ForeignCheckpointError, UnsafePickleError
from ucp.conversion.importers.torch_archive import DEEPSPEED_NAMES, check_member_sizes

log = logging.getLogger(__name__)


# (stand-in, the global name the pickle uses): torch >= 2.5 resolves the name to the stand-in.
# Typed as torch.serialization.safe_globals takes them (a list is invariant).
DEEPSPEED_STAND_INS: list[Callable[..., Any] | tuple[Callable[..., Any], str]] = [
    (cls, name) for name, cls in DEEPSPEED_NAMES.items()
]


def _unsafe_globals(path: str | os.PathLike[str] | io.BytesIO) -> list[str]:
    """Globals a torch.save archive needs beyond the allow-list (stand-ins included), for the error."""
    try:
        with torch.serialization.safe_globals(DEEPSPEED_STAND_INS):
            if isinstance(path, io.BytesIO):
                path.seek(0)
            return sorted(set(torch.serialization.get_unsafe_globals_in_checkpoint(path)))
    except Exception:  # noqa: BLE001 - only for the message; a legacy archive cannot be scanned
        return []


def _full_unpickle_warning(what: str) -> None:
    log.warning("full unpickle of %s (trust_pickle): it may run code from the file", what)


def load_torch(path: str | os.PathLike[str], *, trust_pickle: bool = False, mmap: bool = True) -> Any:
    """``torch.load`` of a foreign ``torch.save`` file, tensors on CPU and memory-mapped (read lazily).

    Raises UnsafePickleError (naming the file and classes) when it needs more than the allow-list and
    ``trust_pickle`` is off; ForeignCheckpointError when the file is not a readable torch archive.
    """
    name = os.fspath(path)
    return _load_archive(name, where=f"file {name!r}", file=name, trust_pickle=trust_pickle, mmap=mmap)


def load_torch_bytes(data: bytes | memoryview, *, where: str, trust_pickle: bool = False) -> Any:
    """``torch.load`` of a ``torch.save`` archive held in memory (a DCP item); ``where`` names it in errors."""
    return _load_archive(io.BytesIO(data), where=where, file=where, trust_pickle=trust_pickle, mmap=False)


# How a torch.save archive starts: a zip (torch >= 1.6), or a legacy file whose first pickle is a magic
# number (opcode LONG1, 10 bytes little-endian) right after the pickle's protocol (and frame) header.
_ZIP_START = b"PK\x03\x04"
_LEGACY_MAGIC = b"\x8a\x0a" + torch.serialization.MAGIC_NUMBER.to_bytes(10, "little")


def _is_torch_archive(source: str | io.BytesIO) -> bool:
    """Whether ``source`` starts like a torch.save archive (it may still be damaged further on)."""
    if isinstance(source, io.BytesIO):
        head = source.getvalue()[:32]
    else:
        with open(source, "rb") as fh:
            head = fh.read(32)
    return head.startswith(_ZIP_START) or _LEGACY_MAGIC in head


def _load_archive(source: str | io.BytesIO, *, where: str, file: str, trust_pickle: bool, mmap: bool) -> Any:
    """Allow-listed load, then (only if ``trust_pickle``) a full unpickle; ``where`` names the source in errors.

    A file that is not a torch archive at all is reported as such, and never unpickled: no
    allow-list could make it load, so "pass --trust-pickle" would be the wrong advice.
    """
    if not _is_torch_archive(source):
        raise ForeignCheckpointError(
            f"{where} is not a readable torch.save archive (neither a zip archive nor a legacy torch file)", file=file
        )
    check_member_sizes(source, where=where, file=file)  # before torch.load sizes buffers from the members' claims
    try:
        with torch.serialization.safe_globals(DEEPSPEED_STAND_INS):
            return _torch_load(source, where=where, file=file, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        if not trust_pickle:
            raise UnsafePickleError(file, _unsafe_globals(source), where=where) from exc
    _full_unpickle_warning(where)
    return _torch_load(source, where=where, file=file, weights_only=False, mmap=mmap)


def _torch_load(source: str | io.BytesIO, *, where: str, file: str, weights_only: bool, mmap: bool) -> Any:
    """``torch.load`` to CPU, reading a legacy (non-zip) archive without mmap, which torch cannot map.

    Failures become ForeignCheckpointError naming ``where``, except that an allow-listed load
    (``weights_only``) lets pickle.UnpicklingError through: a global outside the allow-list.
    """

    def load(use_mmap: bool) -> Any:
        if isinstance(source, io.BytesIO):
            source.seek(0)
        return torch.load(source, weights_only=weights_only, map_location="cpu", mmap=use_mmap)

    try:
        try:
            return load(mmap)
        except RuntimeError as exc:
            if not (mmap and "mmap can only be used" in str(exc)):
                raise
            return load(False)
    except pickle.UnpicklingError as exc:
        if weights_only:
            raise
        raise ForeignCheckpointError(f"{where}: full unpickle failed: {exc}", file=file) from exc
    except (RuntimeError, EOFError, ValueError) as exc:
        raise ForeignCheckpointError(f"{where} is not a readable torch.save archive: {exc}", file=file) from exc
    except Exception as exc:  # noqa: BLE001 - a trusted full unpickle runs the file's code, which may raise anything
        if weights_only:
            raise
        raise ForeignCheckpointError(f"{where}: full unpickle failed: {type(exc).__name__}: {exc}", file=file) from exc


class _Refused:
    """What an allow-listed unpickle builds for a refused global: inert, so the scan can go on and
    report every refused name at once. The result is discarded."""

    def __new__(cls, *args: Any, **kwargs: Any) -> "_Refused":
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass


class _AllowListUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BufferedIOBase, allowed: Mapping[str, Any]) -> None:
        super().__init__(file)
        self.allowed = allowed
        self.refused: list[str] = []

    def find_class(self, module: str, name: str) -> Any:
        key = f"{module}.{name}"
        if key in self.allowed:
            return self.allowed[key]
        if key not in self.refused:
            self.refused.append(key)
        return _Refused


def load_pickle_allowlisted(
    path: str | os.PathLike[str], allowed: Mapping[str, Any], *, trust_pickle: bool = False
) -> Any:
    """Unpickle a plain pickle file resolving only the globals in ``allowed`` (``"module.Name"`` -> object)."""
    name = os.fspath(path)
    with open(name, "rb") as fh:
        unpickler = _AllowListUnpickler(fh, allowed)
        try:
            value = unpickler.load()
        except Exception as exc:  # noqa: BLE001 - any failure of a malformed pickle
            if unpickler.refused and not trust_pickle:
                raise UnsafePickleError(name, unpickler.refused) from exc
            if not unpickler.refused:
                raise ForeignCheckpointError(f"file {name!r} is not a readable pickle: {exc}", file=name) from exc
            value = None
    if not unpickler.refused:
        return value
    if not trust_pickle:
        raise UnsafePickleError(name, unpickler.refused)
    _full_unpickle_warning(name)
    with open(name, "rb") as fh:
        return pickle.load(fh)  # noqa: S301 - the caller asked for it (trust_pickle)
