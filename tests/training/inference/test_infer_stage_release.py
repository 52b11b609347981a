"""Stages at the tensor grain: a layer's parts are released as the model moves to a later stage, so with
an arena of exactly the largest part (every read overwrites the part before) the Llama (with biases)
and the reference GPT still give the layer grain's logits bit for bit; each bias shares its weight's
stage; a model that reads a released weight again gets a clear error instead of reused bytes."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import pytest
import torch
from inference_models import hf_logits, save_hf, tiny_llama

import ucp
from training.inference.config import load_model
from training.inference.errors import InferenceError
from training.inference.executor import Executor
from training.inference.generate import generate
from training.inference.llama import Llama
from training.inference.model import Step
from training.inference.sources import open_weights
from training.models.gpt import GPT, PRESETS

pytest.importorskip("transformers")

IDS = [[5, 9, 2, 77, 3], [1, 4, 1, 5, 9]]


def run(path: Path, **kw: object) -> tuple[Executor, object]:
    model, source = load_model(open_weights(path))
    with Executor(model, source, 1 << 20, pin_layers=False, **kw) as ex:  # type: ignore[arg-type]
        return ex, generate(ex, IDS, 4, keep_logits=True)


def same_as_layer_grain(path: Path) -> object:
    ex, got = run(path, prefetch=0)  # one part at a time: each part's read lands on the one before
    assert ex.plan.grain == "tensor" and ex.plan.ring_bytes == ex.plan.slot_bytes
    assert len(ex.plan.units) > 3 * len(ex.plan.streamed) // 2  # several parts a layer
    _, want = run(path, read_path="staged")
    assert got.tokens == want.tokens  # type: ignore[attr-defined]
    for a, b in zip(got.logits, want.logits):  # type: ignore[attr-defined]
        assert torch.equal(a, b)
    return got


def test_llama_with_biases_in_a_one_part_arena(tmp_path: Path) -> None:
    hf = tiny_llama(attention_bias=True, mlp_bias=True)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))  # biases away from 0, so a lost one shows
    path = save_hf(hf, tmp_path / "hf")
    got = same_as_layer_grain(path)
    want = hf_logits(hf, torch.tensor(IDS))
    torch.testing.assert_close(got.logits[0], want, rtol=1e-5, atol=1e-5)  # type: ignore[attr-defined]
    model, _ = load_model(open_weights(path))
    for i in range(model.n_layers):
        stage_of = {n: k for k, s in enumerate(model.layer_stages(i)) for n in s}
        assert [n for s in model.layer_stages(i) for n in s] == model.layer_names(i)
        for n in stage_of:
            if n.endswith(".bias"):
                assert stage_of[n] == stage_of[n.removesuffix(".bias") + ".weight"], n


def test_reference_gpt_in_a_one_part_arena(tmp_path: Path) -> None:
    cfg = PRESETS["tiny"]
    gpt = GPT(cfg, seed=3).eval()
    path = tmp_path / "gpt"
    ucp.save({"model": gpt.state_dict()}, path, metadata={"model": cfg.model_dump(mode="json")})
    same_as_layer_grain(path)
    model, _ = load_model(open_weights(path))
    assert [len(s) for s in model.layer_stages(0)] == [4, 4, 2, 2]  # [ln1, qkv] [proj, ln2] [fc1] [fc2]


class ReadsQAgain(Llama):
    """A Llama whose layer reads q_proj again after the MLP: against its declared stages."""

    def layer(self, i: int, w: Mapping[str, torch.Tensor], h: torch.Tensor, step: Step) -> torch.Tensor:
        h = super().layer(i, w, h, step)
        w[f"model.layers.{i}.self_attn.q_proj.weight"]
        return h


def test_reading_a_released_weight_is_an_error_naming_the_stages(tmp_path: Path) -> None:
    path = save_hf(tiny_llama(), tmp_path / "hf")
    model, source = load_model(open_weights(path))
    assert isinstance(model, Llama)
    with Executor(ReadsQAgain(model.args), source, 1 << 20, pin_layers=False) as ex:
        with pytest.raises(InferenceError, match=r"layer 0: the model read 'model\.layers\.0\.self_attn\.q_proj.*"):
            generate(ex, IDS, 1)
