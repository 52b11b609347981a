"""``ucp infer PATH``: generate with a model larger than memory, its weights streamed from disk.

PATH is a Hugging Face ``save_pretrained`` directory (safetensors, single or sharded, with config.json)
or a UCP checkpoint (its metadata or a config.json saying which model), local or on an S3-compatible
object store (``s3://bucket/prefix``, ``--storage-options`` or the AWS variables: weights stream through
parallel ranged GETs into the same ring buffers). Prompts are text when the
weights come with a tokenizer.json, else token ids ("1 2 3"). ``--json`` prints the tokens and the
run's metrics (time to first token, decode tokens/s, bytes read per token, read GB/s, the share of
read time hidden behind compute, peak RSS, resident bytes against the budget). Whole layers are pinned
in what the budget holds beyond a two-buffer ring (``--no-pin-layers``: none). ``--kv-budget`` caps
the KV cache's memory: a batch's cache beyond it lives in a file under ``--kv-dir``, its layer blocks
read ahead and written back through O_DIRECT (the same tokens as in memory). ``--device cuda`` computes
on the GPU with weights read through ``--read-path`` ``gds`` (KvikIO into device buffers) or ``staged``
(pinned host buffers, async copies); not yet run on a GPU (``tools/gpu_check_infer.py`` is the check).

Exit codes: 0 done, 2 bad input (a missing file, a lying header, a config that does not fit the
weights, a budget below the largest layer, a bad prompt), 1 an I/O failure.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from aio.sizes import SIZE_HELP, format_size, parse_size
from ucp.cli.common import STORAGE_OPTIONS_HELP, fail_with, out, parse_storage_options, progress_bar
from ucp.cli.inspect import bad_input


def _prompts(prompt: list[str] | None, prompts_file: Path | None) -> list[str]:
    if bool(prompt) == (prompts_file is not None):
        raise bad_input("give --prompt (repeatable) or --prompts-file, not both and not neither")
    if prompts_file is None:
        return list(prompt or [])
    try:
        lines = prompts_file.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise bad_input(f"{prompts_file}: cannot read the prompts file ({exc})") from None
    got = [line for line in lines if line.strip()]
    if not got:
        raise bad_input(f"{prompts_file}: no prompts (one per line)")
    return got


def infer_cmd(
    path: Annotated[
        str,
        typer.Argument(help="Weights: a Hugging Face safetensors directory or a UCP checkpoint (a path or s3:// URL)."),
    ],
    prompt: Annotated[
        Optional[list[str]],
        typer.Option("--prompt", help="A prompt (repeatable): text, or token ids without a tokenizer."),
    ] = None,
    prompts_file: Annotated[Optional[Path], typer.Option("--prompts-file", help="One prompt per line.")] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", min=1, help="Tokens generated per prompt.")] = 16,
    batch_size: Annotated[
        Optional[int], typer.Option("--batch-size", min=1, help="Prompts per batch (default: all).")
    ] = None,
    memory_budget: Annotated[
        str, typer.Option("--memory-budget", help=f"Weight memory: ring buffers + resident tensors ({SIZE_HELP}).")
    ] = "512MiB",
    prefetch: Annotated[
        Optional[int],
        typer.Option(
            "--prefetch",
            min=0,
            help="Read-ahead: the ring holds PREFETCH + 1 of the largest streamed parts (cpu path) or layers "
            "(staged/gds); 0: no overlap (default: what the budget allows).",
        ),
    ] = None,
    temperature: Annotated[float, typer.Option("--temperature", min=0.0, help="0: greedy.")] = 0.0,
    top_k: Annotated[int, typer.Option("--top-k", min=0, help="Sample among the k likeliest (0: all).")] = 0,
    top_p: Annotated[float, typer.Option("--top-p", min=0.0, max=1.0, help="Nucleus sampling mass (1: off).")] = 1.0,
    seed: Annotated[int, typer.Option("--seed", help="Sampling seed.")] = 0,
    dtype: Annotated[
        str,
        typer.Option(
            "--dtype",
            help="Compute dtype: float32, bfloat16 or float16 (weights of another dtype are converted layer by layer).",
        ),
    ] = "float32",
    config: Annotated[
        Optional[Path], typer.Option("--config", help="A config.json to use instead of the weights' own.")
    ] = None,
    pin_layers: Annotated[
        bool,
        typer.Option(
            "--pin-layers/--no-pin-layers",
            help="Keep layer weights resident in the budget beyond the ring: single tensors, largest first (cpu "
            "path), whole layers (staged/gds); fewer bytes read per token.",
        ),
    ] = True,
    kv_budget: Annotated[
        Optional[str],
        typer.Option(
            "--kv-budget",
            help=f"KV cache memory: a batch's cache beyond it lives on disk, layer blocks read ahead ({SIZE_HELP}; "
            "default: no limit, in memory).",
        ),
    ] = None,
    kv_dir: Annotated[
        Optional[Path], typer.Option("--kv-dir", help="Where an offloaded KV cache's file goes (default: $TMPDIR).")
    ] = None,
    device: Annotated[
        str, typer.Option("--device", help="Where compute runs: cpu or cuda[:N] (the budget then counts GPU memory).")
    ] = "cpu",
    read_path: Annotated[
        Optional[str],
        typer.Option(
            "--read-path",
            help="How weights reach the device: cpu, staged (pinned host buffers, async copies) or gds (KvikIO "
            "into GPU memory; the 'gds' extra). Default: cpu on the CPU, gds where KvikIO imports, else staged.",
        ),
    ] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON object: outputs and metrics.")] = False,
    storage_options: Annotated[Optional[str], typer.Option("--storage-options", help=STORAGE_OPTIONS_HELP)] = None,
) -> None:
    """Generate text with weights streamed from disk (or an object store), layer by layer, within a memory budget."""
    texts = _prompts(prompt, prompts_file)
    options = parse_storage_options(storage_options)
    try:
        budget = parse_size(memory_budget, what="--memory-budget")
        kv_bytes = None if kv_budget is None else parse_size(kv_budget, what="--kv-budget")
    except ValueError as exc:
        raise bad_input(str(exc)) from None
    if top_p <= 0.0:
        raise bad_input("--top-p must be > 0")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise bad_input(f"--dtype {dtype!r}: expected float32, bfloat16 or float16")
    import torch  # heavy: imported once the options are known good

    from training.inference.api import infer
    from training.inference.generate import Sampling

    sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    try:
        with progress_bar("generating", enabled=not json_output) as update:
            result = infer(
                path,
                texts,
                max_new_tokens=max_new_tokens,
                batch_size=batch_size,
                memory_budget=budget,
                prefetch=prefetch,
                sampling=sampling,
                dtype=getattr(torch, dtype),
                config=config,
                kv_budget=kv_bytes,
                pin_layers=pin_layers,
                kv_dir=kv_dir,
                device=device,
                read_path=read_path,
                storage_options=options,
                progress=lambda done, total: update(done, total, "tokens"),
            )
    except (ValueError, OSError) as exc:
        raise fail_with(exc) from None
    m = result.metrics
    if json_output:
        outputs = [{"prompt": p, "tokens": t, "text": x} for p, t, x in zip(texts, result.tokens, result.texts)]
        print(json.dumps({"outputs": outputs, "metrics": m.model_dump()}, indent=2))
        return
    for p, toks, text in zip(texts, result.tokens, result.texts):
        shown = text if text is not None else " ".join(map(str, toks))
        out.print(f"[bold]{escape(p)}[/bold] -> {escape(shown)}", highlight=False)
    out.print(
        f"first token {m.time_to_first_token_s:.3f} s, decode {m.decode_tokens_per_s:.1f} tokens/s, "
        f"{format_size(int(m.bytes_read_per_token))} read per token at {m.read_gb_per_s:.2f} GB/s "
        f"({m.read_hidden_fraction:.0%} hidden), resident {format_size(m.resident_bytes)} + ring "
        f"{format_size(m.ring_bytes)} of {format_size(m.budget_bytes)}, peak RSS {format_size(m.peak_rss_bytes)}; "
        f"on {m.device} via the {m.read_path} read path (pinned {format_size(m.pinned_bytes)})",
        highlight=False,
    )
    if m.kv_offloaded:
        out.print(
            f"KV cache on disk: {format_size(m.kv_cache_bytes)}, {format_size(m.kv_resident_bytes)} in memory, "
            f"{format_size(m.kv_bytes_read)} read, {format_size(m.kv_bytes_written)} written",
            highlight=False,
        )


def register(app: typer.Typer) -> None:
    app.command("infer")(infer_cmd)
