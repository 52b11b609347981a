"""Export to zarr v3: every array equal to its tensor through plain zarr, bf16/float8 as raw bits, chunks, codecs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from ucp_helpers import random_tensor, same_bytes, save_ranks
from zarr_checks import array, open_group, ucp_attrs, values

import ucp
from ucp.conversion.exporters import ExportError, export
from ucp.conversion.exporters.zarr_export import array_name, chunk_shape, read_tensor

DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int64,
    torch.int16,
    torch.uint8,
    torch.bool,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.complex64,
]
RAW = {torch.bfloat16: np.uint16, torch.float8_e4m3fn: np.uint8, torch.float8_e5m2: np.uint8}


def _model() -> dict[str, torch.Tensor]:
    state = {f"w.{str(d).removeprefix('torch.')}": random_tensor(d, (6, 5), seed=i) for i, d in enumerate(DTYPES)}
    state["scalar"] = random_tensor(torch.float32, (), seed=30)
    state["empty"] = torch.empty(0, 4, dtype=torch.bfloat16)
    state["zeros"] = torch.zeros(256, 64, dtype=torch.float32)  # compresses to almost nothing
    return state


@pytest.fixture()
def ckpt(tmp_path: Path) -> tuple[Path, dict]:
    model = _model()
    ucp.save({"model": model, "step": 5}, tmp_path / "ck", step=5)
    return tmp_path / "ck", model


def _numpy_bits(t: torch.Tensor) -> np.ndarray:
    raw = {torch.bfloat16: torch.uint16, torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8}.get(t.dtype)
    return (t.view(raw) if raw is not None else t).numpy()


def test_round_trip_through_plain_zarr(ckpt, tmp_path: Path) -> None:
    path, model = ckpt
    report = export(path, tmp_path / "out.zarr", format="zarr")
    assert report.format == "zarr" and sorted(report.files) == sorted(model) and report.section == "model"
    group = open_group(tmp_path / "out.zarr")
    assert sorted(group.array_keys()) == sorted(model)
    for name, t in model.items():
        arr = array(group, name)
        assert arr.shape == tuple(t.shape), name
        assert arr.dtype == np.dtype(RAW.get(t.dtype, _numpy_bits(t).dtype)), name
        assert arr.attrs["ucp_dtype"] == str(t.dtype).removeprefix("torch.") and arr.attrs["ucp_name"] == name
        data = values(arr)
        want = _numpy_bits(t)
        assert data.tobytes() == want.tobytes(), name  # bit-exact, NaN payloads and -0.0 included
        assert same_bytes(read_tensor(arr), t), name
    # bf16 the documented way: the uint16 bits viewed as bfloat16
    bf = array(group, "w.bfloat16")
    assert bf.dtype == np.uint16 and bf.attrs["ucp_dtype"] == "bfloat16"
    assert same_bytes(torch.from_numpy(values(bf)).view(torch.bfloat16), model["w.bfloat16"])
    attrs = ucp_attrs(group)
    assert attrs["step"] == 5 and attrs["format_version"] == ucp.FORMAT_VERSION and attrs["section"] == "model"
    assert attrs["source"] == str(path) and attrs["tensors"] == {n: n for n in model}
    assert not [p for p in os.listdir(tmp_path) if ".export-" in p]


@pytest.mark.parametrize("compressor, codec", [("zstd", "zstd"), ("blosc", "blosc"), ("none", None)])
def test_compression_codecs(ckpt, tmp_path: Path, compressor: str, codec: str | None) -> None:
    path, model = ckpt
    out = tmp_path / f"{compressor}.zarr"
    export(path, out, format="zarr", compressor=compressor, level=5)
    meta = json.loads((out / "zeros" / "zarr.json").read_text())
    names = [c["name"] for c in meta["codecs"]]
    if codec is None:
        assert names == ["bytes"]
    else:
        assert names == ["bytes", codec]
        conf = meta["codecs"][1]["configuration"]
        assert conf.get("level", conf.get("clevel")) == 5
    stored = sum(f.stat().st_size for f in (out / "zeros").rglob("*") if f.is_file() and f.name != "zarr.json")
    raw = model["zeros"].numel() * 4
    assert (stored < raw // 20) if codec else (stored == raw)  # compression is really applied
    assert same_bytes(read_tensor(array(open_group(out), "zeros")), model["zeros"])


def test_chunking(tmp_path: Path) -> None:
    assert chunk_shape((1000, 256), 4, 64 << 10) == (64, 256)  # 1 KiB rows: 64 per 64 KiB chunk
    assert chunk_shape((10, 4), 4, 1 << 20) == (10, 4)  # small: one chunk
    assert chunk_shape((4, 1000, 100), 2, 20_000) == (1, 100, 100)  # a dim-0 row too large: split dim 1
    assert chunk_shape((), 4, 100) == () and chunk_shape((0, 5), 4, 100) == (1, 5)
    assert chunk_shape((3, 0), 4, 100) == (3, 1)
    t = random_tensor(torch.bfloat16, (300, 70), seed=3)
    ucp.save({"model": {"t": t}}, tmp_path / "ck")
    export(tmp_path / "ck", tmp_path / "z", format="zarr", chunk_bytes=10_000, memory_budget=1000)
    arr = array(open_group(tmp_path / "z"), "t")
    assert arr.chunks == (71, 70)  # 140 B rows, 10 000 B chunks
    assert len(list((tmp_path / "z" / "t" / "c").iterdir())) == 5
    assert same_bytes(read_tensor(arr), t)


def test_multi_rank_sharded_checkpoint(tmp_path: Path) -> None:
    w = random_tensor(torch.float32, (8, 6), seed=1)
    f = random_tensor(torch.bfloat16, (5, 7), seed=2)
    cut = [0, 13, 35]
    states = [
        {
            "model": {
                "w": ucp.ShardedTensor(w[:, k * 3 : (k + 1) * 3].contiguous(), (8, 6), (0, k * 3)),
                "f": ucp.FlatShard(f.reshape(-1)[cut[k] : cut[k + 1]].clone(), (5, 7), cut[k]),
            },
            "optimizer": {"m": ucp.FlatShard(w.reshape(-1)[k * 24 : (k + 1) * 24].clone(), (8, 6), k * 24)},
        }
        for k in range(2)
    ]
    save_ranks(tmp_path / "ck", states, mesh={"dp": 2}, step=11)
    report = export(tmp_path / "ck", tmp_path / "z", format="zarr", section="all", dtype="fp32")
    group = zarr.open_group(str(tmp_path / "z"), mode="r")
    assert sorted(group.array_keys()) == ["model.f", "model.w", "optimizer.m"] and report.dtype == "float32"
    assert same_bytes(read_tensor(group["model.w"]), w) and same_bytes(read_tensor(group["optimizer.m"]), w)
    assert same_bytes(read_tensor(group["model.f"]), f.to(torch.float32))
    assert array(group, "model.f").dtype == np.float32 and ucp_attrs(group)["cast_dtype"] == "float32"


def test_awkward_names_are_escaped(tmp_path: Path) -> None:
    a, b, c = (random_tensor(torch.float32, (2,), seed=i) for i in range(3))
    ucp.save({"model": {"enc/dec": a, "__init": b, "100%": c}}, tmp_path / "ck")
    export(tmp_path / "ck", tmp_path / "z", format="zarr")
    group = open_group(tmp_path / "z")
    mapping = ucp_attrs(group)["tensors"]
    assert mapping == {"enc/dec": "enc%2Fdec", "__init": "%5F_init", "100%": "100%25"}
    for name, t in {"enc/dec": a, "__init": b, "100%": c}.items():
        arr = array(group, mapping[name])
        assert arr.attrs["ucp_name"] == name and same_bytes(read_tensor(arr), t)
    assert array_name(".") == "%2E" and array_name("") == "%00" and array_name("a.b") == "a.b"


def test_bad_options(ckpt, tmp_path: Path) -> None:
    path, _ = ckpt
    with pytest.raises(ExportError, match="unknown compressor 'lz5'"):
        export(path, tmp_path / "z", format="zarr", compressor="lz5")
    with pytest.raises(ExportError, match="max_shard_size applies to format 'hf' only"):
        export(path, tmp_path / "z", format="zarr", max_shard_size="1GB")
    with pytest.raises(ExportError, match="apply to format 'zarr' only"):
        export(path, tmp_path / "z", format="hf", compressor="zstd")
    with pytest.raises(ExportError, match="unknown format 'onnx'"):
        export(path, tmp_path / "z", format="onnx")  # type: ignore[arg-type]
    assert not (tmp_path / "z").exists()


def test_chunks_equal_to_the_fill_value_are_still_written(tmp_path: Path) -> None:
    """-0.0 == 0.0 (the fill value): a skipped chunk would come back as +0.0; every chunk must be stored."""
    t = torch.full((40, 10), -0.0)
    ucp.save({"model": {"t": t}}, tmp_path / "ck")
    export(tmp_path / "ck", tmp_path / "z", format="zarr", chunk_bytes=400)
    assert len(list((tmp_path / "z" / "t" / "c").iterdir())) == 4
    got = values(array(open_group(tmp_path / "z"), "t"))
    assert np.signbit(got).all() and same_bytes(torch.from_numpy(got), t)
