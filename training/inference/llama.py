"""The Llama family in Hugging Face's layout: GQA, RoPE, SwiGLU, RMSNorm, tied or untied head.

Tensor names and arithmetic follow ``transformers``' ``LlamaForCausalLM`` (RMSNorm in fp32, RoPE
tables from ``rope_theta``), so a ``save_pretrained`` directory runs without conversion and its logits
match transformers' own within float rounding.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from training.inference.errors import ModelConfigError
from training.inference.files import LOCAL, Files
from training.inference.model import Step, StreamModel, apply_rope, attend, cut_before

LATER_PROJECTIONS = (
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


class LlamaArgs(BaseModel):
    """The fields of a Llama config.json this runtime reads (others are ignored)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rope_parameters: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    @model_validator(mode="after")
    def _supported(self) -> "LlamaArgs":
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (only 'silu')")
        for key in ("rope_scaling", "rope_parameters"):
            scaling = getattr(self, key)
            if scaling and scaling.get("rope_type", scaling.get("type", "default")) != "default":
                raise ValueError(f"{key} {scaling} is not supported (only default RoPE)")
        if self.num_attention_heads % self.kv_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} not a multiple of kv heads {self.kv_heads}"
            )
        return self

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def theta(self) -> float:
        """transformers 5 moves rope_theta into rope_parameters."""
        if self.rope_parameters and "rope_theta" in self.rope_parameters:
            return float(self.rope_parameters["rope_theta"])
        return self.rope_theta


def read_config(root: str, files: Files = LOCAL) -> dict[str, Any]:
    """config.json of a weights directory (or URL prefix, read through ``files``) as a dict;
    ModelConfigError naming the file otherwise."""
    path = os.path.join(root, "config.json")
    try:
        doc = json.loads(files.read(path))
    except FileNotFoundError:
        raise ModelConfigError(f"{path}: missing (the model's config.json is needed to run it)") from None
    except (OSError, ValueError) as exc:
        raise ModelConfigError(f"{path}: unreadable ({exc})") from None
    if not isinstance(doc, dict):
        raise ModelConfigError(f"{path}: not a JSON object")
    return doc


def parse_llama(doc: dict[str, Any], where: str) -> LlamaArgs:
    try:
        return LlamaArgs.model_validate(doc)
    except ValidationError as exc:
        raise ModelConfigError(f"{where}: not a usable Llama config: {validation_text(exc)}") from None


def validation_text(exc: ValidationError) -> str:
    """A pydantic error as one line: ``field: message; ...`` (no input dump, no URL)."""
    parts = []
    for e in exc.errors():
        loc = ".".join(str(x) for x in e["loc"])
        parts.append(f"{loc}: {e['msg']}" if loc else str(e["msg"]))
    return "; ".join(parts)


class Llama(StreamModel):
    """Hugging Face Llama; ``prefix`` is prepended to every tensor name (e.g. ``"model."`` of a state dict)."""

    def __init__(self, args: LlamaArgs) -> None:
        self.args = args
        self.n_layers = args.num_hidden_layers
        self.n_kv_heads = args.kv_heads
        self.head_dim = args.hd
        self.tied = args.tie_word_embeddings

    def pre_names(self) -> list[str]:
        return ["model.embed_tokens.weight"]

    def layer_names(self, i: int) -> list[str]:
        return list(self._layer_shapes(i))

    def post_names(self) -> list[str]:
        return ["model.norm.weight", "model.embed_tokens.weight" if self.tied else "lm_head.weight"]

    def layer_stages(self, i: int) -> list[list[str]]:
        """[input norm, q], [k], [v], [o, post-attention norm], [gate], [up], [down] (biases with their
        weights): :meth:`layer` reads them in this order and each projection's weight once."""
        return cut_before(self.layer_names(i), [f".{n}.weight" for n in LATER_PROJECTIONS])

    def _layer_shapes(self, i: int) -> dict[str, tuple[int, ...]]:
        a, p = self.args, f"model.layers.{i}."
        d, hd, nq, nkv, ff = a.hidden_size, a.hd, a.num_attention_heads, a.kv_heads, a.intermediate_size
        out: dict[str, tuple[int, ...]] = {p + "input_layernorm.weight": (d,)}
        for name, rows in (("q_proj", nq * hd), ("k_proj", nkv * hd), ("v_proj", nkv * hd)):
            out[f"{p}self_attn.{name}.weight"] = (rows, d)
            if a.attention_bias:
                out[f"{p}self_attn.{name}.bias"] = (rows,)
        out[p + "self_attn.o_proj.weight"] = (d, nq * hd)
        if a.attention_bias:
            out[p + "self_attn.o_proj.bias"] = (d,)
        out[p + "post_attention_layernorm.weight"] = (d,)
        for name, shape in (("gate_proj", (ff, d)), ("up_proj", (ff, d)), ("down_proj", (d, ff))):
            out[f"{p}mlp.{name}.weight"] = shape
            if a.mlp_bias:
                out[f"{p}mlp.{name}.bias"] = (shape[0],)
        return out

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        a = self.args
        out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (a.vocab_size, a.hidden_size)}
        for i in range(self.n_layers):
            out.update(self._layer_shapes(i))
        out["model.norm.weight"] = (a.hidden_size,)
        if not self.tied:
            out["lm_head.weight"] = (a.vocab_size, a.hidden_size)
        return out

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.args.rms_norm_eps)
        return w * x.to(dtype)

    def embed(self, w: Mapping[str, torch.Tensor], step: Step) -> torch.Tensor:
        return F.embedding(step.tokens, w["model.embed_tokens.weight"])

    def layer(self, i: int, w: Mapping[str, torch.Tensor], h: torch.Tensor, step: Step) -> torch.Tensor:
        a, p = self.args, f"model.layers.{i}."
        b, t, _ = h.shape
        hd, nq, nkv = a.hd, a.num_attention_heads, a.kv_heads
        x = self._norm(h, w[p + "input_layernorm.weight"])

        def proj(name: str, x: torch.Tensor) -> torch.Tensor:
            return F.linear(x, w[f"{p}{name}.weight"], w.get(f"{p}{name}.bias"))

        q = proj("self_attn.q_proj", x).view(b, t, nq, hd).transpose(1, 2)
        k = proj("self_attn.k_proj", x).view(b, t, nkv, hd).transpose(1, 2)
        v = proj("self_attn.v_proj", x).view(b, t, nkv, hd).transpose(1, 2)
        cos, sin = step.rope(hd, a.theta)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = attend(i, q, k, v, step, scale=hd**-0.5)
        h = h + proj("self_attn.o_proj", y.transpose(1, 2).reshape(b, t, nq * hd))
        x = self._norm(h, w[p + "post_attention_layernorm.weight"])
        return h + proj("mlp.down_proj", F.silu(proj("mlp.gate_proj", x)) * proj("mlp.up_proj", x))

    def head(self, w: Mapping[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        h = self._norm(h, w["model.norm.weight"])
        return F.linear(h, w["model.embed_tokens.weight" if self.tied else "lm_head.weight"])
