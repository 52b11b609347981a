"""ucp.dcp: torch.distributed.checkpoint's own save/load through UCP's storage backend.

DCP writes through ``ucp.dcp.Writer`` and reads through ``ucp.dcp.Reader``: bit-exact for every dtype, at
one process and at two gloo ranks with DTensors resharded on load; what it writes is an ordinary UCP
checkpoint (``ucp.load``, ``ucp.verify``); what ``ucp.save`` writes loads through DCP; bad input fails
with errors naming the file, tensor or key.
"""

from __future__ import annotations

import gc
import io
import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan
from ucp_dcp_worker import BLOCKS, DTYPES, SHAPE, VALUES, full_state
from ucp_helpers import assert_same_state, random_tensor, same_bytes
from world import run_world

import ucp
import ucp.dcp
from ucp.format.dtypes import torch_dtype

SUPPORT = Path(__file__).resolve().parents[2] / "support"

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP warns that one process runs without a group


def _state() -> dict[str, Any]:
    """Every dtype (incl. a 0-d and an empty tensor), nesting through dicts and lists, and plain values."""
    tensors = {name: random_tensor(torch_dtype(name), (3, 5), seed=i) for i, name in enumerate(DTYPES)}
    return {
        "model": tensors,
        "extra": [random_tensor(torch.float32, (), seed=99), {"empty": torch.empty(0, 4)}],
        "step": 7,
        "optim": {"lr": 1e-3, "betas": (0.9, 0.999), "nan": float("nan"), "names": ["a", "b"], "none": None},
    }


def _zeros_like(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: _zeros_like(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_zeros_like(v) for v in state]
    return None  # a plain value: DCP sets it


def _failure(exc: pytest.ExceptionInfo[CheckpointException]) -> BaseException:
    """The error one rank raised inside DCP (which wraps every rank's error in a CheckpointException)."""
    (error, _tb), *_ = exc.value.failures.values()
    return error


def test_every_dtype_round_trips_through_dcp_and_is_an_ordinary_checkpoint(tmp_path: Path) -> None:
    state = _state()
    path = tmp_path / "ckpt"
    dcp.save(state, storage_writer=ucp.dcp.Writer(path, step=7, metadata={"run": "dcp"}))

    fresh = _zeros_like(state)
    dcp.load(fresh, storage_reader=ucp.dcp.Reader(path))
    assert_same_state(state, fresh)  # every dtype bit-exact (NaN payloads, -0.0), plain values, the nesting

    assert_same_state(state, ucp.load(path))  # ucp.load returns the state dict as given to dcp.save, in order
    report = ucp.verify(path)
    assert report.ok and report.pieces_checked == len(DTYPES) + 2, report.problems
    manifest = ucp.read_manifest(path)
    assert manifest.step == 7 and manifest.metadata == {"run": "dcp"}
    assert sorted(p.name for p in path.iterdir()) == ["manifest.json", "rank-00000.safetensors"]
    with safe_open(str(path / "rank-00000.safetensors"), "pt") as f:  # plain safetensors, no pickle
        assert same_bytes(f.get_tensor("model.BF16"), state["model"]["BF16"])
    assert json.loads((path / "manifest.json").read_text())["state"]["dict"]["optim"]["dict"]["betas"] == {
        "tuple": [0.9, 0.999]
    }  # plain values are JSON in the manifest


def test_two_ranks_save_and_reshard_dtensors_and_read_ucp_save_checkpoints(tmp_path: Path) -> None:
    """DTensors of every dtype, row/column-sharded unevenly and replicated, saved by 2 ranks and loaded
    into other placements; 2-rank ucp.saves (ShardedTensor rows and FlatShard ranges; the DTensors) loaded
    through DCP (checked in the worker); here: the DCP-written checkpoint through ucp.load, ucp.verify, ucp.reshape,
    ucp.export and a one-process dcp.load of both ranks' chunks."""
    outs = run_world(SUPPORT / "ucp_dcp_worker.py", lambda r: [r, 2, tmp_path / "init", tmp_path], 2, timeout=150)
    assert [o.strip().splitlines()[-1] for o in outs] == ["rank 0: OK", "rank 1: OK"]
    full = full_state()
    path = tmp_path / "dcp"
    manifest = ucp.read_manifest(path)
    assert sorted(manifest.files) == ["rank-00000.safetensors", "rank-00001.safetensors"]
    assert manifest.topology.world_size == 2 and manifest.step == 3
    loaded = ucp.load(path)
    assert list(loaded["model"]) == list(full)
    for name, t in full.items():
        assert same_bytes(loaded["model"][name], t), name
    assert same_bytes(loaded["plain"], full["F32"]) and {k: loaded[k] for k in VALUES} == VALUES
    assert same_bytes(loaded["blocks"], BLOCKS)
    blocks = manifest.tensors["blocks"].pieces  # two chunks per rank: two pieces in each rank's file
    assert sorted((p.file, p.box.offsets[0], p.entry) for p in blocks if p.box) == [
        ("rank-00000.safetensors", 0, None),
        ("rank-00000.safetensors", 4, "blocks#1"),
        ("rank-00001.safetensors", 2, None),
        ("rank-00001.safetensors", 6, "blocks#1"),
    ]
    assert ucp.verify(path).ok and ucp.verify(tmp_path / "ucp").ok and ucp.verify(tmp_path / "ucp-dtensors").ok
    ucp.reshape(path, tmp_path / "one", verify=True)  # consolidated: one piece per tensor
    assert all(len(t.pieces) == 1 for t in ucp.read_manifest(tmp_path / "one").tensors.values())
    ucp.export(path, tmp_path / "hf", section="model")
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        assert all(same_bytes(f.get_tensor(n), t) for n, t in full.items())

    into: dict[str, Any] = {"model": {n: torch.zeros_like(t) for n, t in full.items()}, "plain": torch.zeros(SHAPE)}
    dcp.load(into, storage_reader=ucp.dcp.Reader(path))
    for name, t in full.items():
        assert same_bytes(into["model"][name], t), name


def test_ucp_save_checkpoint_loads_through_dcp(tmp_path: Path) -> None:
    """Int-keyed optimizer state, tuples and lists of tensors, and a tensor stored as flat ranges cut mid-row
    (ZeRO-style pieces, which DCP sees as the boxes they are made of)."""
    w = random_tensor(torch.bfloat16, (4, 6), seed=1)
    flat = w.reshape(-1)
    exp_avg = random_tensor(torch.float32, (4, 6), seed=2)
    pair = (random_tensor(torch.int32, (3,), seed=3), random_tensor(torch.int8, (2, 2), seed=4))
    state = {
        "model": {
            "w": ucp.Shards([ucp.FlatShard(flat[:5].clone(), (4, 6), 0), ucp.FlatShard(flat[5:].clone(), (4, 6), 5)])
        },
        "optim": {"state": {0: {"exp_avg": exp_avg}}, "lr": 0.1},
        "pair": pair,
        "step": 11,
    }
    path = tmp_path / "ucp"
    ucp.save(state, path)

    into: dict[str, Any] = {
        "model": {"w": torch.zeros(4, 6, dtype=torch.bfloat16)},
        "optim": {"state": {0: {"exp_avg": torch.zeros(4, 6)}}, "lr": 0.0},
        "pair": [torch.zeros(3, dtype=torch.int32), torch.zeros(2, 2, dtype=torch.int8)],  # DCP walks lists only
        "step": 0,
    }
    dcp.load(into, storage_reader=ucp.dcp.Reader(path))
    assert same_bytes(into["model"]["w"], w)
    assert same_bytes(into["optim"]["state"][0]["exp_avg"], exp_avg)
    assert same_bytes(into["pair"][0], pair[0]) and same_bytes(into["pair"][1], pair[1])
    assert into["optim"]["lr"] == 0.1 and into["step"] == 11

    metadata = ucp.dcp.Reader(path).read_metadata()
    chunks = metadata.state_dict_metadata["model.w"].chunks  # type: ignore[union-attr]
    assert [(list(c.offsets), list(c.sizes)) for c in chunks] == [
        ([0, 0], [1, 5]),
        ([0, 5], [1, 1]),
        ([1, 0], [3, 6]),
    ]
    assert metadata.planner_data["optim.state.0.exp_avg"] == ("optim", "state", "0", "exp_avg")


def test_not_a_checkpoint_and_corrupt_pieces_name_the_file(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(CheckpointException) as exc:
        dcp.load({"w": torch.zeros(2)}, storage_reader=ucp.dcp.Reader(plain))
    assert f"{plain} is not a checkpoint: no manifest.json" in str(_failure(exc))

    path = tmp_path / "ckpt"
    w = random_tensor(torch.float32, (64, 64), seed=5)
    dcp.save({"w": w}, storage_writer=ucp.dcp.Writer(path))
    piece = ucp.read_manifest(path).tensors["w"].pieces[0]
    data = bytearray((path / piece.file).read_bytes())
    data[piece.offset + 100] ^= 0x10
    (path / piece.file).write_bytes(bytes(data))
    with pytest.raises(CheckpointException) as exc:
        dcp.load({"w": torch.zeros(64, 64)}, storage_reader=ucp.dcp.Reader(path))
    error = _failure(exc)
    assert isinstance(error, ucp.CorruptCheckpointError)
    assert "rank-00000.safetensors" in str(error) and "'w'" in str(error) and "CRC-32C mismatch" in str(error)
    twice = tmp_path / "twice"  # two entries DCP would give one key
    ucp.save({"a.b": torch.ones(1), "a": {"b": torch.zeros(1)}}, twice)
    with pytest.raises(CheckpointException) as exc:
        dcp.load({"a.b": torch.zeros(1)}, storage_reader=ucp.dcp.Reader(twice))
    assert f"{twice}/manifest.json: state entries state['a.b'] and state['a']['b'] both have the DCP key 'a.b'" in str(
        _failure(exc)
    )

    unchecked = {"w": torch.zeros(64, 64)}
    dcp.load(unchecked, storage_reader=ucp.dcp.Reader(path, verify=False))  # the caller's choice: bytes as stored
    assert int((unchecked["w"].view(torch.uint8) != w.view(torch.uint8)).sum()) == 1


def test_refused_or_failed_saves_leave_nothing(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    with pytest.raises(CheckpointException) as exc:
        dcp.save({"w": torch.ones(3), "extra": {"blob": io.BytesIO(b"x")}}, storage_writer=ucp.dcp.Writer(path))
    error = _failure(exc)
    assert isinstance(error, ucp.UnsupportedStateError)
    assert "'extra.blob'" in str(error) and "BytesIO" in str(error) and "never as pickles" in str(error)
    assert list(tmp_path.iterdir()) == []  # no checkpoint, no temporary directory

    class Failing(DefaultSavePlanner):  # DCP gives up after the writer made its temporary directory
        def finish_plan(self, new_plan: SavePlan) -> SavePlan:
            raise RuntimeError("planner failed")

    writer = ucp.dcp.Writer(path)
    with pytest.raises(CheckpointException):
        dcp.save({"w": torch.ones(3)}, storage_writer=writer, planner=Failing())
    assert [p.name.split("-")[0] for p in tmp_path.iterdir()] == [".ckpt.tmp"]  # DCP told the writer nothing
    dcp.save({"w": torch.ones(3)}, storage_writer=writer)  # its next save removes it
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    with pytest.raises(CheckpointException):
        dcp.save({"w": torch.ones(3)}, storage_writer=writer, planner=Failing())
    assert sorted(p.name.split("-")[0] for p in tmp_path.iterdir()) == [".ckpt.tmp", "ckpt"]
    del writer
    gc.collect()  # ... and so does releasing the writer; the committed checkpoint stays
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"] and ucp.verify(path).ok
    shutil.rmtree(path)

    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "data.bin").write_bytes(b"user data")
    with warnings.catch_warnings(), pytest.raises(CheckpointException) as exc:
        dcp.save({"w": torch.ones(3)}, storage_writer=ucp.dcp.Writer(taken))
    assert isinstance(_failure(exc), ucp.DestinationError) and "not a checkpoint" in str(_failure(exc))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"] and (taken / "data.bin").read_bytes() == b"user data"
