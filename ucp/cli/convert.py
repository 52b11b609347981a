"""``ucp convert SRC DST``: turn a DeepSpeed (native or universal), PyTorch DCP or Hugging Face
safetensors checkpoint into a UCP checkpoint.

SRC is a local path; DST a local path or an fsspec URL (``s3://bucket/ckpt``), written by ``ucp.save``.

Exit codes (:func:`ucp.cli.common.exit_code`, as for every command): 0 converted; 1 SRC is damaged
or incomplete (a malformed file, a missing shard) or writing failed (storage error); 2 bad input: SRC
does not exist or is not a checkpoint of a known format, a pickle needs --trust-pickle, a URL SRC,
or DST exists (without --overwrite, or is not a UCP checkpoint, or holds SRC).
"""

# No ``from __future__ import annotations``: typer reads the parameters' annotations, which would then be
# strings it compiles and evaluates on every run (~2 % of a one-shot command's instructions).

from pathlib import Path
from typing import Annotated, Optional

import typer

from ucp.cli import startup
from ucp.cli.common import (
    EXIT_BAD_INPUT,
    STORAGE_OPTIONS_HELP,
    err,
    fail,
    fail_with,
    out,
    prefetching,
    progress_bar,
    scoped_url_options,
    small_job_engine,
    source_reads_start,
    url_storage_options,
)
from ucp.cli.timings import phase

FORMAT_CHOICES = ("auto", "deepspeed", "deepspeed-universal", "dcp", "hf")


def convert_cmd(
    src: Annotated[
        str,
        typer.Argument(
            help="Foreign checkpoint: a DeepSpeed root or tag folder, a universal "
            "folder, a DCP folder, or safetensors (file, index or folder)."
        ),
    ],
    dst: Annotated[
        str,
        typer.Argument(
            help="Where to write the UCP checkpoint: a path or fsspec URL (must not exist unless --overwrite)."
        ),
    ],
    source_format: Annotated[str, typer.Option("--from", help="Source format: " + " | ".join(FORMAT_CHOICES))] = "auto",
    trust_pickle: Annotated[
        bool,
        typer.Option(
            "--trust-pickle",
            help="Allow a full unpickle of files that need classes outside the safe allow-list "
            "(runs code from the files: only for checkpoints you trust).",
        ),
    ] = False,
    force: Annotated[
        bool, typer.Option("--overwrite", "--force", help="Replace a UCP checkpoint already at DST.")
    ] = False,
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON object (the report) on stdout.")] = False,
    storage_options: Annotated[Optional[str], typer.Option("--storage-options", help=STORAGE_OPTIONS_HELP)] = None,
) -> None:
    """Convert a foreign checkpoint into a UCP checkpoint (DeepSpeed ZeRO-1/2/3, universal, DCP, Hugging Face).

    DeepSpeed checkpoints become the training Engine's structure (weights, fp32 masters, Adam moments, step), loadable at any mesh and ZeRO stage. Pickles are read with an allow-list; see --trust-pickle.
    """
    url_storage_options(storage_options)  # DST's, where it is a URL
    if source_format not in FORMAT_CHOICES:
        raise fail(
            f"unknown format {source_format!r} for --from; choose one of {', '.join(FORMAT_CHOICES)}", EXIT_BAD_INPUT
        )
    with prefetching(_source_folder(src, source_format), marker=None), small_job_engine(src):
        with startup.imports():
            import ucp
            from aio.sizes import format_size
            from ucp.conversion.importers import convert

        source_reads_start()

        try:
            with (
                progress_bar(f"convert ({source_format})", enabled=not json_output, percent=True) as update,
                phase("io"),
            ):
                report = convert(
                    src, dst, source_format=source_format, trust_pickle=trust_pickle, overwrite=force, progress=update
                )
        except (ucp.CheckpointError, OSError) as exc:
            raise fail_with(exc) from None
        if json_output:
            typer.echo(report.model_dump_json(indent=2))
            return
        rate = report.bytes / report.seconds / 1e9 if report.seconds > 0 else 0.0
        out.print(
            f"[bold green]converted[/bold green] {report.format} {report.src} -> {report.dst}: "
            f"{report.tensors} tensors, {format_size(report.bytes)}, step {report.step}, "
            f"{report.seconds:.2f} s ({rate:.2f} GB/s)",
            highlight=False,
        )
        if trust_pickle:
            err.print(
                "[yellow]note:[/yellow] --trust-pickle: any file outside the allow-list was fully unpickled",
                highlight=False,
            )


def _source_folder(src: str, source_format: str) -> str | None:
    """What to prefetch: SRC, or a DeepSpeed root's current tag folder (a root may hold many tags);
    None when SRC does not look like a checkpoint (no ``*.pt``, ``*.safetensors``, ``*.distcp``,
    ``.metadata`` or ``zero/`` at its top), so a mistyped path is not read into memory."""
    root = Path(src)
    pointer = "latest_universal" if source_format == "deepspeed-universal" else "latest"
    try:
        tag = (root / pointer).read_text().strip() if (root / pointer).is_file() else ""
        if tag and "/" not in tag and tag not in (".", "..") and (root / tag).is_dir():
            root = root / tag
        if root.is_file():
            return str(root)
        names = [p.name for p in root.iterdir()] if root.is_dir() else []
    except OSError:
        return None
    markers = (".pt", ".safetensors", ".distcp", ".metadata")
    return str(root) if any(n.endswith(markers) or n == "zero" for n in names) else None


def register(app: typer.Typer) -> None:
    app.command("convert")(scoped_url_options(convert_cmd))
