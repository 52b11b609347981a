"""The one place foreign pickles are opened: allow-listed by default, a full unpickle only when trusted.

Foreign checkpoints (DeepSpeed's ``.pt`` files, DCP's ``.metadata``) are pickles, and a plain
unpickle runs whatever code the file names. Here:

* ``torch.save`` files load with ``torch.load(weights_only=True, mmap=True)``: only tensors,
  containers and torch's own rebuild functions, plus inert stand-ins registered under the names of
  DeepSpeed's three harmless classes (a loss scaler and a fragment address, both plain attribute
  bags, and the ZeRO stage enum, an int). DeepSpeed itself is never imported.
* plain pickles (DCP's ``.metadata``) go through :func:`load_pickle_allowlisted`, a pickle
  unpickler whose ``find_class`` resolves only the names it is given.

Anything else raises :class:`UnsafePickleError` naming the file and the classes it wants;
``trust_pickle=True`` then allows a full unpickle (logged as a warning).
"""

from __future__ import annotations

import io
import logging
import os
import pickle
from typing import Any, Mapping

import torch

from .errors import ForeignCheckpointError, UnsafePickleError

log = logging.getLogger(__name__)


class AttributeBag:
    """Stand-in for a pickled object that only carries attributes (DeepSpeed's LossScaler, fragment_address)."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"AttributeBag({self.__dict__!r})"


class StageNumber(int):
    """Stand-in for DeepSpeed's ZeroStageEnum, pickled as ``ZeroStageEnum(<int>)``."""


# (stand-in, the global name the pickle uses): torch >= 2.5 resolves the name to the stand-in.
DEEPSPEED_STAND_INS: list[tuple[type, str]] = [
    (AttributeBag, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (AttributeBag, "deepspeed.utils.tensor_fragment.fragment_address"),
    (StageNumber, "deepspeed.runtime.zero.config.ZeroStageEnum"),
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
    try:
        with torch.serialization.safe_globals(DEEPSPEED_STAND_INS):
            try:
                return torch.load(name, weights_only=True, map_location="cpu", mmap=mmap)
            except RuntimeError as exc:
                if not (mmap and "mmap can only be used" in str(exc)):
                    raise
                return torch.load(name, weights_only=True, map_location="cpu")  # legacy (non-zip) file
    except pickle.UnpicklingError as exc:
        if not trust_pickle:
            raise UnsafePickleError(name, _unsafe_globals(name)) from exc
    except (RuntimeError, EOFError, ValueError) as exc:
        raise ForeignCheckpointError(f"file {name!r} is not a readable torch.save archive: {exc}", file=name) from exc
    _full_unpickle_warning(name)
    try:
        return torch.load(name, weights_only=False, map_location="cpu", mmap=mmap)
    except (ImportError, AttributeError) as exc:
        raise ForeignCheckpointError(f"file {name!r}: full unpickle failed: {exc}", file=name) from exc


def load_torch_bytes(data: bytes | memoryview, *, where: str, trust_pickle: bool = False) -> Any:
    """``torch.load`` of a ``torch.save`` archive held in memory (a DCP item); ``where`` names it in errors."""
    buf = io.BytesIO(data)
    try:
        return torch.load(buf, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        if not trust_pickle:
            raise UnsafePickleError(where, _unsafe_globals(io.BytesIO(data))) from exc
    except (RuntimeError, EOFError, ValueError) as exc:
        raise ForeignCheckpointError(f"{where} is not a readable torch.save archive: {exc}", file=where) from exc
    _full_unpickle_warning(where)
    buf.seek(0)
    return torch.load(buf, weights_only=False, map_location="cpu")


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


def load_pickle_allowlisted(path: str | os.PathLike[str], allowed: Mapping[str, Any], *,
                            trust_pickle: bool = False) -> Any:
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
