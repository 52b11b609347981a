"""Tiny models for the inference tests: a transformers Llama saved with save_pretrained, and as a UCP checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def tiny_llama(tied: bool = False, layers: int = 3, seed: int = 0, **overrides: Any) -> Any:
    """A transformers LlamaForCausalLM with GQA (4 query heads, 2 kv heads), random weights, fp32, eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    kw: dict[str, Any] = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        rope_theta=10000.0,
    )
    kw.update(overrides)
    model = LlamaForCausalLM(LlamaConfig(**kw)).eval()
    with torch.no_grad():  # transformers initialises norms to ones: randomise them so a misplaced norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    return model


def save_hf(model: Any, path: Path, **kw: Any) -> Path:
    model.save_pretrained(path, safe_serialization=True, **kw)
    return path


def save_ucp(model: Any, path: Path) -> Path:
    """The model's state dict as a UCP checkpoint; its config.json's content travels in the metadata."""
    import ucp

    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    ucp.save(sd, path, metadata={"hf_config": model.config.to_dict()})
    return path


def hf_logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def hf_greedy(model: Any, ids: torch.Tensor, n: int) -> list[list[int]]:
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=0
        )
    return out[:, ids.shape[1] :].tolist()
