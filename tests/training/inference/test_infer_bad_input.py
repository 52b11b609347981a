"""Bad weights, configs, budgets and tokenizers fail before any compute, naming the file, tensor or layer."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from inference_models import save_hf, save_ucp, tiny_llama
from safetensors.torch import save_file

from training.inference.api import infer
from training.inference.config import load_model
from training.inference.errors import BudgetError, InferenceError, ModelConfigError, TokenizerError, WeightSourceError
from training.inference.executor import Executor
from training.inference.sources import open_weights

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf() -> object:
    return tiny_llama()


def test_missing_shard_names_it(hf: object, tmp_path: Path) -> None:
    path = save_hf(hf, tmp_path / "hf", max_shard_size="100KB")
    shard = sorted(path.glob("*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(
        WeightSourceError, match=rf"{shard.name}: shard named in .*model.safetensors.index.json is missing"
    ):
        open_weights(path)


def test_index_naming_a_tensor_its_shard_lacks(hf: object, tmp_path: Path) -> None:
    path = save_hf(hf, tmp_path / "hf", max_shard_size="100KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["model.norm.weight"]
    index["weight_map"]["model.extra.weight"] = shard
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(
        WeightSourceError, match=r"maps \['model.extra.weight'\] to this shard, whose header lacks them"
    ):
        open_weights(path)


def test_header_offsets_past_the_end_of_the_file(tmp_path: Path) -> None:
    f = tmp_path / "model.safetensors"
    save_file({"a": torch.zeros(4, 4), "b": torch.ones(1000)}, str(f))
    os.truncate(f, f.stat().st_size - 100)  # the header still claims b's 4000 bytes
    with pytest.raises(
        WeightSourceError, match=r"tensor 'b': header places it at bytes \[\d+, \d+\), past the end of the file"
    ):
        open_weights(tmp_path)


def test_header_length_past_the_end_of_the_file(tmp_path: Path) -> None:
    f = tmp_path / "model.safetensors"
    f.write_bytes(struct.pack("<Q", 1 << 20) + b"{}")
    with pytest.raises(
        WeightSourceError, match=r"model.safetensors: header length 1048576 runs past the end of the file"
    ):
        open_weights(tmp_path)


def test_header_size_disagreeing_with_shape(tmp_path: Path) -> None:
    header = json.dumps({"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 32]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(64))
    with pytest.raises(
        WeightSourceError, match=r"tensor 'w': header gives 32 bytes for shape \[4, 4\] of F32, which needs 64"
    ):
        open_weights(tmp_path)


def test_shape_not_matching_the_config(hf: object, tmp_path: Path) -> None:
    path = save_hf(hf, tmp_path / "hf")
    cfg = json.loads((path / "config.json").read_text())
    cfg["intermediate_size"] = 80
    (path / "config.json").write_text(json.dumps(cfg))
    model, source = load_model(open_weights(path))
    with pytest.raises(
        ModelConfigError,
        match=r"model.safetensors: tensor 'model.layers.0.mlp.gate_proj.weight' has shape \[96, 64\], the model config implies \[80, 64\]",
    ):
        Executor(model, source, 1 << 20)


def test_missing_config(hf: object, tmp_path: Path) -> None:
    path = save_hf(hf, tmp_path / "hf")
    (path / "config.json").unlink()
    with pytest.raises(ModelConfigError, match="no model config"):
        load_model(open_weights(path))


def test_budget_below_the_largest_part_names_it_and_the_budget_needed(hf: object, tmp_path: Path) -> None:
    path = save_hf(hf, tmp_path / "hf")
    model, source = load_model(open_weights(path))
    with pytest.raises(BudgetError) as err:  # the tensor grain: everything streams, one part at a time
        Executor(model, source, 30_000)
    msg = str(err.value)
    assert "memory budget 29.3 KiB is too small" in msg, msg
    assert "final norm and head needs a buffer of 40 KiB (largest tensor 'lm_head.weight', 32 KiB)" in msg, msg
    needed = int(msg.rsplit("(", 1)[1].split(" bytes")[0])
    Executor(model, source, needed).close()  # exactly the budget named suffices
    with pytest.raises(BudgetError):
        Executor(model, source, needed - 1)
    with pytest.raises(BudgetError) as err:  # the layer grain (device paths): a whole layer's buffer
        Executor(model, source, 50_000, read_path="staged")
    assert "layer 2 needs a buffer of 128 KiB (largest tensor 'model.layers.2.mlp.down_proj.weight', 24 KiB)" in str(
        err.value
    )


def test_unreadable_tokenizer(hf: object, tmp_path: Path) -> None:
    path = save_hf(hf, tmp_path / "hf")
    (path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match=r"tokenizer.json: unreadable tokenizer"):
        infer(path, ["hello"], max_new_tokens=1, memory_budget=1 << 20)


def test_text_prompt_without_tokenizer_and_ids_outside_the_vocabulary(hf: object, tmp_path: Path) -> None:
    path = save_hf(hf, tmp_path / "hf")
    with pytest.raises(TokenizerError, match="no tokenizer.json, so prompts are token ids"):
        infer(path, ["hello"], max_new_tokens=1, memory_budget=1 << 20)
    with pytest.raises(InferenceError, match=r"prompt 0: token id 500 outside the vocabulary \[0, 128\)"):
        infer(path, ["1 2 500"], max_new_tokens=1, memory_budget=1 << 20)


def test_ucp_checkpoint_with_a_missing_or_truncated_data_file(hf: object, tmp_path: Path) -> None:
    path = save_ucp(hf, tmp_path / "ckpt")
    data = next(p for p in path.iterdir() if p.suffix == ".safetensors")
    os.truncate(data, data.stat().st_size - 10)
    with pytest.raises(WeightSourceError, match=rf"{data.name}.*truncated"):
        open_weights(path)
    data.unlink()
    with pytest.raises(WeightSourceError, match=rf"{data.name}.*missing"):
        open_weights(path)


def test_missing_tensor_and_unsupported_config(hf: object, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    path = save_hf(hf, tmp_path / "hf")
    sd = load_file(str(path / "model.safetensors"))
    del sd["lm_head.weight"]
    save_file(sd, str(path / "model.safetensors"))
    model, source = load_model(open_weights(path))
    with pytest.raises(
        ModelConfigError, match=r"tensor 'lm_head.weight' \(shape \[128, 64\]\) is missing from the weights"
    ):
        Executor(model, source, 1 << 20)
    cfg = json.loads((path / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ModelConfigError,
        match=r"config.json: not a usable Llama config: Value error, rope_scaling .* is not supported \(only default RoPE\)$",
    ):
        load_model(open_weights(path))
    cfg["model_type"] = "mistral"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError, match=r"config.json: model_type 'mistral' is not supported"):
        load_model(open_weights(path))


def test_ucp_checkpoint_without_a_model_config(tmp_path: Path) -> None:
    import ucp

    ucp.save({"w": torch.zeros(4)}, tmp_path / "ckpt")
    with pytest.raises(ModelConfigError, match=r"ckpt: no model config: expected config.json, or a UCP checkpoint"):
        load_model(open_weights(tmp_path / "ckpt"))
