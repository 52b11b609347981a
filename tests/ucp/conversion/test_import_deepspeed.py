"""DeepSpeed ZeRO-1/2/3 checkpoints (written by DeepSpeed 0.19.8 itself, tools/peers) imported into UCP.

Bit-exact against DeepSpeed's own readings of the same files: fp32 masters against ``zero_to_fp32``,
masters and Adam moments against ``ds_to_universal``'s per-parameter files, weights against the
saved ``module``. The universal import must equal the native one, and the training Engine must
resume the import at another mesh and ZeRO stage: it re-saves exactly the imported tensors.

This file is also the Engine worker: ``python test_import_deepspeed.py RANK WORLD INIT SPEC``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from repo_paths import SUPPORT  # noqa: E402
from world import run_world  # noqa: E402

import ucp  # noqa: E402
from tools.peers.deepspeed_ckpt import deepspeed_missing, make_checkpoint, reference_fp32, reference_universal  # noqa: E402
from ucp.conversion.importers import convert, detect, read  # noqa: E402

MISSING = deepspeed_missing()
needs_ds = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# (zero stage, dtype, world): the CI subset covers every stage, both dtypes, both world sizes, and
# reuses checkpoints the peer cache already holds; the rest of the cross-product is full_matrix.
CI = [(1, "bf16", 2), (2, "fp32", 2), (3, "fp32", 2), (3, "bf16", 4)]
FULL = [(s, d, w) for s in (1, 2, 3) for d in ("fp32", "bf16") for w in (2, 4) if (s, d, w) not in CI]
# Alignment padding between parameters, and round-robin reordering of the flat buffer (ZeRO-1/2).
VARIANTS = {
    "align": {"zero_optimization": {"parameter_alignment": True}},
    "align-rr": {"zero_optimization": {"parameter_alignment": True, "round_robin_gradients": True}},
}
PADDED = [(2, "bf16", 4, "align"), (2, "fp32", 4, "align-rr")]
CONFIGS = (
    [pytest.param(c, id=f"z{c[0]}-{c[1]}-w{c[2]}") for c in CI]
    + [pytest.param(c, id=f"z{c[0]}-{c[1]}-w{c[2]}-{c[3]}") for c in PADDED]
    + [pytest.param(c, id=f"z{c[0]}-{c[1]}-w{c[2]}", marks=pytest.mark.full_matrix) for c in FULL]
)


class Imports:
    """DeepSpeed checkpoints and their UCP imports, made once per test session."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.done: dict[tuple, dict[str, Any]] = {}

    def get(self, config: tuple) -> dict[str, Any]:
        if config not in self.done:
            stage, dtype, world, *variant = config
            ckpt = make_checkpoint(
                world_size=world,
                zero_stage=stage,
                dtype=dtype,
                steps=3,
                ds_config=VARIANTS[variant[0]] if variant else None,
            )
            dst = self.root / "-".join(str(c) for c in config)
            report = convert(ckpt, dst)
            self.done[config] = {"ckpt": ckpt, "dst": dst, "report": report, "state": ucp.load(dst)}
        return self.done[config]


@pytest.fixture(scope="module")
def imports(tmp_path_factory: pytest.TempPathFactory) -> Imports:
    return Imports(tmp_path_factory.mktemp("ds-import"))


def _native(ckpt: Path, name: str) -> dict[str, Any]:
    """A model-states file of the checkpoint, loaded the way DeepSpeed's own tools do (weights only)."""
    from ucp.conversion.importers.pickles import load_torch

    tag = (ckpt / "latest").read_text().strip()
    return load_torch(ckpt / tag / name)


@needs_ds
@pytest.mark.parametrize("config", CONFIGS)
def test_masters_equal_zero_to_fp32(imports: Imports, config: tuple) -> None:
    got = imports.get(config)
    masters = got["state"]["optimizer"]["fp32_master"]
    ref = reference_fp32(got["ckpt"])
    assert sorted(masters) == sorted(ref)
    for name, want in ref.items():
        assert masters[name].dtype == torch.float32 and torch.equal(masters[name], want), name


@needs_ds
@pytest.mark.parametrize("config", CONFIGS)
def test_states_equal_ds_to_universal(imports: Imports, config: tuple) -> None:
    got = imports.get(config)
    udir = reference_universal(got["ckpt"])
    optim = got["state"]["optimizer"]
    for name, master in optim["fp32_master"].items():
        for ours, theirs in (("fp32_master", "fp32"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
            value = torch.load(udir / "zero" / name / f"{theirs}.pt", weights_only=True)
            value = value["param"] if isinstance(value, dict) else value
            assert torch.equal(optim[ours][name], value.reshape(master.shape)), (ours, name)
    assert optim["adam_step"] == 3 and got["state"]["step"] == 3


@needs_ds
@pytest.mark.parametrize("config", CONFIGS)
def test_weights_are_the_training_dtype_module(imports: Imports, config: tuple) -> None:
    stage, dtype, world, *_ = config
    got = imports.get(config)
    model = got["state"]["model"]
    if stage < 3:
        module = _native(got["ckpt"], "mp_rank_00_model_states.pt")["module"]
        assert list(model) == list(module)
        for name, want in module.items():
            assert model[name].dtype == want.dtype and torch.equal(model[name], want), name
    else:  # ZeRO-3 saves placeholders; DeepSpeed's weights are the masters in the training dtype
        ref = reference_fp32(got["ckpt"])
        for name, want in ref.items():
            assert model[name].dtype == DTYPES[dtype] and torch.equal(model[name], want.to(DTYPES[dtype])), name


@needs_ds
@pytest.mark.parametrize("config", CONFIGS)
def test_structure_and_metadata(imports: Imports, config: tuple) -> None:
    stage, dtype, world, *_ = config
    got = imports.get(config)
    state, report = got["state"], got["report"]
    assert set(state) == {"model", "optimizer", "step", "scheduler", "rng"}
    assert state["optimizer"]["hparams"] == {
        "kind": "adamw",
        "lr": 1e-3,
        "betas": [0.9, 0.95],
        "eps": 1e-8,
        "weight_decay": 0.01,
    }
    assert state["optimizer"]["loss_scale"] is None
    assert state["scheduler"] == {"kind": "constant", "last_step": 3} and state["rng"] == {"data_seed": 1234}
    manifest = ucp.read_manifest(got["dst"])
    src = manifest.metadata["source"]
    assert (src["format"], src["zero_stage"], src["dp_world_size"], src["dtype"], src["ds_version"]) == (
        "deepspeed",
        stage,
        world,
        dtype,
        "0.19.8",
    )
    assert manifest.step == 3 and report.format == "deepspeed" and report.tensors == len(manifest.tensors) == 160
    assert ucp.verify(got["dst"]).ok


@needs_ds
@pytest.mark.parametrize("config", CONFIGS)
def test_universal_import_equals_native_import(imports: Imports, config: tuple, tmp_path: Path) -> None:
    got = imports.get(config)
    udir = reference_universal(got["ckpt"])
    assert detect(udir) == "deepspeed-universal" and detect(got["ckpt"]) == "deepspeed"
    report = convert(udir, tmp_path / "u")
    assert report.format == "deepspeed-universal"
    _assert_same(ucp.load(tmp_path / "u"), got["state"])


def _assert_same(a: Any, b: Any, path: str = "", *, ordered: bool = True) -> None:
    if isinstance(a, dict):
        keys_a, keys_b = (list(a), list(b)) if ordered else (sorted(a), sorted(b))
        assert isinstance(b, dict) and keys_a == keys_b, (path, keys_a, keys_b)
        for k in a:
            _assert_same(a[k], b[k], f"{path}.{k}", ordered=ordered)
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), path
    else:
        assert a == b, (path, a, b)


@needs_ds
def test_tag_folder_imports_like_the_root(imports: Imports, tmp_path: Path) -> None:
    got = imports.get((3, "fp32", 2))
    tag = got["ckpt"] / (got["ckpt"] / "latest").read_text().strip()
    assert detect(tag) == "deepspeed"
    convert(tag, tmp_path / "tag", source_format="deepspeed")
    _assert_same(ucp.load(tmp_path / "tag"), got["state"])


def test_parameter_straddling_partitions_is_copied_whole_or_kept_as_flat_pieces(
    imports: Imports, tmp_path: Path
) -> None:
    """No concatenation in memory: ``convert`` copies a parameter cut by a partition boundary byte range
    by byte range into one consolidated piece; read into torch tensors it stays two flat views (two pieces)."""
    if MISSING:
        pytest.skip(MISSING)
    got = imports.get((2, "fp32", 2))
    converted = ucp.read_manifest(got["dst"])
    assert converted.topology.world_size == 1 and all(len(t.pieces) == 1 for t in converted.tensors.values())
    _, imported = read(got["ckpt"])  # torch tensors: views of the memory-mapped partitions
    ucp.save(imported.state, tmp_path / "views", step=imported.step, metadata=imported.metadata)
    pieces = ucp.read_manifest(tmp_path / "views").tensors
    split = [n for n, t in pieces.items() if n.startswith("optimizer.fp32_master.") and len(t.pieces) == 2]
    assert split and all(p.flat is not None for p in pieces[split[0]].pieces)
    _assert_same(ucp.load(tmp_path / "views"), got["state"])


# -- resuming the import in the training Engine at other meshes (2 gloo processes) ---------------------

ENGINE_CASES = [  # (DeepSpeed config, Engine mesh, Engine ZeRO stage)
    ((2, "fp32", 2), {"tp": 2}, 1),
    ((1, "bf16", 2), {"dp": 2}, 3),
]


@needs_ds
def test_engine_resumes_import_at_other_meshes(imports: Imports, tmp_path: Path) -> None:
    cases: list[dict[str, Any]] = []
    for config, mesh, zero in ENGINE_CASES:
        got = imports.get(config)
        cases.append(
            {
                "src": str(got["dst"]),
                "out": str(tmp_path / f"resaved-{len(cases)}"),
                "mesh": mesh,
                "zero_stage": zero,
                "dtype": config[1],
            }
        )
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(cases))
    run_world(SUPPORT / "engine_resume_worker.py", lambda r: [r, 2, tmp_path / "init", spec], 2, timeout=180)
    for (config, _, _), case in zip(ENGINE_CASES, cases):
        imported, resaved = imports.get(config)["state"], ucp.load(case["out"])
        assert resaved["step"] == 3
        for section in ("fp32_master", "exp_avg", "exp_avg_sq"):
            _assert_same(resaved["optimizer"][section], imported["optimizer"][section], section, ordered=False)
        _assert_same(resaved["model"], imported["model"], "model", ordered=False)
