"""The streamed Llama equals transformers' LlamaForCausalLM on the same weights: logits within 1e-5
relative in fp32 and identical greedy tokens, from a save_pretrained directory (single file and sharded)
and from the same weights saved as a UCP checkpoint, under budgets that stream every layer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from inference_models import hf_greedy, hf_logits, save_hf, save_ucp, tiny_llama

from training.inference.config import load_model
from training.inference.executor import Executor
from training.inference.generate import generate
from training.inference.sources import open_weights

pytest.importorskip("transformers")


def streamed(path: Path, budget: int = 1 << 20, **kw: object) -> Executor:
    """Every layer streamed (none pinned), however large the budget."""
    model, source = load_model(open_weights(path))
    return Executor(model, source, budget, pin_layers=False, **kw)  # type: ignore[arg-type]


def check_against_hf(hf: object, path: Path, budget: int = 1 << 20) -> None:
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    with streamed(path, budget) as ex:
        got = generate(ex, ids.tolist(), 6, keep_logits=True)
        assert ex.stats.groups_read > 0  # the layers were streamed, not held
    torch.testing.assert_close(got.logits[0], hf_logits(hf, ids), rtol=1e-5, atol=1e-6)
    assert got.tokens == hf_greedy(hf, ids, 6)


@pytest.mark.parametrize("tied", [False, True])
def test_safetensors_dir_matches_transformers(tmp_path: Path, tied: bool) -> None:
    hf = tiny_llama(tied=tied)
    check_against_hf(hf, save_hf(hf, tmp_path / "hf"))


def test_sharded_safetensors_matches_transformers(tmp_path: Path) -> None:
    hf = tiny_llama()
    path = save_hf(hf, tmp_path / "hf", max_shard_size="100KB")
    assert (path / "model.safetensors.index.json").exists()
    assert len(list(path.glob("*.safetensors"))) > 2
    check_against_hf(hf, path)


@pytest.mark.parametrize("tied", [False, True])
def test_ucp_checkpoint_matches_transformers(tmp_path: Path, tied: bool) -> None:
    hf = tiny_llama(tied=tied)
    path = save_ucp(hf, tmp_path / "ckpt")
    assert open_weights(path).kind == "UCP checkpoint"
    check_against_hf(hf, path)


def test_small_budget_streams_embedding_and_head_too(tmp_path: Path) -> None:
    hf = tiny_llama()
    path = save_hf(hf, tmp_path / "hf")
    with streamed(path, 100_000) as ex:  # less than embedding + head + two of the largest part: everything streams
        assert ex.plan.resident == [] and ex.plan.resident_bytes == 0
        assert len(ex.plan.streamed) == 3 + 2
    check_against_hf(hf, path, 100_000)
