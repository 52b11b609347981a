"""``ucp reshape --dp N --zero S`` with no layout file, checked against the *sources'* own bytes.

tests/ucp/conversion/test_reshape_plain_layout.py compares each reshape with the converted checkpoint it
started from. These go back to what the foreign tool wrote: the safetensors file itself, the global
tensors a 2-rank DCP save sharded, and DeepSpeed's own per-rank partitions and ``zero_to_fp32`` output
(a 4-rank ZeRO-2 run). Each goes to dp 4 and back to dp 1 through the layout path (``--dp 1 --zero 0``,
not the consolidating copy), bit-exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from dcp_save_worker import dcp_mixed_state
from peer_checkpoints import deepspeed_checkpoint
from repo_paths import SUPPORT
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner
from ucp_helpers import random_tensor, same_bytes
from world import run_world

import ucp
from reshard import Layout
from ucp.cli.main import app
from ucp.conversion.importers import convert
from ucp.conversion.placement import recorded_layout
from ucp.format.manifest import Manifest
from ucp.format.regions import as_flat_range


def _reshape(*args: str) -> None:
    res = CliRunner().invoke(app, ["reshape", *args])
    assert res.exit_code == 0, res.output


def _there_and_back(converted: Path, tmp_path: Path, stage: int) -> tuple[Path, Path]:
    """(the dp 4 reshape at ZeRO ``stage``, its reshape back to dp 1 ZeRO-0), both without a layout file."""
    wide, back = tmp_path / f"dp4-z{stage}", tmp_path / f"dp1-from-z{stage}"
    _reshape(str(converted), str(wide), "--dp", "4", "--zero", str(stage))
    m = ucp.read_manifest(wide)
    assert m.topology.world_size == 4 and m.metadata["zero_stage"] == stage
    _reshape(str(wide), str(back), "--dp", "1", "--zero", "0")
    m = ucp.read_manifest(back)
    assert m.topology.world_size == 1 and m.metadata["zero_stage"] == 0
    assert Layout.model_validate(m.metadata["layout"]).mesh.dp == 1
    return wide, back


# -- Hugging Face: a sharded safetensors directory, HF naming ---------------------------------------------


def test_hugging_face_directory_round_trips_to_its_own_files(tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    hf.mkdir()
    shards = [
        {
            "model.embed_tokens.weight": random_tensor(torch.bfloat16, (503, 24), seed=1),
            "model.layers.0.self_attn.q_proj.weight": random_tensor(torch.bfloat16, (24, 24), seed=2),
            "model.layers.0.input_layernorm.weight": random_tensor(torch.float32, (24,), seed=3),
        },
        {
            "model.layers.0.mlp.up_proj.weight": random_tensor(torch.float16, (67, 24), seed=4),
            "model.norm.weight": random_tensor(torch.float32, (24,), seed=5),
            "lm_head.weight": random_tensor(torch.bfloat16, (503, 24), seed=6),
        },
    ]
    names = [f"model-0000{i + 1}-of-00002.safetensors" for i in range(2)]
    weight_map = {}
    for name, shard in zip(names, shards):
        save_file(shard, str(hf / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    (hf / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    convert(hf, tmp_path / "hf-ucp")
    want = {k: v for name in names for k, v in load_file(str(hf / name)).items()}
    for stage in (2, 3):
        _, back = _there_and_back(tmp_path / "hf-ucp", tmp_path, stage)
        got = ucp.load(back)
        flat = _flatten(got["model"])  # the importer puts the weights under the "model" section
        assert set(flat) == set(want), sorted(set(flat) ^ set(want))
        for k, v in want.items():
            assert same_bytes(flat[k], v), k


def _flatten(state: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    """Nested dicts of tensors as ``{"a.b.c": tensor}`` (how an HF checkpoint names them)."""
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# -- PyTorch DCP: a 2-rank sharded save (rows, bf16 columns, an empty chunk, optimizer state) -------------


@pytest.mark.timeout(240)
def test_sharded_dcp_round_trips_to_the_global_tensors_it_sharded(tmp_path: Path) -> None:
    out = tmp_path / "dcp"
    run_world(SUPPORT / "dcp_save_worker.py", lambda r: ["mixed", r, 2, tmp_path / "init", out], 2, timeout=100)
    convert(out, tmp_path / "dcp-ucp")
    assert recorded_layout(ucp.read_manifest(tmp_path / "dcp-ucp")).layout is None  # plain DP/ZeRO taken
    want = dcp_mixed_state()
    for stage in (1, 3):
        _, back = _there_and_back(tmp_path / "dcp-ucp", tmp_path, stage)
        got = ucp.load(back)
        for k, v in want.items():
            assert same_bytes(got["model"][k], v), k
        assert same_bytes(got["optim"]["state"]["rows"]["exp_avg"], want["rows"] * 2)
        assert same_bytes(got["optim"]["state"]["rows"]["step"], torch.tensor(4.0))
        assert got["step"] == 4


# -- DeepSpeed: 4 ranks, ZeRO-2, fp32 ---------------------------------------------------------------------


def _rank_partition(m: Manifest, root: Path, rank: int, prefix: str, order: list[str]) -> torch.Tensor:
    """The elements of tensors ``prefix + name`` that rank file ``rank`` holds, concatenated in ZeRO's
    flattening order (``order``, then position in the tensor): the rank's flat partition."""
    file = f"rank-{rank:05d}.safetensors"
    parts: list[tuple[int, int, bytes]] = []
    with open(root / file, "rb") as f:
        for i, name in enumerate(order):
            entry = m.tensors[prefix + name]
            for p in entry.pieces:
                if p.file != file:
                    continue
                flat = as_flat_range(p.region(), tuple(entry.shape))
                assert flat is not None, (name, p)
                f.seek(p.offset)
                parts.append((i, flat.start, f.read(p.length)))
    data = b"".join(b for _, _, b in sorted(parts))
    return torch.from_numpy(np.frombuffer(data, dtype=np.float32).copy())


@pytest.mark.timeout(600)
def test_deepspeed_four_rank_zero2_reshapes_into_its_own_partitions_and_back(tmp_path: Path) -> None:
    """A 4-rank ZeRO-2 run pads its flat group to a multiple of 2 x 4 elements, the last rank's partition
    one element short here (DeepSpeed saves it without the padding): the recorded layout expresses it, so ``--dp 4`` (the stage stays 2) writes each
    rank's fp32 master and Adam moments exactly as DeepSpeed's rank held them, and ``--dp 1`` gives back
    zero_to_fp32's weights."""
    from tools.peers.deepspeed_ckpt import read_latest, reference_fp32

    ds = deepspeed_checkpoint(2, "fp32", 4)
    convert(ds, tmp_path / "ds-ucp")
    rec = recorded_layout(ucp.read_manifest(tmp_path / "ds-ucp"))
    assert rec.layout is not None and rec.shapes is not None
    assert (rec.layout.mesh.dp, rec.layout.zero.stage) == (4, 2)
    wide, back = tmp_path / "dp4", tmp_path / "dp1"
    _reshape(str(tmp_path / "ds-ucp"), str(wide), "--dp", "4")  # no --zero: the recorded stage
    m = ucp.read_manifest(wide)
    assert m.metadata["zero_stage"] == 2
    order = list(rec.shapes)
    tag = read_latest(ds)
    for r in range(4):
        osd = torch.load(ds / tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt", weights_only=False)
        osd = osd["optimizer_state_dict"]
        master = osd["single_partition_of_fp32_groups"][0]  # saved without the group's padding
        assert osd["group_paddings"][0] == (1 if r == 3 else 0)  # the case this test is about
        held = _rank_partition(m, wide, r, "optimizer.fp32_master.", order)
        assert torch.equal(held, master), f"rank {r}: fp32 master partition"
        moments = osd["base_optimizer_state"]["state"][0]  # these keep the padding: zeros at the end
        for key in ("exp_avg", "exp_avg_sq"):
            got, theirs = _rank_partition(m, wide, r, f"optimizer.{key}.", order), moments[key]
            assert theirs.numel() == master.numel() + osd["group_paddings"][0], f"rank {r}: {key}"
            assert torch.equal(got, theirs[: master.numel()]), f"rank {r}: {key}"
            assert not theirs[master.numel() :].any(), f"rank {r}: {key} padding"
    _reshape(str(wide), str(back), "--dp", "1", "--zero", "0")
    state = ucp.load(back)
    want = reference_fp32(ds)
    assert set(state["optimizer"]["fp32_master"]) == set(want)
    for name, tensor in want.items():
        assert same_bytes(state["optimizer"]["fp32_master"][name], tensor), name
        assert same_bytes(state["model"][name], tensor), name  # fp32 training: the weights are the masters
