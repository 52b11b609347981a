"""Edge cases of import and export data correctness.

Export: sharded sources (flat ZeRO pieces and boxes over 3 ranks) come out bit-exact, casts equal
``tensor.to``, every dtype / 0-d / empty tensor survives hf and plain ``zarr.open``, shards smaller
than one tensor, odd names, sections by key path. Import: Hugging Face index inconsistencies, DCP
optimizer state, bytes items and a 2-rank sharded save, DeepSpeed universal folders with a missing
fragment; import -> export round trips.

This file is also the 2-rank DCP worker: ``python test_import_export_data.py RANK INIT OUT``.
"""

from __future__ import annotations

import json
import os
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zarr
from dcp_save_worker import dcp_mixed_state
from repo_paths import SUPPORT
from safetensors.torch import load_file, save_file
from ucp_helpers import random_tensor, same_bytes, save_ranks
from world import run_world
from zarr_checks import array, open_group, ucp_attrs, values

import ucp
from ucp.conversion.exporters import ExportError, export
from ucp.conversion.exporters.hf import INDEX
from ucp.conversion.exporters.zarr_export import read_tensor
from ucp.conversion.importers import ForeignCheckpointError, convert, detect, read

ALL_DTYPES = [
    "float32",
    "bfloat16",
    "float16",
    "float64",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "bool",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "complex64",
]


def _every_dtype() -> dict[str, torch.Tensor]:
    """Each dtype as a (7, 3) tensor of random bits, a 0-d one, and empty (0, 4) / (4, 0) ones."""
    out: dict[str, torch.Tensor] = {}
    for i, name in enumerate(ALL_DTYPES):
        d = getattr(torch, name)
        out[name] = random_tensor(d, (7, 3), seed=i)
        out[f"{name}_0d"] = random_tensor(d, (), seed=100 + i)
        out[f"{name}_e0"] = random_tensor(d, (0, 4), seed=i)
        out[f"{name}_e1"] = random_tensor(d, (4, 0), seed=i)
    return out


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype) if t.is_floating_point() else t


def _hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an hf export (one file or shards); checks the index against the shards."""
    if (folder / "model.safetensors").exists():
        return load_file(folder / "model.safetensors")
    index = json.loads((folder / INDEX).read_text())
    got: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        part = load_file(folder / shard)
        assert all(index["weight_map"][k] == shard for k in part), shard
        assert not set(part) & set(got), shard
        got.update(part)
    assert set(got) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in got.values())
    return got


# -- export: sharded sources ---------------------------------------------------------------------


def _three_rank_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """Flat ZeRO pieces at odd element offsets (several per rank, bool / bf16 / float8 among them) and
    2-d boxes, spread over 3 simulated ranks."""
    full = {
        "f32": random_tensor(torch.float32, (13, 7), seed=1),
        "bf": random_tensor(torch.bfloat16, (5, 11), seed=2),
        "b": random_tensor(torch.bool, (9, 5), seed=3),
        "f8": random_tensor(torch.float8_e4m3fn, (3, 17), seed=4),
        "i64": random_tensor(torch.int64, (29,), seed=5),
        "box": random_tensor(torch.float16, (6, 9), seed=6),
    }
    cuts = {
        "f32": [0, 24, 46, 57, 77, 91],
        "bf": [0, 26, 28, 41, 52, 55],
        "b": [0, 4, 11, 13, 37, 45],
        "f8": [0, 4, 9, 12, 41, 51],
        "i64": [0, 14, 21, 25, 27, 29],
    }
    world = 3
    states: list[dict[str, Any]] = [{"model": {}} for _ in range(world)]
    for name, cut in cuts.items():
        flat = full[name].reshape(-1)
        per: list[list[Any]] = [[] for _ in range(world)]
        for j in range(len(cut) - 1):
            per[j % world].append(ucp.FlatShard(flat[cut[j] : cut[j + 1]].clone(), tuple(full[name].shape), cut[j]))
        for r in range(world):
            states[r]["model"][name] = per[r][0] if len(per[r]) == 1 else ucp.Shards(per[r])
    v = full["box"]
    boxes = [((0, 0), (2, 4)), ((0, 4), (2, 5)), ((2, 0), (4, 4)), ((2, 4), (4, 5))]
    per = [[] for _ in range(world)]
    for j, ((r0, c0), (nr, nc)) in enumerate(boxes):
        per[j % world].append(ucp.ShardedTensor(v[r0 : r0 + nr, c0 : c0 + nc].clone(), tuple(v.shape), (r0, c0)))
    for r in range(world):
        states[r]["model"]["box"] = per[r][0] if len(per[r]) == 1 else ucp.Shards(per[r])
    save_ranks(path, states, mesh={"dp": world})
    return full


def test_three_rank_flat_and_box_pieces_export_bit_exact(tmp_path: Path) -> None:
    full = _three_rank_checkpoint(tmp_path / "ck")
    m = ucp.read_manifest(tmp_path / "ck")
    pieces = {k: len(e.pieces) for k, e in m.tensors.items()}
    assert pieces == {f"model.{k}": 5 for k in full if k != "box"} | {"model.box": 4}
    export(tmp_path / "ck", tmp_path / "hf", memory_budget=1)  # one tensor per batch
    got = _hf_tensors(tmp_path / "hf")
    assert all(same_bytes(got[k], v) for k, v in full.items())
    export(tmp_path / "ck", tmp_path / "z", format="zarr", chunk_bytes=7)
    group = zarr.open_group(str(tmp_path / "z"), mode="r")
    assert all(same_bytes(read_tensor(group[k]), v) for k, v in full.items())
    # cast + shards far smaller than any tensor: one tensor per shard, index complete
    report = export(tmp_path / "ck", tmp_path / "bf16", dtype="bf16", max_shard_size=100)
    got = _hf_tensors(tmp_path / "bf16")
    assert len(report.files) == len(full) + 1 and report.files[-1] == INDEX
    assert all(same_bytes(got[k], _cast(v, torch.bfloat16)) for k, v in full.items())
    assert report.bytes == sum(t.numel() * t.element_size() for t in got.values())


# -- export: dtypes, 0-d and empty tensors, casts -------------------------------------------------


@pytest.fixture(scope="module")
def dtype_ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    path = tmp_path_factory.mktemp("dtypes") / "ck"
    model = _every_dtype()
    ucp.save({"model": model, "step": 4}, path, step=4)
    return path, model


def test_hf_every_dtype_and_casts(dtype_ckpt, tmp_path: Path) -> None:
    path, model = dtype_ckpt
    export(path, tmp_path / "hf", max_shard_size=30)  # many shards, several holding only 0-byte tensors
    got = _hf_tensors(tmp_path / "hf")
    assert set(got) == set(model) and all(same_bytes(got[k], v) for k, v in model.items())
    for name, dtype in [("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp8_e4m3", torch.float8_e4m3fn)]:
        export(path, tmp_path / name, dtype=name)
        got = _hf_tensors(tmp_path / name)
        bad = [k for k, v in model.items() if not same_bytes(got[k], _cast(v, dtype))]
        assert not bad, (name, bad)


def test_zarr_every_dtype_through_plain_zarr(dtype_ckpt, tmp_path: Path) -> None:
    path, model = dtype_ckpt
    raw_bits = {"bfloat16": np.uint16} | {d: np.uint8 for d in ALL_DTYPES if d.startswith("float8")}
    for compressor, level in [("zstd", None), ("zstd", 19), ("blosc", 0), ("blosc", 9), ("none", None)]:
        out = tmp_path / f"{compressor}{level}"
        export(path, out, format="zarr", compressor=compressor, level=level, chunk_bytes=10)  # chunks (1, 2): ragged
        group = open_group(out, mode="r")
        assert ucp_attrs(group)["step"] == 4
        for name, t in model.items():
            arr = array(group, name)
            base = str(t.dtype).removeprefix("torch.")
            assert arr.attrs["ucp_dtype"] == base and arr.shape == tuple(t.shape), name
            plain = np.array(values(arr))  # what a reader without ucp gets
            assert plain.dtype == (raw_bits[base] if base in raw_bits else t.numpy().dtype), name
            back = torch.from_numpy(plain).view(t.dtype) if base in raw_bits else torch.from_numpy(plain)
            assert same_bytes(back, t) and same_bytes(read_tensor(arr), t), (compressor, level, name)
        codecs = json.loads((out / "float32" / "zarr.json").read_text())["codecs"]
        if compressor != "none":
            conf = codecs[-1]["configuration"]
            want_level = level if level is not None else {"zstd": 3, "blosc": 5}[compressor]
            assert codecs[-1]["name"] == compressor and conf.get("level", conf.get("clevel")) == want_level
        assert sorted(os.listdir(out / "float32" / "c")) == [str(i) for i in range(7)]  # 7 rows of chunks, all written


def test_zarr_bad_blosc_level_is_refused_up_front(dtype_ckpt, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path, _ = dtype_ckpt
    import ucp.conversion.exporters.stream as stream

    calls: list[int] = []
    original = stream.read_targets

    def counted(*a: Any, **k: Any) -> Any:
        calls.append(1)
        return original(*a, **k)

    monkeypatch.setattr(stream, "read_targets", counted)
    with pytest.raises(ExportError, match="level 10"):
        export(path, tmp_path / "z", format="zarr", compressor="blosc", level=10)
    assert not calls  # "bad values fail before any work"


# -- export: names and sections -------------------------------------------------------------------


def test_odd_names_round_trip_hf_and_zarr(tmp_path: Path) -> None:
    names = ["é", "a b", "enc/dec", "100%", "__x", "layers.0.w", 'x"q', "tab\t", "", "~1", "a.", ".a", "a..b", ".."]
    model = {n: random_tensor(torch.float32, (2,), seed=i) for i, n in enumerate(names)}
    ucp.save({"model": model}, tmp_path / "ck")
    export(tmp_path / "ck", tmp_path / "hf")
    got = load_file(tmp_path / "hf" / "model.safetensors")
    assert set(got) == set(model) and all(same_bytes(got[n], t) for n, t in model.items())
    export(tmp_path / "ck", tmp_path / "z", format="zarr")
    group = zarr.open_group(str(tmp_path / "z"), mode="r")
    mapping = ucp_attrs(group)["tensors"]
    assert set(mapping) == set(model) and len(set(mapping.values())) == len(model)
    assert all(same_bytes(read_tensor(group[mapping[n]]), t) for n, t in model.items())


def test_sections_follow_the_state_tree(tmp_path: Path) -> None:
    w, x, y = (random_tensor(torch.float32, (2,), seed=i) for i in range(3))
    state = {
        "model": {"layers.0": {"w": w}},
        "optimizer": {"state": {0: {"exp_avg": x}}, "param_groups": [{"lr": 1.0}]},
        "bufs": [w, y],
    }
    ucp.save(state, tmp_path / "ck")
    cases = {
        "model.layers.0": {"w": w},
        "optimizer.state.0": {"exp_avg": x},
        "optimizer.state": {"0.exp_avg": x},
        "bufs": {"0": w, "1": y},
        "bufs.1": {"bufs.1": y},
        "model": {"layers.0.w": w},
        "all": {"model.layers.0.w": w, "optimizer.state.0.exp_avg": x, "bufs.0": w, "bufs.1": y},
    }
    for i, (section, want) in enumerate(cases.items()):
        export(tmp_path / "ck", tmp_path / f"s{i}", section=section)
        got = load_file(tmp_path / f"s{i}" / "model.safetensors")
        assert set(got) == set(want) and all(same_bytes(got[k], v) for k, v in want.items()), section
    with pytest.raises(ExportError, match="section 'optimizer.param_groups' holds no tensors"):
        export(tmp_path / "ck", tmp_path / "none", section="optimizer.param_groups")


def test_hf_tensor_named_metadata_is_refused(tmp_path: Path) -> None:
    ucp.save(
        {
            "model": {
                "__metadata__": random_tensor(torch.float32, (3,), seed=1),
                "w": random_tensor(torch.float32, (2,), seed=2),
            }
        },
        tmp_path / "ck",
    )
    try:
        export(tmp_path / "ck", tmp_path / "hf")
    except ExportError as exc:
        assert "__metadata__" in str(exc)
        assert not (tmp_path / "hf").exists()
        return
    load_file(tmp_path / "hf" / "model.safetensors")  # today: SafetensorError, invalid JSON in header
    raise AssertionError("a tensor named '__metadata__' cannot be stored in safetensors; expected ExportError")


def test_export_names_are_the_state_dict_keys(tmp_path: Path) -> None:
    t = random_tensor(torch.float32, (3,), seed=1)
    ucp.save({"model": {"a#b": t}}, tmp_path / "ck")
    assert list(ucp.load(tmp_path / "ck")["model"]) == ["a#b"]  # ucp itself keeps the key
    export(tmp_path / "ck", tmp_path / "hf")
    assert list(load_file(tmp_path / "hf" / "model.safetensors")) == ["a#b"]


def test_default_model_export_names_survive_a_name_clash(tmp_path: Path) -> None:
    w, x = random_tensor(torch.float32, (2,), seed=1), random_tensor(torch.float32, (3,), seed=2)
    ucp.save({"model.a": x, "model": {"a": w}}, tmp_path / "ck")
    export(tmp_path / "ck", tmp_path / "hf")
    got = load_file(tmp_path / "hf" / "model.safetensors")
    assert list(got) == ["a"] and same_bytes(got["a"], w)


def test_zarr_tensor_named_like_the_metadata_file(tmp_path: Path) -> None:
    t = random_tensor(torch.float32, (2,), seed=1)
    ucp.save({"model": {"zarr.json": t}}, tmp_path / "ck")
    export(tmp_path / "ck", tmp_path / "z", format="zarr")
    group = zarr.open_group(str(tmp_path / "z"), mode="r")
    assert same_bytes(read_tensor(group[ucp_attrs(group)["tensors"]["zarr.json"]]), t)


# -- import: Hugging Face -------------------------------------------------------------------------


def _hf_shards(folder: Path, parts: list[dict[str, torch.Tensor]], weight_map: dict[str, str] | None = None) -> Path:
    folder.mkdir(parents=True)
    names = [f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors" for i in range(len(parts))]
    for name, part in zip(names, parts):
        save_file(part, folder / name, metadata={"format": "pt"})
    if weight_map is None:
        weight_map = {k: name for name, part in zip(names, parts) for k in part}
    total = sum(t.numel() * t.element_size() for p in parts for t in p.values())
    (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return folder


def test_hf_tensor_in_two_shards_is_named(tmp_path: Path) -> None:
    a, b = random_tensor(torch.float32, (2,), seed=1), random_tensor(torch.float32, (3,), seed=2)
    src = _hf_shards(
        tmp_path / "hf",
        [{"a": a, "b": b}, {"b": b}],
        weight_map={"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"},
    )
    with pytest.raises(ForeignCheckpointError, match=r"model-00002-of-00002\.safetensors.*tensor 'b' also appears"):
        convert(src, tmp_path / "ucp")
    assert not (tmp_path / "ucp").exists()


def test_hf_unlisted_tensor_is_named(tmp_path: Path) -> None:
    a, b = random_tensor(torch.float32, (2,), seed=1), random_tensor(torch.float32, (3,), seed=2)
    src = _hf_shards(
        tmp_path / "hf",
        [{"a": a}, {"b": b}],
        weight_map={"a": "model-00001-of-00002.safetensors", "x": "model-00002-of-00002.safetensors"},
    )
    with pytest.raises(ForeignCheckpointError, match=r"index\.json.*listed but missing: \['x'\].*unlisted: \['b'\]"):
        convert(src / INDEX, tmp_path / "ucp")


def test_hf_import_then_export_is_bit_exact(tmp_path: Path) -> None:
    """Sharded HF set (every dtype, 0-d, empty) -> ucp convert -> ucp export hf: the same tensors, bit for bit."""
    weights = _every_dtype()
    keys = list(weights)
    parts = [{k: weights[k] for k in keys[i::3]} for i in range(3)]
    src = _hf_shards(tmp_path / "hf", parts)
    assert detect(src) == "hf"
    convert(src, tmp_path / "ucp")
    export(tmp_path / "ucp", tmp_path / "out", max_shard_size=200)
    got = _hf_tensors(tmp_path / "out")
    assert set(got) == set(weights)
    assert [k for k, v in weights.items() if not same_bytes(got[k], v)] == []
    # the single-file form too, compared with what safetensors itself reads from the original
    save_file(weights, tmp_path / "one.safetensors")
    convert(tmp_path / "one.safetensors", tmp_path / "ucp1")
    export(tmp_path / "ucp1", tmp_path / "out1")
    original, back = load_file(tmp_path / "one.safetensors"), load_file(tmp_path / "out1" / "model.safetensors")
    assert set(original) == set(back) and all(same_bytes(back[k], v) for k, v in original.items())


# -- import: DCP -----------------------------------------------------------------------------------


def _dcp_save(state: dict[str, Any], path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # single-process save without a process group is intended
        dcp.save(state, checkpoint_id=str(path))


def _optimizer_state() -> tuple[dict[str, Any], dict[str, Any]]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    return model.state_dict(), opt.state_dict()


def test_dcp_optimizer_state_keeps_its_lists(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    msd, osd = _optimizer_state()
    bufs = [random_tensor(torch.bfloat16, (3,), seed=1), random_tensor(torch.int32, (2,), seed=2)]
    _dcp_save({"model": msd, "optim": osd, "bufs": bufs, "step": 1}, tmp_path / "dcp")
    dcp_to_torch_save(str(tmp_path / "dcp"), str(tmp_path / "ref.pt"))  # DCP's own reading: lists stay lists
    ref = torch.load(tmp_path / "ref.pt", weights_only=False)
    assert isinstance(ref["optim"]["param_groups"], list) and isinstance(ref["bufs"], list)
    convert(tmp_path / "dcp", tmp_path / "ucp")
    got = ucp.load(tmp_path / "ucp")
    for name in ("exp_avg", "exp_avg_sq"):  # the tensors themselves are right
        assert same_bytes(got["optim"]["state"]["0"][name], osd["state"][0][name])
    assert isinstance(got["bufs"], list), type(got["bufs"])
    assert isinstance(got["optim"]["param_groups"], list), got["optim"]["param_groups"]
    assert got["optim"]["param_groups"][0]["params"] == [0, 1]


def test_dcp_bytes_item(tmp_path: Path) -> None:
    t = random_tensor(torch.float32, (3, 2), seed=3)
    _dcp_save({"model": {"w": t}, "dataloader": {"rank0": b"\x80\x04state"}, "step": 2}, tmp_path / "dcp")
    value = read(tmp_path / "dcp")[1].state["dataloader"]["rank0"]
    assert (value if isinstance(value, bytes) else value.numpy().tobytes()) == b"\x80\x04state"
    try:
        convert(tmp_path / "dcp", tmp_path / "ucp")
    except ForeignCheckpointError as exc:  # refusing is fine if it names the key and the DCP file
        assert "dataloader.rank0" in str(exc) and str(tmp_path / "dcp") in str(exc)
        return
    got = ucp.load(tmp_path / "ucp")
    assert same_bytes(got["model"]["w"], t)
    blob = got["dataloader"]["rank0"]
    assert (blob if isinstance(blob, bytes) else blob.numpy().tobytes()) == b"\x80\x04state"


@pytest.mark.timeout(120)
def test_dcp_two_rank_sharded_save_with_optimizer_state(tmp_path: Path) -> None:
    out = tmp_path / "dcp"
    run_world(SUPPORT / "dcp_save_worker.py", lambda r: ["mixed", r, 2, tmp_path / "init", out], 2, timeout=100)
    report = convert(out, tmp_path / "ucp")
    assert report.step == 4
    m = ucp.read_manifest(tmp_path / "ucp")
    boxes = [p.box for p in m.tensors["model.cols"].pieces]
    assert None not in boxes and sorted(tuple(b.offsets) for b in boxes if b is not None) == [(0, 0), (0, 3)]
    f = dcp_mixed_state()
    got = ucp.load(tmp_path / "ucp")
    assert all(same_bytes(got["model"][k], v) for k, v in f.items())
    assert same_bytes(got["optim"]["state"]["rows"]["exp_avg"], f["rows"] * 2)
    assert same_bytes(got["optim"]["state"]["rows"]["step"], torch.tensor(4.0))
    export(tmp_path / "ucp", tmp_path / "hf", section="all")  # and out again, consolidated
    hf = load_file(tmp_path / "hf" / "model.safetensors")
    assert all(same_bytes(hf[f"model.{k}"], v) for k, v in f.items())
    assert same_bytes(hf["optim.state.rows.exp_avg"], f["rows"] * 2)


# -- import: DeepSpeed universal ------------------------------------------------------------------


def _universal(folder: Path) -> dict[str, Any]:
    """A small ``ds_to_universal``-shaped ZeRO-2 folder: model states, zero/optimizer_state.pt and one
    ``{"param": tensor, "cat_dim": 0}`` file per parameter and state."""
    (folder / "zero").mkdir(parents=True)
    shapes = OrderedDict(w=torch.Size([3, 4]), b=torch.Size([4]))
    master = {n: random_tensor(torch.float32, tuple(s), seed=i) for i, (n, s) in enumerate(shapes.items())}
    module = OrderedDict((n, master[n].bfloat16()) for n in shapes)
    module["pos"] = torch.arange(5)  # a buffer: not in param_shapes
    torch.save(
        {
            "module": module,
            "param_shapes": [shapes],
            "global_steps": 3,
            "dp_world_size": 2,
            "mp_world_size": 1,
            "ds_version": "0.19.8",
            "ds_config": {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}},
        },
        folder / "mp_rank_00_model_states.pt",
    )
    groups = [{"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}]
    torch.save({"zero_stage": 2, "param_groups": groups}, folder / "zero" / "optimizer_state.pt")
    moments: dict[str, dict[str, torch.Tensor]] = {"exp_avg": {}, "exp_avg_sq": {}}
    for i, (n, s) in enumerate(shapes.items()):
        (folder / "zero" / n).mkdir()
        torch.save({"param": master[n], "cat_dim": 0}, folder / "zero" / n / "fp32.pt")
        for j, m in enumerate(moments):
            moments[m][n] = random_tensor(torch.float32, tuple(s), seed=10 * i + j + 10)
            torch.save({"param": moments[m][n], "cat_dim": 0}, folder / "zero" / n / f"{m}.pt")
        torch.save(torch.tensor(3.0), folder / "zero" / n / "step.pt")
    return {"module": module, "master": master, **moments}


def test_universal_import_and_missing_fragment(tmp_path: Path) -> None:
    src = tmp_path / "global_step3_universal"
    want = _universal(src)
    assert detect(src) == "deepspeed-universal"
    convert(src, tmp_path / "ucp")
    got = ucp.load(tmp_path / "ucp")
    assert got["step"] == 3 and got["optimizer"]["adam_step"] == 3
    assert list(got["model"]) == ["w", "b", "pos"]
    assert all(same_bytes(got["model"][k], v) for k, v in want["module"].items())
    for n in ("w", "b"):
        assert same_bytes(got["optimizer"]["fp32_master"][n], want["master"][n])
        assert same_bytes(got["optimizer"]["exp_avg"][n], want["exp_avg"][n])
        assert same_bytes(got["optimizer"]["exp_avg_sq"][n], want["exp_avg_sq"][n])
    export(tmp_path / "ucp", tmp_path / "hf")  # the model's weights out, in the training dtype
    hf = load_file(tmp_path / "hf" / "model.safetensors")
    assert all(same_bytes(hf[k], v) for k, v in want["module"].items())
    missing = src / "zero" / "b" / "exp_avg_sq.pt"
    missing.unlink()
    with pytest.raises(ForeignCheckpointError, match=rf"{missing}' is missing"):
        convert(src, tmp_path / "ucp2")
    assert not (tmp_path / "ucp2").exists()
