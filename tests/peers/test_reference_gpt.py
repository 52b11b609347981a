"""The reference GPT and its synthetic data: names, shapes, determinism, data splits.

Every peer (DeepSpeed, our ZeRO, DCP) trains this model, so these properties are what make their
checkpoints and loss curves comparable.
"""

from __future__ import annotations

import pytest
import torch

from training.models import GPT, PRESETS, GPTConfig, batch_for_step, expected_param_shapes, rows_for_step


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_parameter_names_and_shapes_match_spec(preset: str) -> None:
    cfg = PRESETS[preset]
    with torch.device("meta"):
        model = GPT(cfg, seed=None)
    got = {k: tuple(v.shape) for k, v in model.named_parameters()}
    assert list(got.items()) == list(expected_param_shapes(cfg).items())
    assert list(model.state_dict()) == list(got)  # no buffers, no aliases
    assert sum(v.numel() for v in model.parameters()) == cfg.num_params()


def test_fused_qkv_and_swiglu_rows() -> None:
    cfg = GPTConfig(
        vocab_size=64,
        n_layer=1,
        n_head=6,
        n_kv_head=2,
        d_model=48,
        d_ff=40,
        max_seq=8,
        swiglu=True,
        tied_embeddings=True,
    )
    shapes = expected_param_shapes(cfg)
    assert shapes["layers.0.attn.qkv.weight"] == ((6 + 2 * 2) * 8, 48)  # [q; k; v]
    assert shapes["layers.0.mlp.fc1.weight"] == (2 * 40, 48)  # [gate; up]
    assert "head.weight" not in shapes


def test_init_depends_only_on_seed() -> None:
    cfg = PRESETS["tiny"]
    torch.manual_seed(0)
    a = GPT(cfg, seed=7).state_dict()
    torch.manual_seed(99)  # the global RNG must not matter
    b = GPT(cfg, seed=7).state_dict()
    c = GPT(cfg, seed=8).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["embed.weight"], c["embed.weight"])
    assert torch.equal(a["layers.0.ln1.weight"], torch.ones(cfg.d_model))
    assert torch.equal(a["layers.0.attn.qkv.bias"], torch.zeros_like(a["layers.0.attn.qkv.bias"]))


@pytest.mark.parametrize("preset", ["tiny", "tiny-gqa"])
def test_forward_is_causal_and_loss_finite(preset: str) -> None:
    cfg = PRESETS[preset]
    model = GPT(cfg, seed=1)
    tokens, targets = batch_for_step(0, 2, 16, cfg.vocab_size, seed=3)
    loss = model(tokens, targets)
    assert loss.ndim == 0 and torch.isfinite(loss)
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % cfg.vocab_size
    with torch.no_grad():
        assert torch.equal(model(tokens)[:, :10], model(changed)[:, :10])


def test_tied_head_uses_embedding() -> None:
    cfg = PRESETS["tiny-gqa"]
    model = GPT(cfg, seed=1)
    with torch.no_grad():
        h = torch.randn(1, 3, cfg.d_model)
        assert torch.equal(model.embed(h, unembed=True), h @ model.embed.weight.T)


def test_batches_are_a_pure_function_of_step_and_row() -> None:
    full_x, full_y = rows_for_step(5, range(8), 32, 1000, seed=11)
    assert torch.equal(full_x[:, 1:], full_y[:, :-1])  # targets are the next tokens
    assert full_x.dtype == torch.int64 and int(full_x.max()) < 1000
    # 2 ranks x 2 micro-steps x 2 rows and 4 ranks x 1 micro-step x 2 rows: the same global batch
    parts_a = [
        batch_for_step(5, 2, 32, 1000, 11, rank=r, world_size=2, micro_step=m, grad_accum=2)[0]
        for m in range(2)
        for r in range(2)
    ]
    parts_b = [batch_for_step(5, 2, 32, 1000, 11, rank=r, world_size=4)[0] for r in range(4)]
    assert torch.equal(torch.cat(parts_a), full_x)
    assert torch.equal(torch.cat(parts_b), full_x)
    assert not torch.equal(rows_for_step(6, range(8), 32, 1000, seed=11)[0], full_x)


def test_bad_rank_is_refused() -> None:
    with pytest.raises(ValueError, match="rank 2 outside world_size 2"):
        batch_for_step(0, 1, 8, 100, 0, rank=2, world_size=2)
