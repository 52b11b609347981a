"""The dtype strings of safetensors (which the manifest uses too) <-> torch dtypes.

The names and their sizes need no torch: reading a manifest, planning and moving bytes
(``ucp reshape``) work without importing it. The torch side is built on the first call that
asks for it (``torch_dtype``, ``dtype_name``), which imports torch.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from ucp.errors import UnsupportedStateError

if TYPE_CHECKING:
    import torch

# Names exactly as safetensors writes them (only dtypes that safetensors.safe_open reads back),
# with their bytes per element and the torch attribute each stands for.
_TABLE: dict[str, tuple[int, str]] = {
    "BOOL": (1, "bool"),
    "U8": (1, "uint8"),
    "I8": (1, "int8"),
    "I16": (2, "int16"),
    "U16": (2, "uint16"),
    "I32": (4, "int32"),
    "U32": (4, "uint32"),
    "I64": (8, "int64"),
    "U64": (8, "uint64"),
    "F16": (2, "float16"),
    "BF16": (2, "bfloat16"),
    "F32": (4, "float32"),
    "F64": (8, "float64"),
    "C64": (8, "complex64"),
    "F8_E4M3": (1, "float8_e4m3fn"),
    "F8_E5M2": (1, "float8_e5m2"),
    "F8_E4M3FNUZ": (1, "float8_e4m3fnuz"),
    "F8_E5M2FNUZ": (1, "float8_e5m2fnuz"),
    "F8_E8M0": (1, "float8_e8m0fnu"),
}

DTYPE_NAMES: frozenset[str] = frozenset(_TABLE)

_torch: "tuple[dict[str, torch.dtype], dict[torch.dtype, str]] | None" = None  # (by name, by dtype), built once
_torch_lock = threading.Lock()


def _torch_tables() -> "tuple[dict[str, torch.dtype], dict[torch.dtype, str]]":
    """The torch side of the table, built on first use (whole, then published: threads never see half)."""
    global _torch
    if _torch is None:
        with _torch_lock:
            if _torch is None:
                import torch

                by_name = {
                    name: getattr(torch, attr)
                    for name, (_, attr) in _TABLE.items()
                    if getattr(torch, attr, None) is not None
                }  # an older torch may lack new float8 kinds
                _torch = (by_name, {v: k for k, v in by_name.items()})
    return _torch


def dtype_name(dtype: "torch.dtype", *, tensor: str = "?") -> str:
    """The safetensors name of ``dtype``; UnsupportedStateError when the format cannot hold it."""
    try:
        return _torch_tables()[1][dtype]
    except KeyError:
        raise UnsupportedStateError(
            f"tensor {tensor!r} has dtype {dtype}, which safetensors (and so this format) cannot store"
        ) from None


def torch_dtype(name: str) -> "torch.dtype":
    """The torch dtype for a safetensors dtype string (callers validate ``name`` first)."""
    try:
        return _torch_tables()[0][name]
    except KeyError:
        if name in _TABLE:
            raise UnsupportedStateError(f"dtype {name} is not available in this version of torch") from None
        raise UnsupportedStateError(f"unknown dtype {name!r} (not a safetensors dtype)") from None


def itemsize(name: str) -> int:
    """Bytes per element of a safetensors dtype string."""
    return _TABLE[name][0]
