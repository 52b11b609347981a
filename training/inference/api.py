"""``infer``: the Python API behind ``ucp infer`` — open weights, plan the budget, generate, measure."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import torch

from aio import AioConfig
from aio.memstat import peak_rss
from training.inference.config import load_model
from training.inference.executor import Executor
from training.inference.generate import Generated, Sampling, generate
from training.inference.metrics import InferMetrics, page_cache_bytes
from training.inference.sources import open_weights
from training.inference.tokens import Tokenizer


@dataclass
class InferResult:
    """Per prompt: the new token ids and their text (None without a tokenizer); the run's metrics."""

    tokens: list[list[int]]
    texts: list[str | None]
    metrics: InferMetrics


def infer(
    path: str | os.PathLike[str],
    prompts: list[str] | list[list[int]],
    *,
    max_new_tokens: int = 16,
    batch_size: int | None = None,
    memory_budget: int = 512 << 20,
    prefetch: int | None = None,
    sampling: Sampling | None = None,
    dtype: torch.dtype = torch.float32,
    config: str | os.PathLike[str] | None = None,
    aio_config: AioConfig | None = None,
    progress: Callable[[int, int], None] | None = None,
    kv_budget: int | None = None,
    kv_dir: str | os.PathLike[str] | None = None,
    pin_layers: bool = True,
    device: str | torch.device = "cpu",
    read_path: str | None = None,
    storage_options: dict[str, Any] | None = None,
) -> InferResult:
    """Generate for ``prompts`` (text, tokenized by the weights' tokenizer.json, or lists of ids) with
    weights streamed from ``path`` within ``memory_budget`` bytes, ``batch_size`` prompts per batch.
    A batch's KV cache stays in memory unless it needs more than ``kv_budget`` bytes; then it lives in
    a temporary file under ``kv_dir``, read and written layer by layer through ``kv_budget`` bytes of
    buffers. ``pin_layers``: keep layer weights resident in what the budget holds beyond the ring
    (:mod:`training.inference.plan`: single tensors on the cpu path, whole layers on the device paths).
    ``progress(done, total)`` counts token steps over all batches.
    ``device``: where compute runs (``cuda``: the budget counts GPU memory, the KV cache lives there);
    ``read_path`` (``cpu``, ``staged``, ``gds``; None: chosen for the device, see
    :mod:`training.inference.device`) says how weights reach it; the metrics record both. ``path`` may be an
    ``s3://`` URL (``storage_options``: :class:`ucp.store.s3.S3Options`; default the AWS variables): weights
    then stream through ranged GETs into the same ring (:mod:`training.inference.files`)."""
    source = open_weights(path, storage_options)
    model, source = load_model(source, config)
    tok = Tokenizer.for_weights(source.root, source.files)
    ids = [p if isinstance(p, list) else tok.encode(p) for p in prompts]
    vocab = getattr(getattr(model, "args", None), "vocab_size", None) or getattr(
        getattr(model, "cfg", None), "vocab_size", None
    )
    bs = batch_size or len(ids)
    cache_before = page_cache_bytes()
    results: list[Generated] = []
    total = -(-len(ids) // bs) * max_new_tokens  # token steps over all batches (progress)
    with Executor(
        model,
        source,
        memory_budget,
        prefetch=prefetch,
        dtype=dtype,
        aio_config=aio_config,
        pin_layers=pin_layers,
        device=device,
        read_path=read_path,
    ) as ex:
        for i in range(0, len(ids), bs):
            done = i // bs * max_new_tokens
            tick = None if progress is None else (lambda n, done=done: progress(done + n, total))
            results.append(
                generate(
                    ex,
                    ids[i : i + bs],
                    max_new_tokens,
                    sampling,
                    vocab_size=vocab,
                    on_token=tick,
                    kv_budget=kv_budget,
                    kv_dir=kv_dir,
                )
            )
        stats, plan, engine = ex.stats, ex.plan, ex.handle.engine_name
        where, path, pinned, staging = str(ex.device), ex.read_path, ex.pinned_bytes, ex.staging_bytes
        why = ex.read_path_reason
    tokens = [t for r in results for t in r.tokens]
    decode_s = sum(r.decode_seconds for r in results)
    decode_tokens = sum(r.decode_steps * r.batch for r in results)
    generated = sum(len(t) for t in tokens)
    metrics = InferMetrics(
        batch=bs,
        prompt_tokens=max(len(p) for p in ids),
        new_tokens=max_new_tokens,
        time_to_first_token_s=results[0].prefill_seconds,
        decode_tokens_per_s=decode_tokens / decode_s if decode_s > 0 else 0.0,
        decode_tokens_per_s_per_seq=sum(r.decode_steps for r in results) / decode_s if decode_s > 0 else 0.0,
        bytes_read=stats.bytes_read,
        bytes_read_per_token=stats.bytes_read / generated,
        streamed_bytes_per_pass=plan.streamed_bytes_per_pass,
        read_gb_per_s=stats.bytes_read / stats.read_seconds / 1e9 if stats.read_seconds > 0 else 0.0,
        read_hidden_fraction=stats.hidden_fraction,
        resident_bytes=plan.resident_bytes,
        ring_bytes=plan.ring_bytes,
        budget_bytes=plan.budget,
        prefetch_depth=plan.prefetch,
        pinned_layers=len(plan.pinned),
        streamed_layers=len(plan.streamed),
        pinned_tensors=len(plan.pinned_tensors),
        kv_cache_bytes=max(r.kv.total_bytes for r in results),
        kv_offloaded=any(r.kv.offloaded for r in results),
        kv_resident_bytes=max(r.kv.resident_bytes for r in results),
        kv_bytes_read=sum(r.kv.bytes_read for r in results),
        kv_bytes_written=sum(r.kv.bytes_written for r in results),
        kv_read_seconds=sum(r.kv.read_seconds for r in results),
        kv_wait_seconds=sum(r.kv.wait_seconds for r in results),
        peak_rss_bytes=peak_rss(),
        page_cache_growth_bytes=page_cache_bytes() - cache_before,
        engine=engine if path != "gds" else "kvikio",
        device=where,
        read_path=path,
        read_path_reason=why,
        pinned_bytes=pinned,
        staging_bytes=staging,
    )
    return InferResult(tokens, [tok.decode(t) for t in tokens], metrics)
