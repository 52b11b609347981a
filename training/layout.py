"""Layouts (reshard.Layout) for what the training runtime shards: the reference GPT, or any module.

The layout is the single source of truth for who holds what: the TP-local modules are built by
slicing global tensors through it, ZeRO partitions follow its flat-partition rule (reshard.zero),
and the checkpoint seam (training.checkpoint) turns its slots into ucp ShardedTensor/FlatShard
pieces. Names follow ``training.models.gpt`` (``layers.{i}.attn.qkv.weight`` ...), so a layout
here describes the same global tensors a single-process GPT saves.
"""

from __future__ import annotations

from typing import Sequence

from reshard import Layout, Mesh, Pipeline, Rule, Zero
from training.models.gpt import GPTConfig, expected_param_shapes

# Parameters without weight decay (biases and layernorms) come first: the usual AdamW grouping.
GPT_GROUPS: tuple[tuple[str, ...], ...] = (("*.bias", "layers.{i}.ln1.*", "layers.{i}.ln2.*", "ln_f.*"), ("*",))


def gpt_shapes(cfg: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Global parameter shapes in registration (= ZeRO flattening) order."""
    return dict(expected_param_shapes(cfg))


def gpt_layout(
    cfg: GPTConfig, mesh: Mesh | None = None, *, zero_stage: int = 0, zero_alignment: int = 1, pad_vocab_to: int = 128
) -> Layout:
    """The reference GPT over a (tp, pp, dp) mesh, Megatron style.

    * ``embed.weight`` / ``head.weight``: vocabulary-parallel, padded so every tp rank holds
      ``ceil(V / (pad·tp))·pad`` rows (Megatron's make_vocab_size_divisible_by = ``pad_vocab_to``);
    * fused QKV: q, k and v rows each split over tp in whole heads (GQA: kv heads split too);
    * attention output and ``fc2``: row-parallel; ``fc1``: column-parallel (SwiGLU: gate and up
      split on their own, so a rank holds ``[gate_t; up_t]``; plain MLP: ``d_ff`` need not divide by
      tp, the first ranks get one more row); biases of row-parallel linears and layernorms replicated;
    * pipeline: layers in contiguous blocks; the embedding on the first stage, ``ln_f`` and the head
      on the last; a tied embedding on both (saved by the first).
    """
    hd, q, kv = cfg.head_dim, cfg.n_head * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    qkv = f"(tp [q:{q} k:{kv} v:{kv}] | unit={hd})"
    # SwiGLU's gate and up are split on their own (fused parts must divide evenly); a plain MLP may
    # have any d_ff: "uneven" deals rows out as evenly as possible (= the even split when tp | d_ff).
    fc1 = "(tp [gate up])" if cfg.swiglu else "(tp f | uneven)"
    fc2 = "h (tp f)" if cfg.swiglu else "h (tp f | uneven)"
    vocab = f"(tp v | pad={pad_vocab_to}) h"
    L = "layers.{i}."
    rules = [
        Rule(name="embed.weight", dims=vocab),
        Rule(name=L + "ln1.*", dims="h"),
        Rule(name=L + "ln2.*", dims="h"),
        Rule(name=L + "attn.qkv.weight", dims=f"{qkv} h"),
        Rule(name=L + "attn.qkv.bias", dims=qkv, optional=True),
        Rule(name=L + "attn.proj.weight", dims=f"h (tp o | unit={hd})"),
        Rule(name=L + "attn.proj.bias", dims="h", optional=True),
        Rule(name=L + "mlp.fc1.weight", dims=f"{fc1} h"),
        Rule(name=L + "mlp.fc1.bias", dims=fc1, optional=True),
        Rule(name=L + "mlp.fc2.weight", dims=fc2),
        Rule(name=L + "mlp.fc2.bias", dims="h", optional=True),
        Rule(name="ln_f.*", dims="h"),
        Rule(name="head.weight", dims=vocab, optional=True),
    ]
    tied = cfg.tied_embeddings
    pipeline = Pipeline(
        layer="layers.{i}.*",
        first=() if tied else ("embed.weight",),
        last=("ln_f.*", "head.weight"),
        tied=("embed.weight",) if tied else (),
    )
    return Layout(
        mesh=mesh or Mesh(),
        zero=Zero(stage=zero_stage, alignment=zero_alignment, groups=GPT_GROUPS),
        rules=tuple(rules),
        pipeline=pipeline,
    )


def module_layout(
    dp: int, *, zero_stage: int, zero_alignment: int = 1, groups: Sequence[Sequence[str]] = (("*",),)
) -> Layout:
    """Any module under plain data parallelism: every tensor replicated (the default pattern), ZeRO over ``dp``."""
    return Layout(
        mesh=Mesh(dp=dp),
        zero=Zero(stage=zero_stage, alignment=zero_alignment, groups=tuple(tuple(g) for g in groups)),
        default="...",
        pipeline=Pipeline(),
    )
