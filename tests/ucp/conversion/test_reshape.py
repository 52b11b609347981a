"""``ucp.conversion.reshape`` and ``ucp reshape``: any layout to any other (or consolidated), bit-exact, streaming.

Sources are checkpoints of the training engine in this process (one rank; the engine records its
layout), reshaped to TP/PP/DP/ZeRO targets and back. Engine-level resumes from reshaped
checkpoints across real processes are in tests/training/test_training_resume.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import training_helpers
from typer.testing import CliRunner
from ucp_helpers import flat

import ucp
from reshard import Layout, LayoutError, Mesh
from training import Engine
from training.models.gpt import GPTConfig
from ucp.cli.main import app
from ucp.conversion.placement import place, recorded_layout
from ucp.conversion.reshape import _batches, reshape
from ucp.format.manifest import Manifest

# GQA + SwiGLU + tied embeddings + a vocabulary padded under tp (the training tests' GQA with 8 heads and
# 4 kv heads); and a plain MLP with an odd d_ff.
GQA = GPTConfig(**{**training_helpers.GQA, "n_head": 8, "n_kv_head": 4})
PLAIN = GPTConfig(**training_helpers.PLAIN)


def _layout(manifest: Manifest) -> Layout:
    """The layout ``manifest`` records (every source here is saved with one)."""
    layout = recorded_layout(manifest).layout
    assert layout is not None, "the checkpoint records no layout"
    return layout


def _shapes(manifest: Manifest) -> dict[str, tuple[int, ...]]:
    """The parameter shapes ``manifest`` records with its layout."""
    shapes = recorded_layout(manifest).shapes
    assert shapes is not None, "the checkpoint records no parameter shapes"
    return shapes


def make_source(root: Path, cfg: GPTConfig, **options: Any) -> str:
    e = Engine(
        cfg, zero_stage=options.pop("zero_stage", 1), micro_batch=2, seq_len=16, lr=1e-2, pad_vocab_to=8, **options
    )
    e.train_step()
    e.train_step()
    manager = ucp.CheckpointManager(root)
    e.save(manager)
    return manager.path(2)


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("reshape-src")
    return {
        "gqa": make_source(base / "gqa", GQA),
        "plain": make_source(base / "plain", PLAIN, zero_stage=3, zero_alignment=4),
    }


TARGETS = [  # (tp, pp, dp, zero)
    (2, 1, 1, 0),
    (2, 1, 2, 1),
    (1, 2, 2, 1),
    (2, 2, 1, 0),
    (1, 1, 4, 3),
    (4, 1, 1, 2),
    (2, 1, 2, 3),
    (1, 1, 2, 2),
]


@pytest.mark.parametrize("model", ["gqa", "plain"])
@pytest.mark.parametrize("tp,pp,dp,zero", TARGETS)
def test_reshape_is_bit_exact_and_one_file_per_rank(
    sources: dict[str, str], tmp_path: Path, model: str, tp: int, pp: int, dp: int, zero: int
) -> None:
    src = sources[model]
    before = flat(ucp.load(src))
    base = _layout(ucp.read_manifest(src))
    target = base.replace(mesh=Mesh(tp=tp, pp=pp, dp=dp), zero=base.zero.model_copy(update={"stage": zero}))
    report = reshape(src, tmp_path / "dst", layout=target, memory_budget=1 << 20)  # many small batches
    manifest = ucp.read_manifest(tmp_path / "dst")
    assert report.world_size == tp * pp * dp and manifest.topology.mesh == {"tp": tp, "pp": pp, "dp": dp}
    assert_same(before, flat(ucp.load(tmp_path / "dst")))
    assert not ucp.verify(tmp_path / "dst").problems
    # every region a target rank saves is in its own file, so it reads one file
    assert _layout(manifest) == target
    for rank, mine in enumerate(place(manifest, target, _shapes(manifest)).ranks):
        for p in mine:
            [piece] = [q for q in manifest.tensors[p.tensor].pieces if q.region() == p.region]
            assert piece.file == f"rank-{rank:05d}.safetensors"
    # and back, consolidated: one piece per tensor in one file
    reshape(tmp_path / "dst", tmp_path / "back")
    back = ucp.read_manifest(tmp_path / "back")
    assert len(back.files) == 1 and all(len(t.pieces) == 1 for t in back.tensors.values())
    assert back.topology.world_size == 1 and back.metadata["consolidated"] is True
    assert_same(before, flat(ucp.load(tmp_path / "back")))


def test_reshaped_checkpoint_loads_into_an_engine(sources: dict[str, str], tmp_path: Path) -> None:
    """A consolidated checkpoint resumes an engine exactly like the original (same next loss)."""
    src = sources["gqa"]
    reshape(src, tmp_path / "cons")
    losses = []
    for path in (src, tmp_path / "cons"):
        e = Engine(GQA, zero_stage=3, micro_batch=2, seq_len=16, lr=1e-2, pad_vocab_to=8)
        assert e.load(path) == 2
        losses.append(e.train_step())
    assert losses[0] == losses[1]


def test_batches_respect_the_memory_budget(sources: dict[str, str], tmp_path: Path) -> None:
    from ucp.conversion.reshape import _targets
    from ucp.saving.plan import make_plan

    manifest = ucp.read_manifest(sources["plain"])
    [layouts], _, _ = _targets(manifest, None, None, None, sources["plain"])
    plan = make_plan(layouts, 0, 1)
    budget = 8 << 10  # smaller than the largest pieces: those are cut into parts
    batches = _batches(plan, budget)
    chunks = [c for b in batches for c in b]
    assert any(not c.whole for c in chunks)
    for i, piece in enumerate(plan.pieces):  # each piece's parts, in order, tile its bytes
        mine = [c for c in chunks if c.index == i]
        assert all(c.piece == piece for c in mine)
        assert [c.at for c in mine] == [sum(c.length for c in mine[:k]) for k in range(len(mine))]
        assert sum(c.length for c in mine) == piece.length
    assert [c.index for c in chunks] == sorted(c.index for c in chunks)
    for b in batches:
        assert sum(c.slot for c in b) <= budget


def test_each_source_piece_is_checked_once_and_corruption_is_caught(sources: dict[str, str], tmp_path: Path) -> None:
    import shutil

    src = tmp_path / "src"
    shutil.copytree(sources["gqa"], src)
    manifest = ucp.read_manifest(src)
    name, entry = max(manifest.tensors.items(), key=lambda kv: kv[1].nbytes)
    piece = entry.pieces[0]
    with open(src / piece.file, "r+b") as f:
        f.seek(piece.offset + piece.length // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x10]))
    base = _layout(manifest)
    with pytest.raises(ucp.CorruptCheckpointError, match=name.replace(".", r"\.")):
        reshape(src, tmp_path / "dst", layout=base.replace(mesh=Mesh(tp=2)))
    assert not (tmp_path / "dst").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".dst")] == []  # temp dir removed


def test_refuses_to_overwrite_unless_asked(sources: dict[str, str], tmp_path: Path) -> None:
    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / "notes.txt").write_text("mine")
    with pytest.raises(ucp.CheckpointError, match="already exists"):
        reshape(sources["gqa"], tmp_path / "dst")
    with pytest.raises(ucp.CheckpointError, match="not a checkpoint"):
        reshape(sources["gqa"], tmp_path / "dst", overwrite=True)
    assert (tmp_path / "dst" / "notes.txt").read_text() == "mine"
    reshape(sources["gqa"], tmp_path / "ok")
    reshape(sources["gqa"], tmp_path / "ok", overwrite=True)
    assert not ucp.verify(tmp_path / "ok").problems


def test_layout_that_does_not_fit_names_the_tensor(sources: dict[str, str], tmp_path: Path) -> None:
    base = _layout(ucp.read_manifest(sources["gqa"]))
    with pytest.raises(LayoutError, match="attn.qkv.weight"):
        reshape(sources["gqa"], tmp_path / "dst", layout=base.replace(mesh=Mesh(tp=3)))
    with pytest.raises(LayoutError, match="pp=4|4 stages|layers"):
        reshape(sources["gqa"], tmp_path / "dst", layout=base.replace(mesh=Mesh(pp=4)))
    with pytest.raises(ucp.LayoutMismatchError, match="layers.0.attn.qkv.weight"):
        reshape(
            sources["gqa"],
            tmp_path / "dst",
            layout=base,
            shapes={**_shapes(ucp.read_manifest(sources["gqa"])), "layers.0.attn.qkv.weight": (7, 32)},
        )
    assert not (tmp_path / "dst").exists()


# -- the command line ---------------------------------------------------------------------------


def test_cli_reshape_json_and_verify(sources: dict[str, str], tmp_path: Path) -> None:
    runner = CliRunner()
    res = runner.invoke(
        app,
        [
            "reshape",
            sources["gqa"],
            str(tmp_path / "a"),
            "--tp",
            "2",
            "--dp",
            "2",
            "--zero",
            "3",
            "--memory-budget",
            "2MiB",
            "--verify",
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["mesh"] == {"tp": 2, "pp": 1, "dp": 2} and doc["zero_stage"] == 3 and doc["verified"] is True
    assert doc["files"] == 4 and doc["peak_rss_bytes"] > 0
    res = runner.invoke(app, ["reshape", str(tmp_path / "a"), str(tmp_path / "b")])
    assert res.exit_code == 0, res.output
    assert "consolidated" in res.stdout
    assert_same(flat(ucp.load(sources["gqa"])), flat(ucp.load(tmp_path / "b")))


def test_cli_layout_file_and_model_preset(sources: dict[str, str], tmp_path: Path) -> None:
    runner = CliRunner()
    base = _layout(ucp.read_manifest(sources["gqa"]))
    base.replace(mesh=Mesh(pp=2)).dump(tmp_path / "layout.json")
    res = runner.invoke(
        app,
        [
            "reshape",
            sources["gqa"],
            str(tmp_path / "a"),
            "--layout",
            str(tmp_path / "layout.json"),
            "--dp",
            "2",
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["mesh"] == {"tp": 1, "pp": 2, "dp": 2}
    # a checkpoint without a recorded layout (consolidated copy, metadata stripped) needs one
    plain = ucp.load(tmp_path / "a")
    ucp.save(plain, tmp_path / "bare")
    res = runner.invoke(app, ["reshape", str(tmp_path / "bare"), str(tmp_path / "c"), "--tp", "2"])
    assert res.exit_code == 2 and "records no layout" in res.output
    res = runner.invoke(app, ["reshape", str(tmp_path / "bare"), str(tmp_path / "c"), "--tp", "2", "--model", "nope"])
    assert res.exit_code == 2 and "not a preset" in res.output


@pytest.mark.parametrize(
    "args,message",
    [
        (["--tp", "3"], "not divisible by tp=3"),
        (["--memory-budget", "lots"], "cannot read 'lots' as a size"),
        (["--dp", "0"], "greater than or equal to 1"),
    ],
)
def test_cli_bad_targets(sources: dict[str, str], tmp_path: Path, args: list[str], message: str) -> None:
    res = CliRunner().invoke(app, ["reshape", sources["gqa"], str(tmp_path / "x"), *args])
    assert res.exit_code == 2 and message in res.output, res.output
    assert not (tmp_path / "x").exists()


def test_cli_missing_source(tmp_path: Path) -> None:
    res = CliRunner().invoke(app, ["reshape", str(tmp_path / "nothing"), str(tmp_path / "x"), "--tp", "2"])
    assert res.exit_code == 2 and "nothing" in res.output


def test_consolidates_any_checkpoint(tmp_path: Path) -> None:
    """No layout needed to consolidate: plain state dicts, every kind of tensor and plain values."""
    sd = {
        "a": torch.tensor(3.5),
        "e": torch.empty(0, 5),
        "b": torch.tensor([True, False]),
        "bf": torch.randn(300, 7).to(torch.bfloat16),
        "big": torch.randn(512, 1024),
        "x": {"y": 3, "z": [1, 2.5, None]},
    }
    ucp.save(sd, tmp_path / "src", step=7)
    reshape(tmp_path / "src", tmp_path / "dst", memory_budget=1 << 20)
    assert ucp.read_manifest(tmp_path / "dst").step == 7
    assert_same(flat(sd), flat(ucp.load(tmp_path / "dst")))


def test_each_source_piece_is_verified_once_even_with_parallel_reads(
    sources: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ucp.loading.partial as partial

    checked: list[tuple[str, int]] = []
    real = partial.check_crc

    def counting(fp, file, data):
        checked.append((file, fp.piece.offset))
        return real(fp, file, data)

    monkeypatch.setattr(partial, "check_crc", counting)
    src = sources["plain"]
    manifest = ucp.read_manifest(src)
    base = _layout(manifest)
    target = base.replace(mesh=Mesh(tp=2, dp=2), zero=base.zero.model_copy(update={"stage": 1}))
    reshape(src, tmp_path / "dst", layout=target, memory_budget=1 << 20, workers=2)  # many small batches in parallel
    pieces = sum(len(t.pieces) for t in manifest.tensors.values())
    assert len(checked) == len(set(checked)) == pieces
