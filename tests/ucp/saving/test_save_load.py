"""Single-process save/load round trips: every dtype, odd shapes and views, nested structures."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from safetensors import safe_open
from ucp_helpers import assert_same_state, random_tensor, same_bytes

import ucp
from ucp.saving.plan import PLAN_CACHE

DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
] + ([torch.float8_e8m0fnu] if hasattr(torch, "float8_e8m0fnu") else [])


def test_every_dtype_round_trips_bit_exact(tmp_path):
    sd = {str(dt): random_tensor(dt, (3, 5), seed=i) for i, dt in enumerate(DTYPES)}
    ucp.save(sd, tmp_path / "ck")
    out = ucp.load(tmp_path / "ck")
    assert_same_state(sd, out)
    # and any safetensors reader sees the same tensors
    with safe_open(tmp_path / "ck" / "rank-00000.safetensors", "pt") as f:
        assert set(f.keys()) == set(sd)
        for k in f.keys():
            assert same_bytes(f.get_tensor(k), sd[k]), k


def test_unsupported_dtypes_are_refused_clearly(tmp_path):
    with pytest.raises(ucp.UnsupportedStateError, match=r"'x'.*complex128"):
        ucp.save({"x": torch.zeros(2, dtype=torch.complex128)}, tmp_path / "ck")
    assert not (tmp_path / "ck").exists()
    assert os.listdir(tmp_path) == []  # nothing left behind


def test_shapes_views_and_layout(tmp_path):
    base = random_tensor(torch.float32, (6, 8), seed=1)
    sd = {
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "empty3": torch.empty(2, 0, 3, dtype=torch.int64),
        "transposed": base.t(),
        "strided": base[::2, 1::3],
        "expanded": torch.arange(4).expand(3, 4),
        "negstride_like": base.flip(0),
        "grad": torch.ones(3, requires_grad=True),
        "conj": torch.complex(torch.ones(2), torch.ones(2)).conj(),
        "big_int": torch.tensor([2**62, -(2**63)], dtype=torch.int64),
    }
    ucp.save(sd, tmp_path / "ck")
    out = ucp.load(tmp_path / "ck")
    for k, v in sd.items():
        expect = v.detach().resolve_conj()
        assert out[k].shape == expect.shape and same_bytes(out[k], expect.contiguous()), k
    # header padded to 4096, pieces in descending itemsize, each offset a multiple of its itemsize
    path = tmp_path / "ck" / "rank-00000.safetensors"
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    assert (8 + n) % 4096 == 0
    manifest = ucp.read_manifest(tmp_path / "ck")
    pieces = sorted((e.pieces[0].offset, e.dtype) for e in manifest.tensors.values())
    sizes = [
        torch.empty(0, dtype=getattr(torch, {"F32": "float32", "I64": "int64", "C64": "complex64"}[d])).itemsize
        for _, d in pieces
    ]
    assert sizes == sorted(sizes, reverse=True)
    for (off, _), size in zip(pieces, sizes):
        assert off % size == 0


def test_nested_structure_and_plain_values(tmp_path):
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    sd = {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "plain": {
            "i": 1,
            "f": 0.5,
            "s": "text",
            "b": True,
            "n": None,
            "nan": float("nan"),
            "inf": float("-inf"),
            "big": 2**80,
            "list": [1, [2, {"x": 3}]],
            "tuple": (1, "a", (2.0,)),
            "empty": {},
            "el": [],
        },
        "int_keys": {0: "zero", 1: {2: torch.ones(1)}, "mixed": 5},
        "weird.key": {"a.b": torch.zeros(2)},
        "weird": {"key": {"a": {"b": torch.ones(2)}}},
        "unicode ключ": "значение",
    }
    ucp.save(sd, tmp_path / "ck", step=12, metadata={"run": "t", "n": [1, 2]})
    out = ucp.load(tmp_path / "ck")
    assert_same_state(sd, out)
    m = ucp.read_manifest(tmp_path / "ck")
    assert m.step == 12 and m.metadata == {"run": "t", "n": [1, 2]} and m.topology.world_size == 1
    assert m.format_version == ucp.FORMAT_VERSION and m.creator.startswith("ucp")
    # the optimizer loads back into a fresh one
    opt2 = torch.optim.AdamW(model.parameters(), lr=1.0)
    opt2.load_state_dict(out["optim"])
    assert opt2.param_groups[0]["lr"] == 1e-3 and opt2.param_groups[0]["betas"] == (0.9, 0.95)
    # NO pickle: the manifest is JSON and data files are safetensors
    json.loads((tmp_path / "ck" / "manifest.json").read_text())
    assert sorted(os.listdir(tmp_path / "ck")) == ["manifest.json", "rank-00000.safetensors"]


def test_unsupported_values_name_the_key(tmp_path):
    with pytest.raises(ucp.UnsupportedStateError, match=r"\['a'\]\['b'\].*object"):
        ucp.save({"a": {"b": object()}}, tmp_path / "x")
    with pytest.raises(ucp.UnsupportedStateError, match="key"):
        ucp.save({"a": {(1, 2): 3}}, tmp_path / "x")
    with pytest.raises(ucp.UnsupportedStateError, match="must be a dict"):
        ucp.save([torch.ones(1)], tmp_path / "x")
    with pytest.raises(ucp.UnsupportedStateError, match="metadata"):
        ucp.save({}, tmp_path / "x", metadata={"a": object()})
    deep: dict = {}
    cur = deep
    for _ in range(100):
        cur["d"] = {}
        cur = cur["d"]
    with pytest.raises(ucp.UnsupportedStateError, match="deeper"):
        ucp.save(deep, tmp_path / "x")
    assert os.listdir(tmp_path) == []


def test_zero_copy_tensors_are_independent_and_writable(tmp_path):
    sd = {"a": torch.arange(10.0), "b": torch.arange(5)}
    ucp.save(sd, tmp_path / "ck")
    out = ucp.load(tmp_path / "ck")
    out["a"] += 1  # writable, and does not touch "b"
    assert torch.equal(out["b"], torch.arange(5))
    assert torch.equal(out["a"], torch.arange(10.0) + 1)


def test_verify_false_skips_crc(tmp_path):
    sd = {"a": torch.arange(1000, dtype=torch.int32)}
    ucp.save(sd, tmp_path / "ck")
    m = ucp.read_manifest(tmp_path / "ck")
    p = m.tensors["a"].pieces[0]
    with open(tmp_path / "ck" / p.file, "r+b") as f:
        f.seek(p.offset + 8)
        f.write(b"\x01")
    with pytest.raises(ucp.CorruptCheckpointError):
        ucp.load(tmp_path / "ck")
    out = ucp.load(tmp_path / "ck", verify=False)
    assert out["a"][2] != 2


def test_plan_is_cached_for_the_same_layout(tmp_path):
    PLAN_CACHE.clear()
    sd = {"w": torch.randn(4, 4), "opt": {0: torch.zeros(4)}, "step": 1}
    ucp.save(sd, tmp_path / "a")
    assert (PLAN_CACHE.hits, PLAN_CACHE.misses) == (0, 1)
    sd2 = {"w": torch.randn(4, 4), "opt": {0: torch.ones(4)}, "step": 2}  # new values, same layout
    ucp.save(sd2, tmp_path / "b")
    assert (PLAN_CACHE.hits, PLAN_CACHE.misses) == (1, 1)
    assert_same_state(ucp.load(tmp_path / "b"), sd2)
    ucp.save({"w": torch.randn(4, 5), "opt": {0: torch.ones(4)}, "step": 2}, tmp_path / "c")  # new shape
    assert (PLAN_CACHE.hits, PLAN_CACHE.misses) == (1, 2)


def test_save_overwrites_and_returns_manifest(tmp_path):
    m1 = ucp.save({"a": torch.ones(3)}, tmp_path / "ck", step=1)
    m2 = ucp.save({"b": torch.zeros(2)}, tmp_path / "ck", step=2)
    assert m1.step == 1 and m2.step == 2 and list(m2.tensors) == ["b"]
    assert_same_state(ucp.load(tmp_path / "ck"), {"b": torch.zeros(2)})
    assert os.listdir(tmp_path) == ["ck"]


def test_aio_config_as_deepspeed_dict(tmp_path):
    sd = {"a": random_tensor(torch.float32, (1000, 300))}
    ucp.save(sd, tmp_path / "ck", aio_config={"aio": {"block_size": 65536, "queue_depth": 4, "thread_count": 2}})
    out = ucp.load(tmp_path / "ck", aio_config={"block_size": 65536, "queue_depth": 4})
    assert_same_state(sd, out)


def test_large_tensor_spanning_many_segments(tmp_path, monkeypatch):
    import ucp.store.reader as reader

    monkeypatch.setattr(reader, "SEGMENT", 1 << 16)
    sd = {"a": random_tensor(torch.float32, (300, 1000), seed=3), "b": random_tensor(torch.int8, (70001,), seed=4)}
    ucp.save(sd, tmp_path / "ck")
    assert_same_state(ucp.load(tmp_path / "ck"), sd)
    assert ucp.verify(tmp_path / "ck").ok


def test_no_threads_or_buffers_left_behind(tmp_path):
    """Every engine a save/load/verify starts is closed (an orphaned one kept its last buffer alive)."""
    import threading

    sd = {"a": random_tensor(torch.float32, (512, 1024), seed=5), "b": torch.ones(3)}
    before = {t.ident for t in threading.enumerate()}
    for _ in range(3):
        ucp.save(sd, tmp_path / "ck")
        ucp.load(tmp_path / "ck")
        ucp.load(tmp_path / "ck", into={"a": torch.zeros(512, 1024)}, verify=False)
        ucp.verify(tmp_path / "ck")
    left = [t.name for t in threading.enumerate() if t.ident not in before]
    assert left == []
