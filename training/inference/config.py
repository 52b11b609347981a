"""Which model a weight source holds, from its config: Hugging Face config.json or a UCP manifest.

* a directory with ``config.json`` of ``model_type`` ``llama`` (or no model_type but Llama's keys):
  :class:`~training.inference.llama.Llama`;
* ``config.json`` of ``model_type`` ``ucp-gpt`` holding :class:`~training.models.gpt.GPTConfig`'s fields,
  or a UCP checkpoint whose metadata ``model`` holds them (what ``training`` saves): the reference GPT;
* a UCP checkpoint whose metadata ``hf_config`` holds a Llama config.json's content.

A training checkpoint's tensors sit under ``model.`` (``model.embed.weight``); the GPT is then read
with that prefix stripped.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

from pydantic import ValidationError

from training.inference.errors import ModelConfigError
from training.inference.llama import Llama, parse_llama, read_config, validation_text
from training.inference.model import StreamModel
from training.inference.sources import WeightSource
from training.models.gpt import GPTConfig

GPT_TYPE = "ucp-gpt"


def _gpt(doc: dict[str, Any], where: str) -> GPTConfig:
    fields = {k: v for k, v in doc.items() if k != "model_type"}
    try:
        return GPTConfig.model_validate(fields)
    except ValidationError as exc:
        raise ModelConfigError(f"{where}: not a usable GPT config: {validation_text(exc)}") from None


def strip_prefix(source: WeightSource, prefix: str) -> WeightSource:
    """The same weights with ``prefix`` taken off every name that has it (others dropped)."""
    tensors = {
        n[len(prefix) :]: replace(t, name=n[len(prefix) :]) for n, t in source.tensors.items() if n.startswith(prefix)
    }
    return WeightSource(source.root, tensors, source.kind, files=source.files, metadata=source.metadata)


def load_model(source: WeightSource, config: str | os.PathLike[str] | None = None) -> tuple[StreamModel, WeightSource]:
    """The model the weights hold and the source to stream it from (names possibly unprefixed)."""
    doc: dict[str, Any] | None = None
    where = ""
    if config is not None:
        where = os.fspath(config)
        doc = read_config(os.path.dirname(os.path.abspath(where))) if os.path.basename(where) == "config.json" else None
        if doc is None:
            import json

            try:
                with open(where, "rb") as fh:
                    doc = json.load(fh)
            except (OSError, ValueError) as exc:
                raise ModelConfigError(f"{where}: unreadable ({exc})") from None
    elif source.files.isfile(os.path.join(source.root, "config.json")):
        where = os.path.join(source.root, "config.json")
        doc = read_config(source.root, source.files)
    elif source.kind == "UCP checkpoint":
        if source.metadata is not None:
            meta = source.metadata
        else:
            from ucp.store.reader import read_checkpoint_manifest

            meta = read_checkpoint_manifest(source.root).metadata
        where = os.path.join(source.root, "manifest.json")
        if isinstance(meta.get("hf_config"), dict):
            doc = dict(meta["hf_config"])
        elif isinstance(meta.get("model"), dict):
            doc = {"model_type": GPT_TYPE, **meta["model"]}
    if doc is None or not isinstance(doc, dict):
        raise ModelConfigError(
            f"{source.root}: no model config: expected config.json, or a UCP checkpoint whose metadata holds "
            "'hf_config' (a Llama config.json) or 'model' (the reference GPT's config)"
        )
    kind = doc.get("model_type", "llama")
    if kind == GPT_TYPE:
        from training.inference.gpt import StreamGPT

        if "embed.weight" not in source and "model.embed.weight" in source:
            source = strip_prefix(source, "model.")
        return StreamGPT(_gpt(doc, where)), source
    if kind != "llama":
        raise ModelConfigError(f"{where}: model_type {kind!r} is not supported (llama, {GPT_TYPE})")
    return Llama(parse_llama(doc, where)), source
