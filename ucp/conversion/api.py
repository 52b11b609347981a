"""``ucp.reshape``, ``ucp.convert``, ``ucp.export``: the command line's conversions as functions, same options.

::

    ucp.reshape("ckpt/step-100", "ckpt/tp4", tp=4, zero=1)          # ucp reshape SRC DST --tp 4 --zero 1
    ucp.convert("ds_ckpt/", "ckpt/from-ds")                        # ucp convert SRC DST
    ucp.export("ckpt/step-100", "hf_out/", format="hf", dtype="bf16", max_shard_size="2GB")

The command line calls these same functions (``ucp.cli.reshape`` takes its target layout from
:func:`target_layout`), so a function and its command write the same files. Every error is a
:class:`ucp.CheckpointError` or an ``OSError``: a bad target layout (``reshard.LayoutError``) is
raised as a :class:`ucp.LayoutMismatchError` naming the option at fault.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from reshard import Layout, LayoutError, plain_layout
from ucp.errors import CorruptCheckpointError, LayoutMismatchError

if TYPE_CHECKING:  # the converters are imported when called: the command line imports this module early
    from ucp.conversion.exporters import ExportReport
    from ucp.conversion.importers import ConvertReport
    from ucp.conversion.reshape import ReshapeReport

DEFAULT_MEMORY_BUDGET = 384 << 20  # ucp.conversion.reshape.DEFAULT_MEMORY_BUDGET (checked equal in the tests)

Progress = Callable[[int, int, str], None]


def target_layout(
    src: str | os.PathLike[str],
    *,
    tp: int | None = None,
    pp: int | None = None,
    dp: int | None = None,
    zero: int | None = None,
    layout: Layout | str | os.PathLike[str] | None = None,
) -> Layout | None:
    """The layout to reshape ``src`` to: ``layout`` (a Layout, or a layout JSON file), else the one ``src``
    recorded (``metadata.layout``), else plain DP/ZeRO; with the mesh axes and ZeRO stage given changed.
    None (consolidate) when nothing is given. Raises ``reshard.LayoutError`` (the CLI shows its diagram)."""
    from pydantic import ValidationError

    from reshard.layout import validation_line
    from ucp.conversion.placement import recorded_layout
    from ucp.store.reader import read_checkpoint_manifest

    flags = {k: v for k, v in (("tp", tp), ("pp", pp), ("dp", dp)) if v is not None}
    if layout is None and not flags and zero is None:
        return None
    if isinstance(layout, Layout):
        base = layout
    elif layout is not None:
        base = Layout.load(Path(layout))
    else:
        manifest = read_checkpoint_manifest(src)
        recorded = recorded_layout(manifest, source=f"{os.fspath(src)}/manifest.json").layout
        if recorded is None:
            split = [f"--{k} {v}" for k, v in flags.items() if k in ("tp", "pp") and v > 1]
            if split:
                raise LayoutError(
                    f"{os.fspath(src)} records no layout (metadata.layout), and {' '.join(split)} needs one to know "
                    "how tensors split: give one with --layout FILE or --model PRESET (--dp/--zero need none)"
                )
            base = plain_layout()  # plain DP/ZeRO: every tensor replicated, the parameters one ZeRO group
        else:
            base = recorded
    stage = base.zero.stage if zero is None else zero
    try:
        mesh = type(base.mesh).model_validate(base.mesh.model_copy(update=flags).model_dump())
        return base.replace(mesh=mesh, zero=base.zero.model_copy(update={"stage": stage}))
    except ValidationError as exc:
        raise LayoutError(f"target layout: {validation_line(exc)}") from None


def reshape(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    tp: int | None = None,
    pp: int | None = None,
    dp: int | None = None,
    zero: int | None = None,
    layout: Layout | str | os.PathLike[str] | None = None,
    memory_budget: int | str = DEFAULT_MEMORY_BUDGET,
    workers: int = 2,
    overwrite: bool = False,
    verify: bool = False,
    progress: Progress | None = None,
) -> ReshapeReport:
    """``ucp reshape SRC DST [--tp/--pp/--dp/--zero/--layout/--memory-budget/--workers/--overwrite/--verify]``.

    The target is :func:`target_layout` (nothing given: consolidate into one piece per tensor).
    ``memory_budget``: bytes or a size (``"384MiB"``), at least 1 MiB. ``verify``: read ``dst`` back
    and check every CRC; CorruptCheckpointError naming the problems when one fails. (The CLI's
    ``--model PRESET`` is the training package's: pass ``layout=training.layout.gpt_layout(...)``.)
    """
    from aio.sizes import parse_size
    from ucp.conversion.reshape import MIN_MEMORY_BUDGET
    from ucp.conversion.reshape import reshape as _reshape

    try:
        budget = parse_size(memory_budget, what="memory_budget", minimum=MIN_MEMORY_BUDGET)
    except ValueError as exc:
        raise LayoutMismatchError(str(exc)) from None
    try:
        target = target_layout(src, tp=tp, pp=pp, dp=dp, zero=zero, layout=layout)
        report = _reshape(
            src, dst, layout=target, memory_budget=budget, workers=workers, overwrite=overwrite, progress=progress
        )
    except LayoutError as exc:
        raise LayoutMismatchError(f"reshape of {os.fspath(src)}: {exc}") from exc
    if verify:
        from ucp.loading.verify import verify as _verify

        problems = _verify(dst).problems
        if problems:
            raise CorruptCheckpointError(
                f"reshape wrote {os.fspath(dst)}, but reading it back found {len(problems)} problem(s): "
                + "; ".join(p.message for p in problems[:5])
            )
    return report


def convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    source_format: str = "auto",
    trust_pickle: bool = False,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> ConvertReport:
    """``ucp convert SRC DST [--from FORMAT] [--trust-pickle] [--overwrite]``: a DeepSpeed (native or
    universal), DCP or Hugging Face safetensors checkpoint at ``src`` written as a UCP checkpoint at ``dst``
    (see :func:`ucp.conversion.importers.convert`)."""
    from ucp.conversion.importers import convert as _convert

    return _convert(
        src, dst, source_format=source_format, trust_pickle=trust_pickle, overwrite=overwrite, progress=progress
    )


def export(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    format: str = "hf",
    section: str | None = None,
    dtype: Any = None,
    max_shard_size: int | str | None = None,
    memory_budget: int | str = "512MiB",
    overwrite: bool = False,
    verify: bool = True,
    storage_options: dict[str, Any] | None = None,
    progress: Progress | None = None,
    config: str | os.PathLike[str] | dict[str, Any] | None = None,
    tokenizer: str | os.PathLike[str] | None = None,
    tag: str | None = None,
    name_map: str | None = None,
    **zarr_options: Any,
) -> ExportReport:
    """``ucp export SRC DST [--format hf|zarr|ds-universal] [--section] [--dtype] [--max-shard-size] [--config]
    [--tokenizer] [--map] [--tag] [--memory-budget] ...`` (see :func:`ucp.conversion.exporters.export`; ``zarr_options``:
    ``compressor``, ``level``, ``chunk_bytes``).
    The destination is checked against the source before anything is read, as the command does."""
    from ucp.conversion.exporters import export as _export
    from ucp.conversion.exporters.output import check_destination

    check_destination(dst, overwrite=overwrite, src=src)
    return _export(
        src,
        dst,
        format=format,  # type: ignore[arg-type]  # checked by the exporter, which names a bad value
        section=section,
        dtype=dtype,
        max_shard_size=max_shard_size,
        memory_budget=memory_budget,
        overwrite=overwrite,
        verify=verify,
        progress=progress,
        storage_options=storage_options,
        config=config,
        tokenizer=tokenizer,
        tag=tag,
        name_map=name_map,
        **zarr_options,
    )
