"""Executable form of tools/peers/README.md: DeepSpeed 0.19.8's on-disk ZeRO layout.

Each test reassembles full tensors from the native per-rank files by the documented rules,
loading every file with weights_only=True (DeepSpeed's three pickled classes mapped to stand-ins),
and compares bit-exactly with DeepSpeed's own zero_to_fp32 and ds_to_universal outputs. If a
DeepSpeed upgrade changes the layout, these fail before the importer does.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Literal

import pytest
import torch

from tools.peers.deepspeed_ckpt import (  # noqa: E402
    deepspeed_missing,
    make_checkpoint,
    read_latest,
    reference_fp32,
    reference_universal,
)

pytestmark = pytest.mark.skipif(deepspeed_missing() is not None, reason=str(deepspeed_missing()))


class _State:
    """Stand-in for LossScaler and fragment_address: keeps the pickled attribute dict."""

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)


class _Stage(int):
    """Stand-in for ZeroStageEnum (pickled as ZeroStageEnum(<int>))."""


SAFE: list[Callable[..., Any] | tuple[Callable[..., Any], str]] = [  # as safe_globals takes them
    (_State, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (_State, "deepspeed.utils.tensor_fragment.fragment_address"),
    (_Stage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
]


def load(path: Path) -> Any:
    with torch.serialization.safe_globals(SAFE):
        return torch.load(path, weights_only=True, map_location="cpu", mmap=True)


def _universal(udir: Path, name: str, state: str, stage: int) -> torch.Tensor:
    obj = torch.load(udir / "zero" / name / f"{state}.pt", weights_only=True)
    return obj if stage == 3 else obj["param"]


def check_zero12(ckpt: Path, world: int, dtype: str) -> None:
    tag = read_latest(ckpt)
    d, udir, ref = ckpt / tag, reference_universal(ckpt), reference_fp32(ckpt)
    prefix = "bf16_" if dtype == "bf16" else ""
    model = load(d / "mp_rank_00_model_states.pt")
    optim = [
        load(d / f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt")["optimizer_state_dict"] for r in range(world)
    ]
    assert all(int(o["zero_stage"]) in (1, 2) and o["partition_count"] == [world] for o in optim)
    for g, shapes in enumerate(model["param_shapes"]):
        pads = optim[0]["param_alignment_paddings"][g]
        offsets, used = {}, 0
        for (name, shape), pad in zip(shapes.items(), pads, strict=True):
            offsets[name] = used
            used += math.prod(shape) + pad
        part = optim[0]["base_optimizer_state"]["state"][g]["exp_avg"].numel()  # P, padded
        assert world * part == math.ceil(used / (2 * world)) * 2 * world
        for r, o in enumerate(optim):
            tail = max(0, min(part, (r + 1) * part - used))
            assert o["group_paddings"][g] == tail
            assert o["single_partition_of_fp32_groups"][g].numel() == part - tail  # padding stripped
            for key in ("exp_avg", "exp_avg_sq"):
                assert o["base_optimizer_state"]["state"][g][key].numel() == part  # padding kept
            assert float(o["base_optimizer_state"]["state"][g]["step"]) == model["global_steps"]
            # param_slice_mappings: the part of each param inside this rank's partition
            expected = {}
            for name, shape in shapes.items():
                lo = max(offsets[name], r * part)
                hi = min(offsets[name] + math.prod(shape), (r + 1) * part)
                if lo < hi:
                    expected[name] = (hi - lo, lo - r * part)
            got = {n: (f.numel, f.start) for n, f in o["param_slice_mappings"][g].items()}
            assert got == expected
        flat = torch.cat([o["single_partition_of_fp32_groups"][g] for o in optim])
        moments = {
            k: torch.cat([o["base_optimizer_state"]["state"][g][k] for o in optim]) for k in ("exp_avg", "exp_avg_sq")
        }
        assert flat.numel() == used
        for name, shape in shapes.items():
            sl = slice(offsets[name], offsets[name] + math.prod(shape))
            assert torch.equal(flat[sl].view(shape), ref[name]), name
            assert torch.equal(_universal(udir, name, "fp32", 1), ref[name]), name
            for key, m in moments.items():
                assert torch.equal(m[sl].view(shape), _universal(udir, name, key, 1)), (name, key)
            want = ref[name] if dtype == "fp32" else ref[name].to(torch.bfloat16)
            assert torch.equal(model["module"][name], want), name


def check_zero3(ckpt: Path, world: int, dtype: str) -> None:
    tag = read_latest(ckpt)
    d, udir, ref = ckpt / tag, reference_universal(ckpt), reference_fp32(ckpt)
    prefix = "bf16_" if dtype == "bf16" else ""
    models = [load(d / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt") for r in range(world)]
    optim = [
        load(d / f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt")["optimizer_state_dict"] for r in range(world)
    ]
    want_dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    for m in models:  # placeholders only; every rank has the same metadata
        assert all(t.shape == (0,) and t.dtype == want_dtype for t in m["module"].values())
        assert m["param_shapes"] == models[0]["param_shapes"]
    assert all(int(o["zero_stage"]) == 3 and o["partition_count"] == world for o in optim)
    flats = [torch.cat(list(o["fp32_flat_groups"])) for o in optim]
    n_groups = len(optim[0]["fp32_flat_groups"])
    moments = {
        k: [torch.cat([o["optimizer_state_dict"]["state"][g][k] for g in range(n_groups)]) for o in optim]
        for k in ("exp_avg", "exp_avg_sq")
    }
    shapes = {n: s for group in models[0]["param_shapes"] for n, s in group.items()}
    offset = 0
    for name, shape in shapes.items():
        numel = math.prod(shape)
        chunk = math.ceil(numel / world)
        full = torch.cat([f[offset : offset + chunk] for f in flats])[:numel]  # tail pad: garbage
        assert torch.equal(full.view(shape), ref[name]), name
        assert torch.equal(_universal(udir, name, "fp32", 3), full), name  # 1-D in universal
        for key, per_rank in moments.items():
            m = torch.cat([f[offset : offset + chunk] for f in per_rank])[:numel]
            assert torch.equal(m, _universal(udir, name, key, 3)), (name, key)
        offset += chunk
    assert all(f.numel() == offset for f in flats)


def test_zero2_fp32_layout() -> None:
    ckpt = make_checkpoint(world_size=2, zero_stage=2, dtype="fp32", steps=3, model_config="tiny")
    check_zero12(ckpt, 2, "fp32")


@pytest.mark.full_matrix
@pytest.mark.parametrize(
    ("stage", "dtype", "world", "preset", "ds_config"),
    [
        (1, "fp32", 4, "tiny", None),
        (1, "bf16", 2, "tiny", None),
        (2, "bf16", 4, "tiny", {"zero_optimization": {"parameter_alignment": True}}),
        (2, "fp32", 4, "tiny", {"zero_optimization": {"parameter_alignment": True, "round_robin_gradients": True}}),
        (3, "fp32", 2, "tiny", None),
        (3, "bf16", 4, "tiny", None),
        (3, "bf16", 2, "tiny-gqa", None),
    ],
)
def test_layout(stage: int, dtype: Literal["fp32", "bf16"], world: int, preset: str, ds_config: dict | None) -> None:
    ckpt = make_checkpoint(
        world_size=world, zero_stage=stage, dtype=dtype, steps=3, model_config=preset, ds_config=ds_config
    )
    (check_zero3 if stage == 3 else check_zero12)(ckpt, world, dtype)
