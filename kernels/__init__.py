"""kernels: fused kernels at memory bandwidth (a leaf package: imports neither ucp nor training).

* :func:`adam` — Adam/AdamW over flat fp32 buffers in one pass, with optional bf16/fp16 copy-back.
* :func:`copy_crc32c` — copy bytes and CRC-32C them in one pass:
  ``copy_crc32c(dst, src, value=0) -> int`` (as ``crc32c.crc32c(src, value)``).
* :func:`cast_flatten` — cast tensors and lay them back to back in one flat staging buffer in one
  pass: ``cast_flatten(tensors, out, dtype=None, *, crc=False) -> list[int] | None`` (the bytes of
  ``torch.cat([t.to(dtype).flatten() for t in tensors])`` at the start of ``out``; each tensor's
  CRC-32C of the written bytes with ``crc=True``).
* :func:`backend` — which CPU implementation runs (the C++ extension, JIT-built once into a cache,
  or the pure-torch fallback) and why.

What runs where: CPU tensors take the C++ extension (or the torch fallback). CUDA tensors take the
Triton kernels: :func:`adam` runs :mod:`kernels.triton_adam` (bit-equal to the C++ kernel's
IEEE-sqrt mode; without Triton an error, unless ``UCP_KERNELS=torch`` asks for torch ops; with
``torch_sqrt=True``, torch.optim's bits, it runs torch's own CUDA ops) and
:func:`cast_flatten` runs :mod:`kernels.triton_cast` (no ``crc`` on the GPU); on other devices
:func:`adam` takes torch ops and :func:`cast_flatten` refuses. Triton is imported on first CUDA use only. The Triton kernels are tested on CPU tensors
through Triton's interpreter (``TRITON_INTERPRET=1``) and checked on a GPU by
``tools/gpu_check_kernels.py``; :func:`copy_crc32c` is CPU-only.
"""

from __future__ import annotations

from ._build import extension
from .cast import cast_flatten
from .crc import copy_crc32c
from .fused_adam import adam, adam_reference


def backend() -> str:
    """``"cpp: <why>"`` or ``"torch: <why>"``: the implementation :func:`adam` and friends use."""
    ext, why = extension()
    return f"{'cpp' if ext is not None else 'torch'}: {why}"


__all__ = ["adam", "adam_reference", "backend", "cast_flatten", "copy_crc32c"]
