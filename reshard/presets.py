"""Ready-made layouts (and tensor shapes) for common model families.

* :func:`gpt_layout` — Megatron/DeepSpeed GPT: fused QKV (optionally GQA), column/row-parallel
  MLP, vocabulary-parallel embedding padded like Megatron, output head tied to the embedding.
* :func:`llama_layout` — Llama-style with Hugging Face names (``model.layers.{i}.self_attn.q_proj.weight``):
  separate or fused q/k/v, separate or fused SwiGLU gate/up, RMSNorm, untied head, optional
  stacked experts over ep.

Each ``*_shapes`` function gives the matching global shapes, in model (parameter) order.
"""

from __future__ import annotations

from dataclasses import dataclass

from .layout import Layout, Mesh, Pipeline, Rule, Zero


@dataclass(frozen=True)
class ModelDims:
    """Sizes of a transformer; unset ones take the usual defaults."""

    hidden: int
    layers: int
    heads: int
    vocab: int
    ffn: int = 0  # 0: 4·hidden
    kv_heads: int = 0  # 0: heads (no GQA)
    head_dim: int = 0  # 0: hidden / heads
    max_positions: int = 2048  # learned position embeddings (GPT)
    experts: int = 0  # > 0: stacked MoE experts (Llama preset)

    @property
    def f(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def kv(self) -> int:
        return self.kv_heads or self.heads

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def q_rows(self) -> int:
        return self.heads * self.hd

    @property
    def kv_rows(self) -> int:
        return self.kv * self.hd


def _zero(stage: int, alignment: int, groups: tuple[tuple[str, ...], ...]) -> Zero:
    return Zero(stage=stage, alignment=alignment, groups=groups)


# -- GPT (Megatron / DeepSpeed names) -------------------------------------------------------------


def gpt_shapes(d: ModelDims) -> dict[str, tuple[int, ...]]:
    """Global shapes of a Megatron GPT (biases and layernorm biases included)."""
    h = d.hidden
    qkv = d.q_rows + 2 * d.kv_rows
    out: dict[str, tuple[int, ...]] = {
        "embedding.word_embeddings.weight": (d.vocab, h),
        "embedding.position_embeddings.weight": (d.max_positions, h),
    }
    for i in range(d.layers):
        p = f"layers.{i}."
        out |= {
            p + "input_layernorm.weight": (h,),
            p + "input_layernorm.bias": (h,),
            p + "self_attention.query_key_value.weight": (qkv, h),
            p + "self_attention.query_key_value.bias": (qkv,),
            p + "self_attention.dense.weight": (h, d.q_rows),
            p + "self_attention.dense.bias": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "post_attention_layernorm.bias": (h,),
            p + "mlp.dense_h_to_4h.weight": (d.f, h),
            p + "mlp.dense_h_to_4h.bias": (d.f,),
            p + "mlp.dense_4h_to_h.weight": (h, d.f),
            p + "mlp.dense_4h_to_h.bias": (h,),
        }
    out |= {"final_layernorm.weight": (h,), "final_layernorm.bias": (h,)}
    return out


def gpt_layout(
    d: ModelDims,
    mesh: Mesh | None = None,
    *,
    zero_stage: int = 0,
    zero_alignment: int = 1,
    pad_vocab_to: int = 128,
    sequence_parallel: bool = False,
    qkv_interleaved: bool = False,
) -> Layout:
    """Megatron GPT. ``pad_vocab_to`` is make_vocab_size_divisible_by; ``sequence_parallel`` averages the
    layernorms' tp copies on merge; ``qkv_interleaved`` describes Megatron's per-head (per query group)
    interleaved QKV rows instead of [q; k; v]."""
    norm = "h | avg" if sequence_parallel else "h"
    if qkv_interleaved:
        group_rows = (d.heads // d.kv + 2) * d.hd  # one query group: its q heads, one k head, one v head
        qkv = f"(tp qkv | unit={group_rows})"
    else:
        qkv = f"(tp [q:{d.q_rows} k:{d.kv_rows} v:{d.kv_rows}] | unit={d.hd})"
    L = "layers.{i}."
    rules = [
        Rule(name="embedding.word_embeddings.weight", dims=f"(tp v | pad={pad_vocab_to}) h"),
        Rule(name="embedding.position_embeddings.weight", dims="p h"),
        Rule(name=L + "*layernorm.*", dims=norm),
        Rule(name=L + "self_attention.query_key_value.weight", dims=f"{qkv} h"),
        Rule(name=L + "self_attention.query_key_value.bias", dims=qkv),
        Rule(name=L + "self_attention.dense.weight", dims=f"h (tp o | unit={d.hd})"),
        Rule(name=L + "self_attention.dense.bias", dims="h"),  # row-parallel biases are added once: replicated
        Rule(name=L + "mlp.dense_h_to_4h.*", dims="(tp f) ..."),
        Rule(name=L + "mlp.dense_4h_to_h.weight", dims="h (tp f)"),
        Rule(name=L + "mlp.dense_4h_to_h.bias", dims="h"),
        Rule(name="final_layernorm.*", dims=norm),
    ]
    return Layout(
        mesh=mesh or Mesh(),
        zero=_zero(zero_stage, zero_alignment, (("*layernorm.*", "*.bias"), ("*",))),
        rules=tuple(rules),
        pipeline=Pipeline(
            layer="layers.{i}.*",
            first=("embedding.position_embeddings.weight",),
            last=("final_layernorm.*",),
            tied=("embedding.word_embeddings.weight",),
        ),
    )


# -- Llama (Hugging Face names) ---------------------------------------------------------------------


def llama_shapes(
    d: ModelDims, *, fused_qkv: bool = False, fused_gate_up: bool = False, tie_embeddings: bool = False
) -> dict[str, tuple[int, ...]]:
    """Global shapes of a Llama-style model with Hugging Face names."""
    h = d.hidden
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (d.vocab, h)}
    for i in range(d.layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (h,)
        if fused_qkv:
            out[p + "self_attn.qkv_proj.weight"] = (d.q_rows + 2 * d.kv_rows, h)
        else:
            out |= {
                p + "self_attn.q_proj.weight": (d.q_rows, h),
                p + "self_attn.k_proj.weight": (d.kv_rows, h),
                p + "self_attn.v_proj.weight": (d.kv_rows, h),
            }
        out[p + "self_attn.o_proj.weight"] = (h, d.q_rows)
        out[p + "post_attention_layernorm.weight"] = (h,)
        if d.experts:
            out |= {
                p + "mlp.router.weight": (d.experts, h),
                p + "mlp.experts.gate_up_proj": (d.experts, 2 * d.f, h),
                p + "mlp.experts.down_proj": (d.experts, h, d.f),
            }
        elif fused_gate_up:
            out |= {p + "mlp.gate_up_proj.weight": (2 * d.f, h), p + "mlp.down_proj.weight": (h, d.f)}
        else:
            out |= {
                p + "mlp.gate_proj.weight": (d.f, h),
                p + "mlp.up_proj.weight": (d.f, h),
                p + "mlp.down_proj.weight": (h, d.f),
            }
    out["model.norm.weight"] = (h,)
    if not tie_embeddings:
        out["lm_head.weight"] = (d.vocab, h)
    return out


def llama_layout(
    d: ModelDims,
    mesh: Mesh | None = None,
    *,
    zero_stage: int = 0,
    zero_alignment: int = 1,
    fused_qkv: bool = False,
    fused_gate_up: bool = False,
    tie_embeddings: bool = False,
    pad_vocab_to: int | None = None,
) -> Layout:
    """Llama-style model, Hugging Face names. Attention splits in whole heads (``unit=head_dim``), so a tp
    larger than the number of KV heads is reported as such."""
    hd = d.hd
    vocab = f"(tp v | pad={pad_vocab_to}) h" if pad_vocab_to else "(tp v) h"
    L = "model.layers.{i}."
    rules = [Rule(name="model.embed_tokens.weight", dims=vocab), Rule(name=L + "*layernorm.weight", dims="h")]
    if fused_qkv:
        rules.append(
            Rule(
                name=L + "self_attn.qkv_proj.weight",
                dims=f"(tp [q:{d.heads}*{hd} k:{d.kv}*{hd} v:{d.kv}*{hd}] | unit={hd}) h",
            )
        )
    else:
        rules += [
            Rule(name=L + "self_attn.q_proj.weight", dims=f"(tp q | unit={hd}) h"),
            Rule(name=L + "self_attn.k_proj.weight", dims=f"(tp k | unit={hd}) h"),
            Rule(name=L + "self_attn.v_proj.weight", dims=f"(tp v | unit={hd}) h"),
        ]
    rules.append(Rule(name=L + "self_attn.o_proj.weight", dims=f"h (tp o | unit={hd})"))
    if d.experts:
        rules += [
            Rule(name=L + "mlp.router.weight", dims="e h"),
            Rule(name=L + "mlp.experts.gate_up_proj", dims="(ep e) (tp [gate up]) h"),
            Rule(name=L + "mlp.experts.down_proj", dims="(ep e) h (tp f)"),
        ]
    elif fused_gate_up:
        rules += [
            Rule(name=L + "mlp.gate_up_proj.weight", dims="(tp [gate up]) h"),
            Rule(name=L + "mlp.down_proj.weight", dims="h (tp f)"),
        ]
    else:
        rules += [
            Rule(name=L + "mlp.gate_proj.weight", dims="(tp f) h"),
            Rule(name=L + "mlp.up_proj.weight", dims="(tp f) h"),
            Rule(name=L + "mlp.down_proj.weight", dims="h (tp f)"),
        ]
    rules.append(Rule(name="model.norm.weight", dims="h"))
    if not tie_embeddings:
        rules.append(Rule(name="lm_head.weight", dims=vocab))
    groups: tuple[tuple[str, ...], ...] = (("*norm.weight",), ("*",))
    if d.experts:
        groups = (("*.mlp.experts.*",),) + groups
    return Layout(
        mesh=mesh or Mesh(),
        zero=_zero(zero_stage, zero_alignment, groups),
        rules=tuple(rules),
        pipeline=Pipeline(
            layer="model.layers.{i}.*",
            first=() if tie_embeddings else ("model.embed_tokens.weight",),
            last=("model.norm.weight",) + (() if tie_embeddings else ("lm_head.weight",)),
            tied=("model.embed_tokens.weight",) if tie_embeddings else (),
        ),
    )
