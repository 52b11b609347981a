"""Hugging Face round trip: a ``save_pretrained`` folder -> ``ucp convert`` -> training under the runtime
(``training.initialize`` with a DeepSpeed config) -> ``ucp export --format hf`` -> ``from_pretrained`` gives
the trained weights' logits; the export writes config.json (from the checkpoint's metadata or --config,
checked against the tensor shapes first), shards with their index, and the tokenizer files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file
from typer.testing import CliRunner

import training
import ucp
from ucp.cli.main import app

VOCAB = 64


def tiny_llama(seed: int = 0) -> transformers.LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    return transformers.LlamaForCausalLM(cfg).eval()


def save_tokenizer(folder: Path) -> None:
    """A word-level tokenizer over the vocabulary, saved as transformers saves one."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(VOCAB - 1)} | {"<unk>": VOCAB - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(folder)


def cli(*args: str) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result.output


def test_save_pretrained_convert_train_export_from_pretrained(tmp_path: Path) -> None:
    src, ckpt, trained, out = tmp_path / "src", tmp_path / "ckpt", tmp_path / "trained", tmp_path / "hf"
    tiny_llama().save_pretrained(src)
    save_tokenizer(src)
    cli("convert", str(src), str(ckpt))
    recorded = ucp.read_manifest(ckpt).metadata
    assert recorded["hf_config"] == json.loads((src / "config.json").read_text())
    assert recorded["hf_tokenizer"]["files"] == ["tokenizer.json", "tokenizer_config.json"]

    # train under the runtime from the converted checkpoint (other initial weights: all replaced)
    ds = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 2},
    }
    engine = training.initialize(tiny_llama(seed=5), config=ds)
    engine.load(ckpt, load_module_only=True)
    gen = torch.Generator().manual_seed(1)
    batch = torch.randint(0, VOCAB, (4, 16), generator=gen)
    losses = []
    for _ in range(3):
        loss = engine(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    assert losses[2] < losses[1] < losses[0]
    engine.save(trained)
    assert ucp.read_manifest(trained).metadata["hf_config"]["architectures"] == ["LlamaForCausalLM"]
    x = torch.randint(0, VOCAB, (2, 12), generator=gen)
    with torch.no_grad():
        want = engine(input_ids=x).logits

    # the trained checkpoint's config from its metadata; the tokenizer from the source folder; shards
    cli("export", str(trained), str(out), "--format", "hf", "--max-shard-size", "20KB", "--tokenizer", str(src))
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json"} <= names
    shards = sorted(n for n in names if n.startswith("model-0"))
    assert len(shards) > 2 and "model.safetensors" not in names
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(hf) is transformers.LlamaForCausalLM
    with torch.no_grad():
        got = hf(input_ids=x).logits
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-5
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer("w3 w7")["input_ids"] == [3, 7]


def test_converted_folder_exports_back_with_its_config_and_tokenizer(tmp_path: Path) -> None:
    """Straight back (identity names): the same tensors, config.json, and the tokenizer carried from the import."""
    src, ckpt, out = tmp_path / "src", tmp_path / "ckpt", tmp_path / "hf"
    tiny_llama().save_pretrained(src)
    save_tokenizer(src)
    ucp.convert(src, ckpt)
    report = ucp.export(ckpt, out, format="hf")
    assert report.config is not None and report.config.endswith("metadata.hf_config")
    assert "tokenizer.json" in report.files and "config.json" in report.files
    assert (out / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    assert json.loads((out / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    a, b = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_config_that_disagrees_with_the_shapes_names_the_tensor(tmp_path: Path) -> None:
    src, ckpt, out = tmp_path / "src", tmp_path / "ckpt", tmp_path / "hf"
    tiny_llama().save_pretrained(src)
    ucp.convert(src, ckpt)
    wrong = json.loads((src / "config.json").read_text()) | {"vocab_size": VOCAB + 8}
    (tmp_path / "wrong.json").write_text(json.dumps(wrong))
    result = CliRunner().invoke(app, ["export", str(ckpt), str(out), "--config", str(tmp_path / "wrong.json")])
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "'model.embed_tokens.weight': the checkpoint holds shape [64, 32], LlamaForCausalLM expects [72, 32]" in text
    assert not out.exists()
    with pytest.raises(ucp.CheckpointError, match="no 'model_type'"):
        ucp.export(ckpt, out, config={"vocab_size": VOCAB})
    with pytest.raises(ucp.CheckpointError, match="holds no tokenizer files"):
        ucp.export(ckpt, out, tokenizer=tmp_path)
    with pytest.raises(ucp.CheckpointError, match="apply to format 'hf' only"):
        ucp.export(ckpt, tmp_path / "z", format="zarr", config=wrong)


def test_reference_gpt_exports_as_gpt_neox_with_its_logits(tmp_path: Path) -> None:
    """The training Engine's reference GPT has no config.json of its own: ``--map gpt-neox`` writes GPT-NeoX's
    (the Hugging Face model that computes it), renames its tensors and regroups the fused QKV rows per
    head; from_pretrained then gives the reference GPT's logits on the same (padded-vocabulary) weights."""
    from training import Engine
    from training.models import GPT

    engine = Engine("tiny", micro_batch=2, seq_len=16)
    engine.train_step()
    manager = ucp.CheckpointManager(tmp_path / "ck")
    engine.save(manager)
    path = manager.path(1)
    plain = ucp.export(path, tmp_path / "plain")  # without --map: the reference names, no config.json
    assert plain.config is None and "embed.weight" in load_file(str(tmp_path / "plain" / "model.safetensors"))
    result = CliRunner().invoke(app, ["export", str(path), str(tmp_path / "hf"), "--map", "gpt-neox", "--json"])
    assert result.exit_code == 0, result.output
    assert "GPTNeoXForCausalLM" in json.loads(result.stdout)["config"]
    weights = ucp.load(path)["model"]
    padded = engine.cfg.model.model_copy(update={"vocab_size": weights["embed.weight"].shape[0]})
    reference = GPT(padded, seed=None)
    reference.load_state_dict(weights)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(hf) is transformers.GPTNeoXForCausalLM
    x = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = reference(x), hf(input_ids=x).logits
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-5

    gqa = engine.cfg.model.model_copy(update={"n_kv_head": 2})
    meta = {"model": gqa.model_dump(mode="json")}
    ucp.save({"model": GPT(gqa, seed=0).state_dict()}, tmp_path / "gqa", metadata=meta)
    with pytest.raises(ucp.CheckpointError, match=r"n_kv_head=2 < n_head=4 \(GQA\) has no Hugging Face twin"):
        ucp.export(tmp_path / "gqa", tmp_path / "hf2", name_map="gpt-neox")
