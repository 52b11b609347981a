"""Parsing of the exporters' user-facing options: byte sizes ("2GB", "512MiB", "1e9"; see aio.sizes) and dtype names.

Kept apart from the exporters so that the CLI and ``ucp.conversion.exporters.export`` accept the same spellings.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aio.sizes import parse_size
from ucp.errors import ExportError  # defined with the rest of the hierarchy; re-exported for the exporters

if TYPE_CHECKING:  # torch is imported when a cast is asked for: an export without one needs none
    import torch

__all__ = ["ExportError", "parse_dtype", "size_option"]


def size_option(value: int | float | str, *, option: str) -> int:
    """Bytes from a size option (``aio.sizes.parse_size``: ``"2GB"`` is 2*10^9, ``"512MiB"`` 512*2^20);
    a bad value raises the ExportError that ``export`` promises, naming the option and the value."""
    try:
        return parse_size(value, what=option)
    except ValueError as exc:
        raise ExportError(str(exc)) from None


# spelling -> the torch dtype's attribute name
_DTYPES: dict[str, str] = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "f16": "float16",
    "float16": "float16",
    "half": "float16",
    "fp32": "float32",
    "f32": "float32",
    "float32": "float32",
    "float": "float32",
    "fp64": "float64",
    "f64": "float64",
    "float64": "float64",
    "double": "float64",
    "fp8_e4m3": "float8_e4m3fn",
    "float8_e4m3fn": "float8_e4m3fn",
    "f8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
    "float8_e5m2": "float8_e5m2",
    "f8_e5m2": "float8_e5m2",
}


def parse_dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    """The floating dtype to cast floating tensors to (``"bf16"``, ``"fp16"``, ``torch.float32`` ...)."""
    if value is None:
        return None
    import torch

    if isinstance(value, torch.dtype):
        if isinstance(value, torch.dtype) and not value.is_floating_point:
            raise ExportError(f"dtype: {value} is not a floating dtype; only floating tensors are cast")
        return value
    key = value.strip().lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ExportError(f"dtype: unknown dtype {value!r} (choose from {', '.join(sorted(_DTYPES))})")
    return getattr(torch, _DTYPES[key])
