"""What every run reports: latency, throughput, I/O and memory against the budget."""

from __future__ import annotations

from pydantic import BaseModel

from aio.memstat import meminfo


class InferMetrics(BaseModel):
    """One run's figures (``ucp infer --json`` prints them)."""

    batch: int
    prompt_tokens: int  # longest prompt (the padded prefill length)
    new_tokens: int  # per sequence
    time_to_first_token_s: float
    decode_tokens_per_s: float  # all sequences together
    decode_tokens_per_s_per_seq: float
    bytes_read: int  # weights read from disk during generation (resident tensors excluded)
    bytes_read_per_token: float  # per generated token (all sequences)
    streamed_bytes_per_pass: int
    read_gb_per_s: float  # bytes_read / the reader's time in reads
    read_hidden_fraction: float  # share of read time overlapped with compute
    resident_bytes: int
    ring_bytes: int
    budget_bytes: int
    prefetch_depth: int
    pinned_layers: int = 0  # whole layers kept resident (in resident_bytes)
    streamed_layers: int = 0  # groups read every pass (layers, plus embedding and head when not resident)
    pinned_tensors: int = 0  # layer tensors kept resident one by one (cpu path; in resident_bytes)
    kv_cache_bytes: int  # the whole KV cache of the largest batch
    kv_offloaded: bool = False  # a batch's KV cache exceeded its budget and lived on disk
    kv_resident_bytes: int = 0  # memory holding K/V: the whole cache, or the layer buffers when offloaded
    kv_bytes_read: int = 0  # K/V read back from disk (offloaded)
    kv_bytes_written: int = 0  # K/V written to disk (offloaded)
    kv_read_seconds: float = 0.0  # the KV reader's time inside reads
    kv_wait_seconds: float = 0.0  # compute's time waiting for a layer's K/V
    peak_rss_bytes: int
    page_cache_growth_bytes: int  # Cached in /proc/meminfo, after - before (near 0 on the O_DIRECT path)
    engine: str
    device: str = "cpu"  # where compute ran
    read_path: str = "cpu"  # how weights reached it: cpu (host ring), staged (host -> device copies), gds (KvikIO)
    read_path_reason: str = ""  # "asked for", "auto on <device>", or why auto fell back from gds to staged
    pinned_bytes: int = 0  # host memory pinned for weight reads (staging buffers), beside budget_bytes
    staging_bytes: int = 0  # host staging buffers between disk and device (staged path), pinned or not


def page_cache_bytes() -> int:
    """The system's page cache (``Cached``), 0 where /proc/meminfo is absent."""
    return meminfo("Cached") or 0
