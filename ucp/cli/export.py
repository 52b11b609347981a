"""``ucp export SRC DST``: write a checkpoint's model (or any section) as Hugging Face safetensors or zarr v3.

Exit codes (:func:`ucp.cli.common.exit_code`, as for every command): 0 done; 1 the export failed
while reading or writing (corrupt data, a damaged manifest,
disk full — the message names the tensor or file); 2 bad input (unknown option
value or section, not a checkpoint, DST not empty without --overwrite, DST is SRC
or holds it or lies inside it).
"""

# No ``from __future__ import annotations``: typer reads the parameters' annotations, which would then be
# strings it compiles and evaluates on every run (~2 % of a one-shot command's instructions).

import enum
import math
from typing import Annotated, Optional

import typer

from aio.sizes import SIZE_HELP, format_size
from ucp.cli import startup
from ucp.cli.common import (
    EXIT_BAD_INPUT,
    STORAGE_OPTIONS_HELP,
    exit_code,
    fail,
    fail_with,
    one_line,
    out,
    parse_storage_options,
    prefetching,
    progress_bar,
    small_job_engine,
    source_reads_start,
)
from ucp.cli.timings import phase


class ExportFormat(str, enum.Enum):
    hf = "hf"
    zarr = "zarr"
    ds_universal = "ds-universal"


class CompressorName(str, enum.Enum):
    zstd = "zstd"
    blosc = "blosc"
    none = "none"


def export_cmd(
    src: Annotated[str, typer.Argument(help="Checkpoint directory or fsspec URL.")],
    dst: Annotated[str, typer.Argument(help="Output directory (created; a zarr group for --format zarr).")],
    format: Annotated[
        ExportFormat,
        typer.Option(
            "--format",
            "-f",
            help="hf: a transformers model folder (safetensors, config.json, tokenizer); zarr: a zarr v3 group; "
            "ds-universal: DeepSpeed's universal checkpoint (load_universal) of a training-engine checkpoint.",
        ),
    ] = ExportFormat.hf,
    section: Annotated[
        Optional[str],
        typer.Option(
            "--section",
            help="State subtree to export, e.g. 'model', 'optimizer.exp_avg'; 'all' for every tensor "
            "(full names). Default: 'model' when present, else all.",
        ),
    ] = None,
    dtype: Annotated[
        Optional[str],
        typer.Option(
            "--dtype", help="Cast floating tensors: bf16, fp16, fp32, fp64, fp8_e4m3, fp8_e5m2 (or torch dtype names)."
        ),
    ] = None,
    max_shard_size: Annotated[
        Optional[str],
        typer.Option(
            "--max-shard-size",
            help=f"hf: split into shards of at most this much tensor data (e.g. 2GB, 512MiB; {SIZE_HELP}).",
        ),
    ] = None,
    config: Annotated[
        Optional[str],
        typer.Option(
            "--config",
            help="hf: the config.json to write (a file, or a folder holding one); default: the one recorded in "
            "the checkpoint's metadata (hf_config). Checked against the tensor shapes before writing.",
        ),
    ] = None,
    tokenizer: Annotated[
        Optional[str],
        typer.Option(
            "--tokenizer",
            help="hf: a folder whose tokenizer files (tokenizer.json, tokenizer_config.json, ...) are copied; "
            "default: those ucp convert recorded.",
        ),
    ] = None,
    name_map: Annotated[
        Optional[str],
        typer.Option(
            "--map",
            help="hf: gpt-neox writes the training Engine's reference GPT as GPTNeoXForCausalLM (renamed "
            "tensors, its config.json): the Hugging Face model that computes the same logits.",
        ),
    ] = None,
    tag: Annotated[
        Optional[str],
        typer.Option("--tag", help="ds-universal: the checkpoint folder under DST (default global_step<N>)."),
    ] = None,
    memory_budget: Annotated[
        str,
        typer.Option(
            "--memory-budget",
            help=f"Tensor bytes held in memory at once (a larger tensor is read alone); {SIZE_HELP}.",
        ),
    ] = "512MiB",
    compressor: Annotated[
        CompressorName, typer.Option("--compressor", help="zarr: chunk compression.")
    ] = CompressorName.zstd,
    level: Annotated[
        Optional[int], typer.Option("--level", help="zarr: compression level (zstd 3, blosc 5 by default).")
    ] = None,
    chunk_mb: Annotated[float, typer.Option("--chunk-mb", help="zarr: target chunk size in MiB.")] = 32.0,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace DST if it exists and is not empty.")] = False,
    no_verify: Annotated[bool, typer.Option("--no-verify", help="Skip the CRC-32C check of the data read.")] = False,
    json_output: Annotated[bool, typer.Option("--json", help="Print the ExportReport as JSON on stdout.")] = False,
    storage_options: Annotated[
        Optional[str],
        typer.Option("--storage-options", help="For SRC. " + STORAGE_OPTIONS_HELP),
    ] = None,
) -> None:
    """Export a checkpoint to Hugging Face safetensors or zarr, streaming within a memory budget.

    The output appears under DST only once complete (it is built under a temporary name next to it).
    """
    options = parse_storage_options(storage_options)
    with prefetching(src), small_job_engine(src):
        with startup.imports():
            import ucp
            from ucp.conversion.exporters import ExportError, export, size_option
            from ucp.conversion.exporters.output import check_destination

        source_reads_start()

        kwargs: dict = {}
        if format is ExportFormat.zarr:
            kwargs = {"compressor": compressor.value, "level": level, "chunk_bytes": _chunk_bytes(chunk_mb)}
        else:
            given = [
                name
                for name, value in (
                    ("--compressor", compressor is not CompressorName.zstd),
                    ("--level", level is not None),
                    ("--chunk-mb", chunk_mb != 32.0),
                )
                if value
            ]
            if given:
                raise fail(f"{', '.join(given)} apply to --format zarr only", EXIT_BAD_INPUT)
        try:
            budget = size_option(memory_budget, option="--memory-budget")
            shard = None if max_shard_size is None else size_option(max_shard_size, option="--max-shard-size")
        except ExportError as exc:
            raise fail(str(exc), EXIT_BAD_INPUT) from None
        try:
            check_destination(dst, overwrite=overwrite, src=src)  # before reading: DST must not overlap SRC
            with progress_bar("export (MiB)", enabled=not json_output) as update, phase("io"):

                def progress(done: int, total: int, name: str) -> None:
                    update(-(-done >> 20), -(-total >> 20), name)

                report = export(
                    src,
                    dst,
                    format=format.value,
                    section=section,
                    dtype=dtype,
                    max_shard_size=shard,
                    memory_budget=budget,
                    overwrite=overwrite,
                    verify=not no_verify,
                    progress=progress,
                    storage_options=options,
                    config=config,
                    tokenizer=tokenizer,
                    tag=tag,
                    name_map=name_map,
                    **kwargs,
                )
        except (ucp.CheckpointError, OSError) as exc:
            if exit_code(exc) == EXIT_BAD_INPUT:
                raise fail_with(exc) from None
            raise fail_with(exc, f"export failed, {dst} left unchanged: {one_line(exc)}") from None
        if json_output:
            typer.echo(report.model_dump_json(indent=2))
            return
        cast = f", cast to {report.dtype}" if report.dtype else ""
        what = f"section {report.section!r}" if report.section else "all tensors"
        out.print(
            f"[bold green]exported[/bold green] {what} of {src}: {report.tensors} tensors, "
            f"{format_size(report.bytes)}{cast} -> {report.dst} ({report.format}, {len(report.files)} "
            f"{'array' if report.format == 'zarr' else 'file'}{'' if len(report.files) == 1 else 's'}) in {report.seconds:.2f} s",
            highlight=False,
        )


def _chunk_bytes(chunk_mb: float) -> int:
    """--chunk-mb in bytes; exit 2 unless it is a finite number of MiB of at least one byte."""
    size = chunk_mb * (1 << 20)
    if not math.isfinite(size) or size < 1:
        raise fail(
            f"--chunk-mb must be a finite number of MiB greater than 0 (at least one byte), got {chunk_mb}",
            EXIT_BAD_INPUT,
        )
    return int(size)


def register(app: typer.Typer) -> None:
    app.command("export")(export_cmd)
