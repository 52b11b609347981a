"""Tensors as flat byte arrays: the one representation every I/O path shares.

Going through a ``uint8`` view (never through the dtype itself) is what makes
the bytes bit-exact for every dtype: NaN payloads, negative zeros, bfloat16 and
float8 all survive, and bool, 0-d and empty tensors need no special cases.
"""

from __future__ import annotations

import torch


def describe(tensor: torch.Tensor) -> str:
    """``dtype[shape] on device``, for error messages."""
    return f"{str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)} on {tensor.device}"


def _check(tensor: torch.Tensor, name: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise ValueError(f"{name} ({describe(tensor)}) has layout {tensor.layout}; only dense tensors are supported")
    if tensor.is_quantized:
        # Its storage holds packed integers plus scale/zero-point kept outside the
        # bytes; a uint8 view of it is not a real tensor (copying from it crashes).
        raise ValueError(
            f"{name} ({describe(tensor)}) is quantized; write its integer values (.int_repr()) "
            "and its quantization parameters separately, or .dequantize() it first"
        )
    if tensor.device.type == "meta":
        raise ValueError(f"{name} ({describe(tensor)}) is a meta tensor and has no bytes")
    if not tensor.is_contiguous():
        raise ValueError(
            f"{name} ({describe(tensor)}) is not contiguous (stride {tuple(tensor.stride())}); call .contiguous() first"
        )


def source_bytes(tensor: torch.Tensor, name: str = "tensor") -> torch.Tensor:
    """A flat uint8 view of ``tensor``'s bytes, for writing.

    A lazily conjugated or negated tensor is materialised first (a copy), since
    its memory does not hold the values it shows.
    """
    _check(tensor, name)
    return _flat_bytes(tensor.detach().resolve_conj().resolve_neg())


def dest_bytes(tensor: torch.Tensor, name: str = "tensor") -> torch.Tensor:
    """A flat uint8 view of ``tensor``'s memory, for reading into it in place."""
    _check(tensor, name)
    if tensor.is_conj() or tensor.is_neg():
        raise ValueError(f"{name} ({describe(tensor)}) has a lazy conj/neg bit; resolve it before reading into it")
    return _flat_bytes(tensor.detach())


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    flat = t.reshape(-1)  # a view: the tensor is contiguous
    if flat.numel() <= 1 and flat.stride(0) != 1:
        # Empty and one-element tensors count as contiguous whatever their strides
        # (numpy's empty arrays have stride 0); view(uint8) insists on stride 1.
        flat = flat.as_strided((flat.numel(),), (1,))
    return flat.view(torch.uint8)
