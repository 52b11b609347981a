"""``ucp reshape SRC DST --dp N --zero S`` with no layout file, on checkpoints converted from Hugging
Face, PyTorch DCP and DeepSpeed: a checkpoint that recorded no layout is taken as plain DP/ZeRO
(reshard.plain_layout), the DeepSpeed importer records DeepSpeed's own (dp size, stage, param groups,
alignment), and every reshape round-trips bit-exactly back to the consolidated checkpoint."""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from peer_checkpoints import deepspeed_checkpoint
from safetensors.torch import save_file
from typer.testing import CliRunner
from ucp_helpers import assert_same_state, random_tensor

import ucp
from reshard import FlatRange, Layout, plain_layout
from ucp.cli.main import app
from ucp.conversion.importers import convert
from ucp.conversion.placement import place, recorded_layout


def _reshape(*args: str) -> None:
    res = CliRunner().invoke(app, ["reshape", *args])
    assert res.exit_code == 0, res.output


def _round_trips(converted: Path, tmp_path: Path, *, optimizer_state: bool) -> None:
    """Reshape to dp=4 under ZeRO 1, 2 and 3 (no layout file), consolidate, compare every tensor and value.

    Under ZeRO-1/2 the weights are replicated (rank 0 writes them) and the optimizer state partitioned,
    so a weights-only checkpoint is written by rank 0 alone; under ZeRO-3 every rank holds a partition."""
    want = ucp.load(converted)
    for stage in (1, 2, 3):
        wide, back = tmp_path / f"dp4-z{stage}", tmp_path / f"back-z{stage}"
        _reshape(str(converted), str(wide), "--dp", "4", "--zero", str(stage), "--tp", "1", "--pp", "1")
        m = ucp.read_manifest(wide)
        assert m.topology.world_size == 4 and m.metadata["zero_stage"] == stage
        assert Layout.model_validate(m.metadata["layout"]).mesh.dp == 4
        files = {p.file for e in m.tensors.values() for p in e.pieces}
        assert len(files) == (4 if optimizer_state or stage == 3 else 1), files
        if stage == 3:  # the weights themselves are partitioned: a big one spans the four rank files
            big = max(m.tensors, key=lambda n: m.tensors[n].nbytes)
            assert len({p.file for p in m.tensors[big].pieces}) == 4, big
        _reshape(str(wide), str(back))
        assert_same_state(want, ucp.load(back))


def _hf(tmp_path: Path) -> Path:
    weights = {
        "embed.weight": random_tensor(torch.float32, (301, 17), seed=1),
        "layers.0.mlp.weight": random_tensor(torch.bfloat16, (129, 33), seed=2),
        "layers.0.mlp.bias": random_tensor(torch.float16, (129,), seed=3),
        "layers.1.norm.weight": random_tensor(torch.float32, (7,), seed=4),
        "position_ids": torch.arange(40, dtype=torch.int64).reshape(1, 40),
    }
    save_file(weights, str(tmp_path / "model.safetensors"))
    convert(tmp_path / "model.safetensors", tmp_path / "hf-ucp")
    return tmp_path / "hf-ucp"


def test_hugging_face_import_reshapes_without_a_layout(tmp_path: Path) -> None:
    converted = _hf(tmp_path)
    assert recorded_layout(ucp.read_manifest(converted)).layout is None  # nothing recorded: the plain layout
    _round_trips(converted, tmp_path, optimizer_state=False)


def _dcp_state() -> dict[str, Any]:
    return {
        "model": {
            "embed.weight": random_tensor(torch.float32, (257, 9), seed=5),
            "layers.0.proj.weight": random_tensor(torch.bfloat16, (65, 31), seed=6),
            "ids": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        },
        "optimizer": {"state": {"lr": 0.5}, "count": torch.tensor(3, dtype=torch.int32)},
        "step": 12,
    }


def test_dcp_import_reshapes_without_a_layout(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group": a single-process save is intended here
        dcp.save(_dcp_state(), checkpoint_id=str(tmp_path / "dcp"))
    convert(tmp_path / "dcp", tmp_path / "dcp-ucp")
    _round_trips(tmp_path / "dcp-ucp", tmp_path, optimizer_state=False)


DS_CONFIGS = [(1, "bf16", 2, 2), (2, "fp32", 2, 2), (3, "fp32", 2, 1)]  # stage, dtype, world, alignment


@pytest.mark.parametrize("stage,dtype,world,alignment", DS_CONFIGS, ids=lambda v: str(v))
def test_deepspeed_import_records_its_layout_and_reshapes(
    tmp_path: Path, stage: int, dtype: str, world: int, alignment: int
) -> None:
    convert(deepspeed_checkpoint(stage, dtype, world), tmp_path / "ds-ucp")
    rec = recorded_layout(ucp.read_manifest(tmp_path / "ds-ucp"))
    assert rec.layout is not None and rec.shapes is not None
    assert (rec.layout.mesh.dp, rec.layout.zero.stage, rec.layout.zero.alignment) == (world, stage, alignment)
    assert rec.layout.zero.groups[0][0] == "embed.weight" and len(rec.layout.zero.groups) == 1
    assert list(rec.shapes)[0] == "embed.weight"
    _round_trips(tmp_path / "ds-ucp", tmp_path, optimizer_state=True)


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_layout_gives_back_deepspeeds_partitions(tmp_path: Path, stage: int) -> None:
    """The recorded layout places each rank's fp32 master exactly where DeepSpeed's own partition held it:
    ZeRO-2 cuts the group's flat buffer, ZeRO-3 each parameter (the last rank's part padded)."""
    ds = deepspeed_checkpoint(stage, "fp32", 2)
    convert(ds, tmp_path / "ds-ucp")
    m = ucp.read_manifest(tmp_path / "ds-ucp")
    rec = recorded_layout(m)
    assert rec.layout is not None and rec.shapes is not None
    masters = ucp.load(tmp_path / "ds-ucp")["optimizer"]["fp32_master"]
    placed = place(m, rec.layout, rec.shapes, rec.sections)
    tag = (ds / "latest").read_text().strip()
    for r, mine in enumerate(placed.ranks):
        osd = torch.load(ds / tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt", weights_only=False)
        osd = osd["optimizer_state_dict"]
        held: dict[str, list[torch.Tensor]] = {}
        for p in mine:
            if p.tensor.startswith("optimizer.fp32_master."):
                param = p.tensor.removeprefix("optimizer.fp32_master.")
                assert isinstance(p.region, FlatRange), p  # partitions of these shapes are flat ranges
                held.setdefault(param, []).append(masters[param].reshape(-1)[p.region.start : p.region.stop])
        if stage == 2:
            want = osd["single_partition_of_fp32_groups"][0]
            got = torch.cat([t for param in rec.shapes for t in held.get(param, [])])
            assert torch.equal(got, want), f"rank {r}"
            continue
        flat, pos = osd["fp32_flat_groups"][0], 0
        for param, shape in rec.shapes.items():
            n = math.prod(shape)
            part = -(-n // 2)
            valid = max(0, min(part, n - r * part))
            assert torch.equal(torch.cat(held[param]), flat[pos : pos + valid]), f"rank {r} {param}"
            pos += part
        assert pos == flat.numel(), f"rank {r}"


def test_tensor_or_pipeline_split_still_needs_a_layout(tmp_path: Path) -> None:
    converted = _hf(tmp_path)
    res = CliRunner().invoke(app, ["reshape", str(converted), str(tmp_path / "x"), "--tp", "2", "--dp", "2"])
    assert res.exit_code == 2
    assert "records no layout" in res.output and "--tp 2" in res.output and "--layout" in res.output
    assert not (tmp_path / "x").exists()


def test_plain_layout_replicates_every_tensor_and_groups_all_parameters() -> None:
    layout = plain_layout(4, 3)
    assert layout.mesh.world_size == 4 and layout.zero.stage == 3 and layout.zero.groups == (("*",),)
    view = layout.resolve({"a": (10, 3), "b.c": (7,)}, 2)
    assert [s.glob for buf in view.weights() for s in buf.slots] == [FlatRange(16, 24), FlatRange(4, 6)]
