"""Export to Hugging Face safetensors: bit-exact round trips, shards + index, casts, memory batches, atomicity."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import pytest
import torch
from repo_paths import SUPPORT
from safetensors import safe_open
from safetensors.torch import load_file
from ucp_helpers import random_tensor, same_bytes, save_ranks
from world import run_world

import ucp
import ucp.conversion.exporters.stream as stream
from ucp.conversion.exporters import ExportError, export, parse_dtype, plan_batches, select_tensors, size_option
from ucp.conversion.exporters.hf import INDEX, file_layout, plan_shards

DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.float8_e4m3fn,
    torch.complex64,
]


def model_state() -> dict[str, torch.Tensor]:
    """Every storable kind: many dtypes, a 0-d tensor, empty tensors, odd shapes."""
    state = {f"w_{str(d).removeprefix('torch.')}": random_tensor(d, (5, 3, 2), seed=i) for i, d in enumerate(DTYPES)}
    state["scalar"] = random_tensor(torch.int64, (), seed=40)
    state["scalar_bf16"] = random_tensor(torch.bfloat16, (), seed=41)
    state["empty"] = torch.empty(0, dtype=torch.float32)
    state["empty_2d"] = torch.empty(3, 0, dtype=torch.bfloat16)
    state["layers.0.attn.qkv.weight"] = random_tensor(torch.float32, (12, 7), seed=42)
    return state


@pytest.fixture()
def ckpt(tmp_path: Path) -> tuple[Path, dict]:
    state = {
        "model": model_state(),
        "optimizer": {"exp_avg": {"a": random_tensor(torch.float32, (4,), seed=50)}, "adam_step": 3},
        "step": 9,
    }
    path = tmp_path / "step-9"
    ucp.save(state, path, step=9)
    return path, state


def test_consolidated_round_trip_is_bit_exact(ckpt, tmp_path: Path) -> None:
    path, state = ckpt
    report = export(path, tmp_path / "hf")
    assert report.files == ["model.safetensors"] and report.section == "model"
    assert report.tensors == len(state["model"])
    assert report.bytes == sum(t.numel() * t.element_size() for t in state["model"].values())
    assert sorted(os.listdir(tmp_path / "hf")) == ["model.safetensors"]  # no temp files, no index
    got = load_file(tmp_path / "hf" / "model.safetensors")
    assert set(got) == set(state["model"])  # "model." prefix stripped, nothing else exported
    for name, t in state["model"].items():
        assert same_bytes(got[name], t), name
    with safe_open(tmp_path / "hf" / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
    # the header is computed up front: the file is exactly header + data, tensors item-size aligned
    head, ordered = file_layout(select_tensors(ucp.read_manifest(path)).tensors)
    assert (tmp_path / "hf" / "model.safetensors").stat().st_size == len(head) + report.bytes
    assert len(head) % 8 == 0


def test_sections(ckpt, tmp_path: Path) -> None:
    path, state = ckpt
    everything = export(path, tmp_path / "all", section="all")
    got = load_file(tmp_path / "all" / "model.safetensors")
    assert set(got) == {f"model.{k}" for k in state["model"]} | {"optimizer.exp_avg.a"}
    assert everything.section == "" and same_bytes(got["optimizer.exp_avg.a"], state["optimizer"]["exp_avg"]["a"])
    export(path, tmp_path / "opt", section="optimizer.exp_avg")
    assert list(load_file(tmp_path / "opt" / "model.safetensors")) == ["a"]
    with pytest.raises(ExportError, match=r"section 'optimiser' is not in the checkpoint.*'model', 'optimizer'"):
        export(path, tmp_path / "bad", section="optimiser")
    with pytest.raises(ExportError, match=r"section 'optimizer.adam_step' holds no tensors"):
        export(path, tmp_path / "bad", section="optimizer.adam_step")
    assert not (tmp_path / "bad").exists()


def test_no_model_subtree_exports_everything(tmp_path: Path) -> None:
    a, b = random_tensor(torch.float32, (3, 3), seed=1), random_tensor(torch.int64, (2,), seed=2)
    ucp.save({"weights": {"a": a}, "b": b, "model_name": "x"}, tmp_path / "ck")
    report = export(tmp_path / "ck", tmp_path / "hf")
    got = load_file(tmp_path / "hf" / "model.safetensors")
    assert report.section == "" and set(got) == {"weights.a", "b"}
    assert same_bytes(got["weights.a"], a) and same_bytes(got["b"], b)


def test_root_key_starting_with_model_is_not_the_model(tmp_path: Path) -> None:
    """Sections are state-tree nodes, not name prefixes: 'model.x' at the root is not under 'model'."""
    w, x = random_tensor(torch.float32, (2,), seed=1), random_tensor(torch.float32, (3,), seed=2)
    ucp.save({"model": {"w": w}, "model.x": x}, tmp_path / "ck")
    export(tmp_path / "ck", tmp_path / "hf")
    got = load_file(tmp_path / "hf" / "model.safetensors")
    assert list(got) == ["w"] and same_bytes(got["w"], w)
    export(tmp_path / "ck", tmp_path / "x", section="model.x")  # a section that is a tensor keeps its name
    assert same_bytes(load_file(tmp_path / "x" / "model.safetensors")["model.x"], x)


def test_sharded_output_index_and_sizes(tmp_path: Path) -> None:
    sizes = [(40, 10), (3, 7), (100,), (64, 64), (5,), (30, 30), (1,)]
    model = {f"t{i}": random_tensor(torch.float32, s, seed=i) for i, s in enumerate(sizes)}
    model["big"] = random_tensor(torch.bfloat16, (80, 80), seed=99)  # 12800 B: more than a shard alone
    ucp.save({"model": model}, tmp_path / "ck")
    max_size = 8000
    report = export(tmp_path / "ck", tmp_path / "hf", max_shard_size=max_size)
    shards = [f for f in report.files if f != INDEX]
    assert report.files[-1] == INDEX and len(shards) > 2
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    index = json.loads((tmp_path / "hf" / INDEX).read_text())
    total = sum(t.numel() * t.element_size() for t in model.values())
    assert index["metadata"] == {"total_size": total} and report.bytes == total
    assert set(index["weight_map"]) == set(model) and set(index["weight_map"].values()) == set(shards)
    got: dict[str, torch.Tensor] = {}
    for shard in shards:
        part = load_file(tmp_path / "hf" / shard)
        data = sum(t.numel() * t.element_size() for t in part.values())
        assert data <= max_size or len(part) == 1, (shard, data)
        assert all(index["weight_map"][k] == shard for k in part)
        got.update(part)
    assert set(got) == set(model) and all(same_bytes(got[k], v) for k, v in model.items())
    # everything fits one shard: a plain model.safetensors, no index
    assert export(tmp_path / "ck", tmp_path / "one", max_shard_size="1MB").files == ["model.safetensors"]


def test_plan_shards_greedy_in_order() -> None:
    from ucp.conversion.exporters.selection import ExportTensor
    from ucp.format.manifest import TensorEntry

    ts = [
        ExportTensor(f"n{i}", f"n{i}", TensorEntry(dtype="U8", shape=[n], pieces=[]), torch.uint8)
        for i, n in enumerate([3, 3, 5, 1, 9, 2])
    ]
    shards = plan_shards(ts, 6)
    assert [[t.name for t in s] for s in shards] == [["n0", "n1"], ["n2", "n3"], ["n4"], ["n5"]]
    assert plan_shards(ts, None) == [ts]


def test_dtype_cast_floating_only(ckpt, tmp_path: Path) -> None:
    path, state = ckpt
    report = export(path, tmp_path / "bf16", dtype="bf16")
    assert report.dtype == "bfloat16"
    got = load_file(tmp_path / "bf16" / "model.safetensors")
    for name, t in state["model"].items():
        want = t.to(torch.bfloat16) if t.is_floating_point() else t
        assert same_bytes(got[name], want), name
    assert report.bytes == sum(v.numel() * v.element_size() for v in got.values())
    with pytest.raises(ExportError, match="unknown dtype 'bf17'"):
        export(path, tmp_path / "x", dtype="bf17")


def test_multi_rank_sharded_checkpoint_is_consolidated(tmp_path: Path) -> None:
    """Row shards, column shards, uneven flat (ZeRO) shards, replicated pieces, saved by 2 ranks."""
    w = random_tensor(torch.float32, (8, 6), seed=1)
    v = random_tensor(torch.bfloat16, (6, 8), seed=2)
    f = random_tensor(torch.int64, (5, 7), seed=3)
    r = random_tensor(torch.float16, (3, 3), seed=4)
    cut = [0, 16, 35]
    states = [
        {
            "model": {
                "w": ucp.ShardedTensor(w[k * 4 : (k + 1) * 4].clone(), (8, 6), (k * 4, 0)),
                "v": ucp.ShardedTensor(v[:, k * 4 : (k + 1) * 4].contiguous(), (6, 8), (0, k * 4)),
                "f": ucp.FlatShard(f.reshape(-1)[cut[k] : cut[k + 1]].clone(), (5, 7), cut[k]),
                "r": r.clone(),
            }
        }
        for k in range(2)
    ]
    save_ranks(tmp_path / "ck", states, mesh={"dp": 2})
    m = ucp.read_manifest(tmp_path / "ck")
    assert len(m.files) == 2 and all(len(m.tensors[f"model.{k}"].pieces) == 2 for k in "wvf")
    export(tmp_path / "ck", tmp_path / "hf", memory_budget=200)  # small budget: several batches
    got = load_file(tmp_path / "hf" / "model.safetensors")
    for name, t in {"w": w, "v": v, "f": f, "r": r}.items():
        assert same_bytes(got[name], t), name


@pytest.mark.timeout(300)
def test_two_process_gloo_checkpoint_exports(tmp_path: Path) -> None:
    """A checkpoint written by 2 real processes (tests/support/ucp_dist_worker.py, scenario save2)."""
    worker = SUPPORT / "ucp_dist_worker.py"
    run_world(worker, lambda r: ["save2", r, 2, tmp_path / "init", tmp_path], 2, timeout=240)
    from ucp_dist_worker import F, R, S, V, W

    export(tmp_path / "two", tmp_path / "hf", section="all", max_shard_size=300)
    index = json.loads((tmp_path / "hf" / INDEX).read_text())
    got = {}
    for shard in sorted(set(index["weight_map"].values())):
        got.update(load_file(tmp_path / "hf" / shard))
    want = {"model.w": W, "model.v": V, "model.r": R, "model.s": S, "optim.state.0.f": F}
    assert set(got) == set(want)
    for name, t in want.items():
        assert same_bytes(got[name], t), name


def test_batches_respect_the_memory_budget(tmp_path: Path, monkeypatch) -> None:
    costs = [100, 300, 50, 600, 20, 20, 1000, 10]
    batches = plan_batches(costs, 400)
    assert [i for b in batches for i in b] == list(range(len(costs)))  # all, in order
    for b in batches:
        assert sum(costs[i] for i in b) <= 400 or len(b) == 1
    assert batches == [[0, 1], [2], [3], [4, 5], [6], [7]]
    # the exporter's reads follow it: every read_targets call holds at most the budget (or one tensor)
    model = {f"t{i}": random_tensor(torch.float32, (n,), seed=i) for i, n in enumerate([10, 200, 30, 64, 5, 90])}
    ucp.save({"model": model}, tmp_path / "ck")
    calls: list[list[int]] = []
    real = stream.read_targets

    def spy(storage, name, manifest, targets, **options):
        calls.append([t.buffer.nbytes for t in targets])  # torch tensors, or numpy arrays of stored bytes
        return real(storage, name, manifest, targets, **options)

    monkeypatch.setattr(stream, "read_targets", spy)
    export(tmp_path / "ck", tmp_path / "hf", memory_budget=400)
    assert len(calls) > 2
    assert sorted(n for c in calls for n in c) == sorted(t.numel() * 4 for t in model.values())
    assert all(sum(c) <= 400 or len(c) == 1 for c in calls)
    got = load_file(tmp_path / "hf" / "model.safetensors")
    assert all(same_bytes(got[k], v) for k, v in model.items())


def test_cast_counts_both_copies_against_the_budget(ckpt) -> None:
    path, _ = ckpt
    sel = select_tensors(ucp.read_manifest(path), dtype=parse_dtype("fp16"))
    t = next(t for t in sel.tensors if t.name == "model.w_float32")
    assert stream.tensor_cost(t) == t.nbytes + t.nbytes // 2


def test_corrupt_source_leaves_no_output(ckpt, tmp_path: Path) -> None:
    path, _ = ckpt
    piece = ucp.read_manifest(path).tensors["model.layers.0.attn.qkv.weight"].pieces[0]
    with open(path / piece.file, "r+b") as f:
        f.seek(piece.offset + 5)
        b = f.read(1)
        f.seek(piece.offset + 5)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(ucp.CorruptCheckpointError, match="layers.0.attn.qkv.weight"):
        export(path, tmp_path / "hf")
    assert sorted(os.listdir(tmp_path)) == ["step-9"]  # no destination, no temporary directory left
    export(path, tmp_path / "hf", verify=False)  # without verification the bytes are exported as they are
    assert (tmp_path / "hf" / "model.safetensors").exists()


def test_destination_rules(ckpt, tmp_path: Path) -> None:
    path, state = ckpt
    dst = tmp_path / "out"
    dst.mkdir()
    export(path, dst)  # an empty directory is fine
    with pytest.raises(ExportError, match="exists and is not empty"):
        export(path, dst, section="optimizer")
    (dst / "stale.safetensors").write_bytes(b"x")
    export(path, dst, section="optimizer", overwrite=True)
    assert sorted(os.listdir(dst)) == ["model.safetensors"]  # replaced as a whole: stale files gone
    assert list(load_file(dst / "model.safetensors")) == ["exp_avg.a"]
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ExportError, match="is not a directory"):
        export(path, tmp_path / "afile", overwrite=True)
    assert not [p for p in os.listdir(tmp_path) if ".export-" in p]


def test_option_parsing() -> None:
    size = functools.partial(size_option, option="max_shard_size")
    assert size("2GB") == 2 * 10**9 and size("512MiB") == 512 << 20 and size("1e9") == 10**9
    assert size(4096) == 4096 and size("1.5 KiB") == 1536 and size("7") == 7
    for bad in ("2XB", "", "-1", "0", "GB", "2G"):
        with pytest.raises(ExportError, match=f"max_shard_size.*{bad}"):
            size(bad)
    assert parse_dtype("BF16") is torch.bfloat16 and parse_dtype("fp32") is torch.float32 and parse_dtype(None) is None
    with pytest.raises(ExportError, match="not a floating dtype"):
        parse_dtype(torch.int8)


def test_a_failed_overwrite_puts_the_old_export_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ucp.conversion.exporters.output as output

    ucp.save({"model": {"w": torch.arange(6.0)}}, tmp_path / "a")
    ucp.save({"model": {"w": torch.zeros(6)}}, tmp_path / "b")
    export(tmp_path / "a", tmp_path / "hf")
    real = os.rename

    def failing(src, dst):
        if ".export-tmp-" in str(src):
            raise OSError(28, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(output.os, "rename", failing)
    with pytest.raises(OSError):
        export(tmp_path / "b", tmp_path / "hf", overwrite=True)
    monkeypatch.setattr(output.os, "rename", real)
    assert torch.equal(load_file(tmp_path / "hf" / "model.safetensors")["w"], torch.arange(6.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "hf"]  # no temporary or old copies left
