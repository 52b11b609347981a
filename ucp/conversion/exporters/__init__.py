"""Exporters: a UCP checkpoint out to other formats (Hugging Face model folders, zarr v3, DeepSpeed universal).

::

    from ucp.conversion.exporters import export
    export("ckpt/step-100", "out/hf", format="hf", dtype="bf16", max_shard_size="5GB", tokenizer="tok/")
    export("ckpt/step-100", "out/model.zarr", format="zarr", compressor="zstd")
    export("ckpt/step-100", "out/ds", format="ds-universal")   # engine.load_checkpoint("out/ds"), load_universal

Both stream: tensors are read in batches bounded by ``memory_budget`` (sharded
tensors assembled from their pieces on the way) and written as they arrive, into
a temporary directory that becomes ``dst`` only once everything is written.
See docs/import-export.md, "Export".
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable, Literal

from pydantic import BaseModel, Field

from ucp.conversion.exporters.options import ExportError, parse_dtype, size_option
from ucp.conversion.exporters.output import check_destination, staged_dir
from ucp.conversion.exporters.selection import Selection, select_tensors
from ucp.conversion.exporters.stream import DEFAULT_MEMORY_BUDGET, plan_batches

Format = Literal["hf", "zarr", "ds-universal"]
FORMATS = ("hf", "zarr", "ds-universal")
ZARR_OPTIONS = frozenset({"compressor", "level", "chunk_bytes"})


class ExportReport(BaseModel):
    """What an export wrote."""

    format: Format
    dst: str
    files: list[str] = Field(
        description="hf: file names in dst; zarr: array names in the group; ds-universal: files under dst"
    )
    tensors: int
    bytes: int = Field(description="bytes of tensor data written (before zarr compression)")
    seconds: float
    section: str = Field(description="the state subtree exported; '' for every tensor")
    dtype: str | None = Field(None, description="the dtype floating tensors were cast to, if any")
    config: str | None = Field(None, description="hf: where config.json came from (None: none written)")


def export(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    format: Format = "hf",
    section: str | None = None,
    dtype: Any = None,
    max_shard_size: int | str | None = None,
    memory_budget: int | str = DEFAULT_MEMORY_BUDGET,
    overwrite: bool = False,
    verify: bool = True,
    progress: Callable[[int, int, str], None] | None = None,
    storage_options: dict[str, Any] | None = None,
    config: str | os.PathLike[str] | dict[str, Any] | None = None,
    tokenizer: str | os.PathLike[str] | None = None,
    tag: str | None = None,
    name_map: str | None = None,
    **zarr_options: Any,
) -> ExportReport:
    """Export checkpoint ``src`` to ``dst`` (a local directory, created; replaced only with ``overwrite``).

    ``section``: the state subtree to export (default ``model`` when present, else
    everything; ``""``/``"all"``: everything under full names). ``dtype``: cast
    floating tensors (``"bf16"``, ``"fp16"``, ``torch.float32``...). ``max_shard_size``
    (hf only): bytes or ``"2GB"``. ``zarr_options`` (zarr only): ``compressor``
    (``zstd``/``blosc``/``none``), ``level``, ``chunk_bytes``. ``progress(done_bytes,
    total_bytes, tensor_name)`` is called after each tensor. Raises ExportError
    (bad option, unknown section, non-empty ``dst``) or ucp's CheckpointError.

    hf only: ``config`` (a config.json file, a folder holding one, or a dict; default: the checkpoint's
    ``metadata.hf_config``) is written as ``config.json`` after a check that it builds a model of the
    exported tensors' shapes (:mod:`.hf_model`); ``tokenizer``: a folder whose tokenizer files are
    copied (default: those recorded by ``ucp convert``); ``name_map="gpt-neox"``: the training Engine's
    reference GPT renamed to ``GPTNeoXForCausalLM`` with its config (:mod:`.gpt_map`). ds-universal only: ``tag``, the folder under
    ``dst`` (default ``global_step<N>``); see :mod:`.ds_universal`.
    """
    from ucp.store.reader import check_data_files, read_manifest
    from ucp.store.storage import open_storage

    if format not in FORMATS:
        raise ExportError(f"format: unknown format {format!r} (choose {', '.join(FORMATS)})")
    unknown = set(zarr_options) - ZARR_OPTIONS
    if unknown:
        raise ExportError(f"unknown options {sorted(unknown)} (zarr takes {sorted(ZARR_OPTIONS)})")
    if format != "hf" and max_shard_size is not None:
        raise ExportError("max_shard_size applies to format 'hf' only")
    if format != "zarr" and zarr_options:
        raise ExportError(f"options {sorted(zarr_options)} apply to format 'zarr' only")
    given = [k for k, v in (("config", config), ("tokenizer", tokenizer), ("name_map", name_map)) if v is not None]
    if format != "hf" and given:
        raise ExportError(f"options {given} apply to format 'hf' only")
    if name_map not in (None, "gpt-neox"):
        raise ExportError(f"name_map: unknown map {name_map!r} (gpt-neox: the reference GPT as GPTNeoXForCausalLM)")
    if name_map is not None and config is not None:
        raise ExportError("name_map writes its own config.json: give config or name_map, not both")
    if format != "ds-universal" and tag is not None:
        raise ExportError("tag applies to format 'ds-universal' only")
    if format == "ds-universal" and (section is not None or dtype is not None):
        raise ExportError("format 'ds-universal' exports the whole training state: no section or dtype")
    cast = parse_dtype(dtype)
    budget = size_option(memory_budget, option="memory_budget")
    shard = None if max_shard_size is None else size_option(max_shard_size, option="max_shard_size")
    if "chunk_bytes" in zarr_options:
        zarr_options["chunk_bytes"] = size_option(zarr_options["chunk_bytes"], option="chunk_bytes")
    if format == "zarr":
        from ucp.conversion.exporters.zarr_export import codecs

        codecs(zarr_options.get("compressor", "zstd"), zarr_options.get("level"))  # bad values fail before any work
    check_destination(dst, overwrite=overwrite, src=src)
    t0 = time.perf_counter()
    storage, name = open_storage(src, storage_options=storage_options)
    with storage:
        manifest = read_manifest(storage, name)
        check_data_files(storage, name, manifest)  # before buffers or output files are sized from its claims
        if format == "ds-universal":
            from ucp.conversion.exporters.ds_universal import export_ds_universal

            with staged_dir(Path(dst), overwrite=overwrite) as out_dir:
                files, count, nbytes = export_ds_universal(
                    storage,
                    name,
                    manifest,
                    out_dir,
                    src=_describe(src),
                    tag=tag,
                    budget=budget,
                    verify=verify,
                    progress=progress,
                )
            return _report(format, dst, t0, files=files, tensors=count, nbytes=nbytes, section="")
        selection = select_tensors(manifest, section, dtype=cast)
        model_files = None
        transforms: dict[str, Any] = {}
        aliases: dict[str, str] = {}
        if format == "hf":
            from ucp.conversion.exporters import gpt_map, hf_model

            model_files = hf_model.resolve(manifest, config=config, tokenizer=tokenizer, src=_describe(src))
            if name_map is not None:  # the training Engine's reference GPT as GPT-NeoX (the same logits)
                gpt = gpt_map.reference_gpt(manifest.metadata)
                if gpt is None:
                    raise ExportError(
                        f"name_map {name_map!r}: {_describe(src)} records no reference-GPT config (metadata.model)"
                    )
                selection, transforms, model_files.config = gpt_map.plan(gpt, selection)
                model_files.config_source = f"{_describe(src)}/manifest.json metadata.model ({gpt_map.ARCH})"
                aliases = gpt_map.CHECK_ALIASES
            if model_files.config is not None:  # before anything is written
                shapes = {t.out_name: t.shape for t in selection.tensors}
                hf_model.check_shapes(model_files.config, shapes, where=str(model_files.config_source), aliases=aliases)
        with staged_dir(Path(dst), overwrite=overwrite) as out_dir:
            if format == "hf":
                from ucp.conversion.exporters.hf import export_hf

                files = export_hf(
                    storage,
                    name,
                    manifest,
                    selection,
                    out_dir,
                    max_shard_size=shard,
                    budget=budget,
                    verify=verify,
                    progress=progress,
                    transforms=transforms,
                )
                assert model_files is not None
                files += hf_model.write(out_dir, model_files)
            else:
                from ucp.conversion.exporters.zarr_export import export_zarr

                files = export_zarr(
                    storage,
                    name,
                    manifest,
                    selection,
                    out_dir,
                    source=_describe(src),
                    cast=cast,
                    budget=budget,
                    verify=verify,
                    progress=progress,
                    **zarr_options,
                )
    return _report(
        format,
        dst,
        t0,
        files=files,
        tensors=len(selection.tensors),
        nbytes=selection.nbytes,
        section=selection.section,
        dtype=str(cast).removeprefix("torch.") if cast is not None else None,
        config=model_files.config_source if model_files is not None and model_files.config is not None else None,
    )


def _report(
    format: Format,
    dst: str | os.PathLike[str],
    t0: float,
    *,
    files: list[str],
    tensors: int,
    nbytes: int,
    section: str,
    dtype: str | None = None,
    config: str | None = None,
) -> ExportReport:
    """The report of an export started at ``t0`` (``perf_counter``) into ``dst``; every format returns one."""
    return ExportReport(
        format=format,
        dst=str(Path(dst).absolute()),
        files=files,
        tensors=tensors,
        bytes=nbytes,
        seconds=round(time.perf_counter() - t0, 3),
        section=section,
        dtype=dtype,
        config=config,
    )


def _describe(src: str | os.PathLike[str]) -> str:
    """The source as recorded in the output: absolute for local paths, the URL otherwise."""
    text = os.fspath(src)
    return text if "://" in text else os.path.abspath(text)


__all__ = [
    "ExportError",
    "ExportReport",
    "FORMATS",
    "Selection",
    "export",
    "parse_dtype",
    "size_option",
    "plan_batches",
    "select_tensors",
]
