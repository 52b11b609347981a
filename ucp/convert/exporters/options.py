"""Parsing of the exporters' user-facing options: byte sizes ("2GB", "512MiB", "1e9") and dtype names.

Kept apart from the exporters so that the CLI and ``ucp.convert.exporters.export`` accept the same spellings.
"""

from __future__ import annotations

import re

import torch

from ucp.errors import ExportError  # defined with the rest of the hierarchy; re-exported for the exporters

__all__ = ["ExportError", "parse_dtype", "parse_size"]


# Decimal units as Hugging Face uses them ("5GB" = 5e9 bytes); binary units spelled with "i".
_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_size(value: int | float | str, *, option: str = "size") -> int:
    """Bytes from an int or a string like ``"2GB"`` (10^9), ``"512MiB"`` (2^20) or ``"1e9"``."""
    if isinstance(value, bool):
        raise ExportError(f"{option}: expected a size in bytes, got {value!r}")
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    else:
        m = _SIZE.match(value)
        if m is None or m.group(2).lower() not in _UNITS:
            raise ExportError(f"{option}: cannot read {value!r} as a size (examples: 2GB, 512MiB, 1e9)")
        number, unit = float(m.group(1)), m.group(2).lower()
    size = int(number * _UNITS[unit])
    if size <= 0:
        raise ExportError(f"{option}: the size must be positive, got {value!r}")
    return size


_DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "f16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "f32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "fp64": torch.float64,
    "f64": torch.float64,
    "float64": torch.float64,
    "double": torch.float64,
    "fp8_e4m3": torch.float8_e4m3fn,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "f8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "float8_e5m2": torch.float8_e5m2,
    "f8_e5m2": torch.float8_e5m2,
}


def parse_dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    """The floating dtype to cast floating tensors to (``"bf16"``, ``"fp16"``, ``torch.float32`` ...)."""
    if value is None or isinstance(value, torch.dtype):
        if isinstance(value, torch.dtype) and not value.is_floating_point:
            raise ExportError(f"dtype: {value} is not a floating dtype; only floating tensors are cast")
        return value
    key = value.strip().lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ExportError(f"dtype: unknown dtype {value!r} (choose from {', '.join(sorted(_DTYPES))})")
    return _DTYPES[key]
