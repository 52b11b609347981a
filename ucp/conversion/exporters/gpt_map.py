"""The reference GPT (``training.models.GPT``, recorded as ``metadata.model`` by the training Engine) as a
Hugging Face ``GPTNeoXForCausalLM`` (``ucp export --format hf --map gpt-neox``): the names, the one tensor
layout that differs, and the config. Opt-in: without it an Engine checkpoint exports under its own names
(what ``ucp infer`` and the demo read).

Why GPT-NeoX: the reference GPT is pre-LayerNorm (with bias), rotary attention (rotate-half, on the whole
head) with a fused QKV projection and biases, a GELU (tanh) MLP with biases, sequential residuals and an
untied (or tied) head. GPT-NeoX with ``use_parallel_residual=false``, ``hidden_act="gelu_pytorch_tanh"``
and a rotary factor of 1 computes exactly that (its logits equal the reference GPT's bit for bit on the
CPU). ``LlamaForCausalLM`` does not (RMSNorm without bias, no linear biases), nor does GPT-2 (learned
absolute positions, no rotary): renaming to either would load and give other logits. The GQA and SwiGLU
variants (``n_kv_head`` < ``n_head``, ``swiglu``) have no GPT-NeoX twin and are refused.

Names (``i`` the layer)::

    embed.weight                 gpt_neox.embed_in.weight
    layers.i.ln1.{weight,bias}   gpt_neox.layers.i.input_layernorm.{weight,bias}
    layers.i.attn.qkv.*          gpt_neox.layers.i.attention.query_key_value.*   rows regrouped, see below
    layers.i.attn.proj.*         gpt_neox.layers.i.attention.dense.*
    layers.i.ln2.*               gpt_neox.layers.i.post_attention_layernorm.*
    layers.i.mlp.fc1.*           gpt_neox.layers.i.mlp.dense_h_to_4h.*
    layers.i.mlp.fc2.*           gpt_neox.layers.i.mlp.dense_4h_to_h.*
    ln_f.*                       gpt_neox.final_layer_norm.*
    head.weight                  embed_out.weight (transformers 5 reads it as lm_head.weight)

The fused QKV rows are ``[q; k; v]`` (each ``n_head × head_dim``) in the reference GPT and per head
``[q_h; k_h; v_h]`` in GPT-NeoX: the same rows in another order, moved as byte blocks (no torch needed).
A vocabulary the training Engine padded (``pad_vocab_to``) is exported padded: ``vocab_size`` in the config
is the embedding's row count, and the padded rows' logits are the model's own.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from ucp.conversion.exporters.options import ExportError
from ucp.conversion.exporters.selection import Selection

ARCH = "GPTNeoXForCausalLM"
FIELDS = {"vocab_size", "n_layer", "n_head", "d_model", "d_ff", "max_seq"}
_LAYER = {
    "ln1": "input_layernorm",
    "attn.qkv": "attention.query_key_value",
    "attn.proj": "attention.dense",
    "ln2": "post_attention_layernorm",
    "mlp.fc1": "mlp.dense_h_to_4h",
    "mlp.fc2": "mlp.dense_4h_to_h",
}
# names transformers 5 gives GPT-NeoX tensors that the Hub's checkpoints (and this export) name otherwise
CHECK_ALIASES = {"embed_out.weight": "lm_head.weight"}


def reference_gpt(metadata: dict[str, Any]) -> dict[str, Any] | None:
    """The reference GPT's config recorded in ``metadata.model`` (the training Engine's), or None."""
    doc = metadata.get("model")
    if isinstance(doc, dict) and FIELDS <= doc.keys():
        return doc
    return None


def hf_name(name: str) -> str | None:
    """The GPT-NeoX name of reference-GPT tensor ``name`` (None: not one of its tensors)."""
    top = {
        "embed.weight": "gpt_neox.embed_in.weight",
        "ln_f.weight": "gpt_neox.final_layer_norm.weight",
        "ln_f.bias": "gpt_neox.final_layer_norm.bias",
        "head.weight": "embed_out.weight",
    }
    if name in top:
        return top[name]
    parts = name.split(".")
    if len(parts) >= 4 and parts[0] == "layers" and parts[1].isdigit():
        module, leaf = ".".join(parts[2:-1]), parts[-1]
        if module in _LAYER and leaf in ("weight", "bias"):
            return f"gpt_neox.layers.{parts[1]}.{_LAYER[module]}.{leaf}"
    return None


def regroup_qkv(n_head: int, head_dim: int, row_bytes: int) -> Callable[[Any], bytes]:
    """Bytes of a fused ``[q; k; v]`` tensor (rows of ``row_bytes``) reordered to GPT-NeoX's per-head
    ``[q_h; k_h; v_h]``."""
    block = head_dim * row_bytes

    def apply(data: Any) -> bytes:
        view = memoryview(data).cast("B")
        out = bytearray(len(view))
        pos = 0
        for h in range(n_head):
            for j in range(3):
                start = (j * n_head + h) * block
                out[pos : pos + block] = view[start : start + block]
                pos += block
        return bytes(out)

    return apply


def plan(gpt: dict[str, Any], selection: Selection) -> tuple[Selection, dict[str, Callable[[Any], bytes]], dict]:
    """(the selection renamed to GPT-NeoX, byte transforms by output name, config.json) for the reference
    GPT ``gpt``; ExportError for a variant GPT-NeoX does not compute or a tensor it does not have."""
    n_head, d_model = int(gpt["n_head"]), int(gpt["d_model"])
    kv = gpt.get("n_kv_head") or n_head
    if kv != n_head or gpt.get("swiglu") or not gpt.get("bias", True):
        raise ExportError(
            "the reference GPT with "
            + ", ".join(
                w
                for w, on in (
                    (f"n_kv_head={kv} < n_head={n_head} (GQA)", kv != n_head),
                    ("swiglu", bool(gpt.get("swiglu"))),
                    ("bias=false", not gpt.get("bias", True)),
                )
                if on
            )
            + f" has no Hugging Face twin ({ARCH} needs multi-head attention, a GELU MLP and biases); "
            "export it without a config (--config of another model would not compute the same logits)"
        )
    head_dim = d_model // n_head
    tensors, transforms = [], {}
    vocab = None
    for t in selection.tensors:
        out = hf_name(t.out_name)
        if out is None:
            raise ExportError(f"tensor {t.out_name!r} is not a reference-GPT tensor; {ARCH} has no place for it")
        if t.out_name == "embed.weight":
            vocab = t.shape[0]
        if ".attn.qkv." in t.out_name:
            rows = t.shape[0]
            if rows != 3 * n_head * head_dim:
                raise ExportError(f"tensor {t.out_name!r} has {rows} rows, not 3 × n_head × head_dim")
            row_bytes = t.out_itemsize * (t.shape[1] if len(t.shape) == 2 else 1)
            transforms[out] = regroup_qkv(n_head, head_dim, row_bytes)
        tensors.append(dataclasses.replace(t, out_name=out))
    if vocab is None:
        raise ExportError("the reference GPT's embed.weight is not in the export")
    tied = bool(gpt.get("tied_embeddings"))
    base = float(gpt.get("rope_base", 10000.0))
    config = {
        "architectures": [ARCH],
        "model_type": "gpt_neox",
        "vocab_size": vocab,
        "hidden_size": d_model,
        "num_hidden_layers": int(gpt["n_layer"]),
        "num_attention_heads": n_head,
        "intermediate_size": int(gpt["d_ff"]),
        "hidden_act": "gelu_pytorch_tanh",
        "max_position_embeddings": int(gpt["max_seq"]),
        "layer_norm_eps": 1e-5,
        "use_parallel_residual": False,
        "attention_bias": True,
        "attention_dropout": 0.0,
        "hidden_dropout": 0.0,
        "tie_word_embeddings": tied,
        "initializer_range": float(gpt.get("init_std", 0.02)),
        "rope_parameters": {"rope_type": "default", "rope_theta": base, "partial_rotary_factor": 1.0},
        "rotary_pct": 1.0,  # the same, as transformers 4 reads it
        "rotary_emb_base": base,
        "use_cache": True,
    }
    return Selection(selection.section, tensors), transforms, config
