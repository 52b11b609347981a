"""torch dtypes <-> the dtype strings of safetensors (which the manifest uses too)."""

from __future__ import annotations

import torch

from .errors import UnsupportedStateError

# Names exactly as safetensors writes them; only dtypes that safetensors.safe_open reads back.
_BY_NAME: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "C64": torch.complex64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
}
if hasattr(torch, "float8_e8m0fnu"):
    _BY_NAME["F8_E8M0"] = torch.float8_e8m0fnu

_BY_DTYPE: dict[torch.dtype, str] = {v: k for k, v in _BY_NAME.items()}

DTYPE_NAMES: frozenset[str] = frozenset(_BY_NAME)


def dtype_name(dtype: torch.dtype, *, tensor: str = "?") -> str:
    """The safetensors name of ``dtype``; UnsupportedStateError when the format cannot hold it."""
    try:
        return _BY_DTYPE[dtype]
    except KeyError:
        raise UnsupportedStateError(
            f"tensor {tensor!r} has dtype {dtype}, which safetensors (and so this format) cannot store"
        ) from None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a safetensors dtype string (callers validate ``name`` first)."""
    return _BY_NAME[name]


def itemsize(name: str) -> int:
    return _BY_NAME[name].itemsize
