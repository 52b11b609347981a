"""The Triton kernels compile for a GPU (sm_90) without one, and the code says what the docstrings
promise: IEEE sqrt and division and exactly two FMAs per Adam element (no contraction the CPU kernel
lacks), 128-bit accesses where alignment is known. The interpreter tests cannot see any of this."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from kernels import triton_adam, triton_cast

pytestmark = pytest.mark.skipif(not triton_adam.available()[0], reason=f"no Triton here: {triton_adam.available()[1]}")
_PTR = {0: "*fp32", 1: "*u16", 2: "*fp16", 3: "*fp32"}


def _ptx(monkeypatch: pytest.MonkeyPatch, tmp: Path, fn: Any, sig: dict[str, str], consts: dict[str, Any],
         aligned: tuple[int, ...], **options: Any) -> str:  # fmt: skip
    import triton
    from triton.backends.compiler import GPUTarget

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp))
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    src = triton.compiler.ASTSource(fn=triton.jit(fn), signature=sig, constexprs=consts, attrs=attrs)
    return str(triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"])


def _count(ptx: str, op: str) -> int:
    return len(re.findall(r"\b" + re.escape(op) + r"\b", ptx))


@pytest.mark.parametrize(("decay", "small", "out"), [(1, True, 1), (2, True, 2), (1, False, 0), (2, False, 3)])
def test_adam_compiles_to_ieee_arithmetic_without_extra_fusion(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, decay: int, small: bool, out: int
) -> None:
    names = [p for p in triton_adam._adam_kernel.__code__.co_varnames[:20]]
    types = ["*fp32"] * 4 + [_PTR[out], "i64"] + ["fp32"] * 10 + ["constexpr"] * 4
    sig = dict(zip(names, types))
    consts = {"DECAY": decay, "SMALL": small, "OUT": out, "BLOCK": triton_adam.BLOCK}
    ptx = _ptx(monkeypatch, tmp_path, triton_adam._adam_kernel, sig, consts, aligned=(0, 1, 2, 3, 4, 5),
               num_warps=triton_adam.NUM_WARPS, enable_fp_fusion=False)  # fmt: skip
    per_thread = triton_adam.BLOCK // (32 * triton_adam.NUM_WARPS)
    assert _count(ptx, "sqrt.rn.f32") == per_thread and _count(ptx, "div.rn.f32") == 2 * per_thread
    assert "sqrt.approx" not in ptx and "div.full" not in ptx and "div.approx" not in ptx
    assert _count(ptx, "fma.rn.f32") == 2 * per_thread + (per_thread if decay == 2 else 0)
    assert _count(ptx, "ld.global.v4.b32") == 4 * per_thread // 4  # four fp32 streams, 128-bit loads


@pytest.mark.parametrize("full", [True, False])
def test_cast_compiles_for_every_dtype_pair(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, full: bool) -> None:
    for src in range(3):
        for dst in range(3):
            sig = {"tab_ptr": "*i64", "out_ptr": _PTR[dst], "SRC": "constexpr", "DST": "constexpr",
                   "FULL": "constexpr", "BLOCK": "constexpr"}  # fmt: skip
            consts = {"SRC": src, "DST": dst, "FULL": full, "BLOCK": triton_cast.BLOCK}
            ptx = _ptx(monkeypatch, tmp_path, triton_cast._cast_kernel, sig, consts, aligned=(0, 1),
                       num_warps=triton_cast.NUM_WARPS, enable_fp_fusion=False)  # fmt: skip
            vector = _count(ptx, "ld.global.v4.b32") + _count(ptx, "ld.global.v2.b32")
            assert (vector > 0) == full, f"src {src} dst {dst}: 128-bit loads only on whole aligned blocks"
