"""kernels: fused CPU kernels at memory bandwidth (a leaf package: imports neither ucp nor training).

* :func:`adam` — Adam/AdamW over flat fp32 buffers in one pass, with optional bf16/fp16 copy-back.
* :func:`copy_crc32c` — copy bytes and CRC-32C them in one pass.
* :func:`backend` — which implementation runs (the C++ extension, JIT-built once into a cache, or
  the pure-torch fallback) and why.
"""

from __future__ import annotations

from ._build import extension
from .crc import copy_crc32c
from .fused_adam import adam, adam_reference


def backend() -> str:
    """``"cpp: <why>"`` or ``"torch: <why>"``: the implementation :func:`adam` and friends use."""
    ext, why = extension()
    return f"{'cpp' if ext is not None else 'torch'}: {why}"


__all__ = ["adam", "adam_reference", "backend", "copy_crc32c"]
