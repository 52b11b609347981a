"""PyTorch Distributed Checkpoint folders (torch.distributed.checkpoint.save) imported into UCP.

Single-process saves of nested state dicts (tensors of several dtypes, plain values), a 2-rank save
of DTensors sharded by rows (chunks become boxes), and the pickle allow-list on ``.metadata``.
This file is also the 2-rank worker: ``python test_import_dcp.py RANK WORLD INIT OUT``.
"""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from dcp_save_worker import FULL
from repo_paths import SUPPORT
from world import run_world

import ucp
from ucp.conversion.importers import UnsafePickleError, convert, detect
from ucp.conversion.importers.dcp import read_metadata


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    return {
        "model": {
            "embed.weight": torch.randn(10, 4, generator=g),
            "ln.bias": torch.randn(4, generator=g).bfloat16(),
            "ids": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        },
        "optimizer": {"state": {"lr": 0.5, "betas": [0.9, 0.99]}, "count": torch.tensor(3, dtype=torch.int32)},
        "step": 12,
        "name": "run-a",
    }


def _dcp_save(state: dict[str, Any], path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group": a single-process save is intended here
        dcp.save(state, checkpoint_id=str(path))


def test_single_process_save_round_trips(tmp_path: Path) -> None:
    state = _state()
    _dcp_save(state, tmp_path / "dcp")
    assert detect(tmp_path / "dcp") == "dcp"
    report = convert(tmp_path / "dcp", tmp_path / "ucp")
    assert report.format == "dcp" and report.step == 12 and report.tensors == 4
    got = ucp.load(tmp_path / "ucp")
    assert set(got) == set(state) and got["step"] == 12 and got["name"] == "run-a"
    for name, want in state["model"].items():  # DCP's nesting comes back, keys with dots kept whole
        assert got["model"][name].dtype == want.dtype and torch.equal(got["model"][name], want), name
    assert got["optimizer"]["state"] == {"lr": 0.5, "betas": [0.9, 0.99]}
    assert torch.equal(got["optimizer"]["count"], state["optimizer"]["count"])
    names = set(ucp.read_manifest(tmp_path / "ucp").tensors)
    assert "model.embed.weight" in names and ucp.read_manifest(tmp_path / "ucp").metadata["source"]["format"] == "dcp"


class Gadget:
    """Not on any allow-list: a .metadata naming it must be refused without --trust-pickle."""


def _poison_metadata(folder: Path, extra: Any) -> None:
    meta = read_metadata(folder)
    meta.planner_data = {**meta.planner_data, "__extra__": extra}
    with open(folder / ".metadata", "wb") as fh:
        pickle.dump(meta, fh)


def test_metadata_with_unknown_class_is_refused(tmp_path: Path) -> None:
    _dcp_save(_state(), tmp_path / "dcp")
    _poison_metadata(tmp_path / "dcp", Gadget())
    with pytest.raises(UnsafePickleError) as info:
        convert(tmp_path / "dcp", tmp_path / "ucp")
    msg = str(info.value)
    assert "Gadget" in msg and ".metadata" in msg and "--trust-pickle" in msg
    assert not (tmp_path / "ucp").exists()


def test_trust_pickle_allows_a_full_unpickle(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import datetime

    state = _state()
    _dcp_save(state, tmp_path / "dcp")
    _poison_metadata(tmp_path / "dcp", datetime.date(2025, 1, 2))  # harmless, but not allow-listed
    with pytest.raises(UnsafePickleError, match="datetime.date"):
        convert(tmp_path / "dcp", tmp_path / "ucp")
    with caplog.at_level("WARNING"):
        convert(tmp_path / "dcp", tmp_path / "ucp", trust_pickle=True)
    assert "full unpickle" in caplog.text
    assert torch.equal(ucp.load(tmp_path / "ucp")["model"]["embed.weight"], state["model"]["embed.weight"])


def test_missing_data_file_names_it(tmp_path: Path) -> None:
    _dcp_save(_state(), tmp_path / "dcp")
    data = next((tmp_path / "dcp").glob("*.distcp"))
    data.unlink()
    with pytest.raises(ucp.CheckpointError, match=data.name):
        convert(tmp_path / "dcp", tmp_path / "ucp")


# -- a 2-rank save of row-sharded DTensors ---------------------------------------------------------


def test_two_rank_sharded_save(tmp_path: Path) -> None:
    out = tmp_path / "dcp"
    run_world(SUPPORT / "dcp_save_worker.py", lambda r: ["rows", r, 2, tmp_path / "init", out], 2, timeout=120)
    convert(out, tmp_path / "ucp")
    manifest = ucp.read_manifest(tmp_path / "ucp")
    pieces = manifest.tensors["model.w"].pieces
    assert all(p.box is not None for p in pieces)
    boxes = sorted(tuple(p.box.offsets) for p in pieces if p.box is not None)
    assert boxes == [(0, 0), (4, 0)]  # one piece per rank's chunk, no concatenation
    got = ucp.load(tmp_path / "ucp")
    assert torch.equal(got["model"]["w"], FULL) and torch.equal(got["model"]["b"], torch.ones(3)) and got["step"] == 5
