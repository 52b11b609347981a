"""Importers: foreign checkpoints (DeepSpeed ZeRO, DeepSpeed universal, PyTorch DCP, Hugging Face
safetensors) read into UCP checkpoints, without unpickling untrusted code.

::

    from ucp.conversion.importers import convert, detect
    detect("runs/ds/")                          # "deepspeed"
    report = convert("runs/ds/", "ckpt/step-3")  # ConvertReport(format=..., tensors=..., bytes=..., seconds=...)

DeepSpeed checkpoints come out in the training Engine's structure (``model`` / ``optimizer`` with
``fp32_master``, ``exp_avg``, ``exp_avg_sq`` / ``step`` / ``scheduler`` / ``rng``), so
``training.Engine(...).load(dst)`` resumes them at any mesh and ZeRO stage. See docs/import-export.md.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable, Literal

from pydantic import BaseModel, Field

from ucp.conversion.importers.common import Imported, Progress, count_stored
from ucp.conversion.importers.errors import ForeignCheckpointError, UnknownFormatError, UnsafePickleError
from ucp.errors import DestinationError

FORMATS = ("deepspeed", "deepspeed-universal", "dcp", "hf")
SourceFormat = Literal["auto", "deepspeed", "deepspeed-universal", "dcp", "hf"]

__all__ = [
    "FORMATS",
    "ConvertReport",
    "ForeignCheckpointError",
    "Imported",
    "UnknownFormatError",
    "UnsafePickleError",
    "convert",
    "detect",
    "read",
]


class ConvertReport(BaseModel):
    """What a conversion did (``ucp convert --json`` prints it)."""

    format: str = Field(description="the source format")
    src: str
    dst: str
    step: int | None = None
    tensors: int = Field(description="logical tensors in the UCP checkpoint")
    bytes: int = Field(description="bytes of the UCP checkpoint's data files")
    seconds: float = Field(description="wall time of read + write")


def detect(path: str | os.PathLike[str]) -> str:
    """The format of the checkpoint at ``path``: deepspeed | deepspeed-universal | dcp | hf | ucp.

    A DeepSpeed root holding both its native tag and a universal conversion is "deepspeed".
    """
    p = _local_source(path)
    if not p.exists():
        raise UnknownFormatError(f"{str(p)!r}: no such file or directory", file=str(p))
    if p.is_file():
        if p.suffix == ".safetensors" or p.name.endswith(".index.json"):
            return "hf"
        raise UnknownFormatError(
            f"file {str(p)!r} is not a checkpoint format ucp convert knows "
            "(a checkpoint is a folder, or a .safetensors / .index.json file)",
            file=str(p),
        )
    names = {f.name for f in p.iterdir()}
    if "manifest.json" in names:
        return "ucp"
    if ".metadata" in names and any(n.endswith(".distcp") for n in names):
        return "dcp"
    if "latest" in names or any(n.endswith("_optim_states.pt") for n in names):
        return "deepspeed"
    if "latest_universal" in names or ("zero" in names and any(n.endswith("_model_states.pt") for n in names)):
        return "deepspeed-universal"
    if (
        "model.safetensors" in names
        or "model.safetensors.index.json" in names
        or sum(n.endswith(".safetensors") for n in names) == 1
    ):
        return "hf"
    if ".metadata" in names:
        return "dcp"
    raise UnknownFormatError(
        f"{str(p)!r} is not a checkpoint of a known format (DeepSpeed: 'latest' or "
        "*_optim_states.pt; universal: zero/; DCP: .metadata; Hugging Face: *.safetensors; "
        "UCP: manifest.json)",
        file=str(p),
    )


def read(
    src: str | os.PathLike[str],
    source_format: str = "auto",
    *,
    trust_pickle: bool = False,
    progress: Progress | None = None,
    on_disk: bool = False,
) -> tuple[str, Imported]:
    """Read a foreign checkpoint into memory-mapped leaves; ``(format, Imported)``.

    ``on_disk``: a DeepSpeed (native or universal) or safetensors checkpoint's leaves may come back as byte ranges of its files
    (:mod:`.stored`, read without torch) instead of torch tensors; ``convert`` copies those.
    """
    src = _local_source(src)
    fmt = detect(src) if source_format == "auto" else source_format
    if fmt == "ucp":
        raise UnknownFormatError(f"{str(src)!r} is already a UCP checkpoint", file=str(src))
    if fmt == "deepspeed":
        from ucp.conversion.importers.deepspeed import read_deepspeed

        return fmt, read_deepspeed(src, trust_pickle=trust_pickle, progress=progress, on_disk=on_disk)
    if fmt == "deepspeed-universal":
        from ucp.conversion.importers.universal import read_universal

        return fmt, read_universal(src, trust_pickle=trust_pickle, progress=progress, on_disk=on_disk)
    if fmt == "dcp":
        from ucp.conversion.importers.dcp import read_dcp

        return fmt, read_dcp(src, trust_pickle=trust_pickle, progress=progress)
    if fmt == "hf":
        from ucp.conversion.importers.hf import read_hf

        return fmt, read_hf(src, trust_pickle=trust_pickle, progress=progress, on_disk=on_disk)
    raise UnknownFormatError(f"unknown source format {fmt!r}; known: auto, {', '.join(FORMATS)}")


def convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    source_format: SourceFormat | str = "auto",
    trust_pickle: bool = False,
    overwrite: bool = False,
    progress: Callable[[int, int, str], None] | None = None,
) -> ConvertReport:
    """Convert the checkpoint at ``src`` into a UCP checkpoint at ``dst`` (written atomically).

    ``src`` is a local path; ``dst`` a local path or an fsspec URL (``s3://...``: written by
    ``ucp.save``). ``dst`` must not exist unless ``overwrite`` (then only a UCP checkpoint there is
    replaced, and never one holding ``src``), so a typo cannot swap away a folder of other data. A
    ``dst`` that is a symlink to a checkpoint is replaced as a link; its target is left untouched.
    ``progress(done, total, what)`` is called while reading, then while writing.

    A DeepSpeed or safetensors checkpoint whose tensors the torch-free reader can describe (the usual case) is
    copied byte range by byte range into one consolidated file (:func:`.write_stored.write_stored`:
    no torch, no tensor in memory); anything else is read into tensors and written by ``ucp.save``.
    """
    t0 = time.perf_counter()
    s, d = _local_source(src), os.fspath(dst)
    _check_destination(s, d, overwrite=overwrite)
    fmt, imported = read(s, source_format, trust_pickle=trust_pickle, progress=progress, on_disk=True)
    if count_stored(imported.state):
        from ucp.conversion.importers.write_stored import write_stored

        manifest = write_stored(imported, d, overwrite=overwrite, progress=progress)
    else:
        from ucp.saving.sync_save import save

        name = d.rstrip("/").rsplit("/", 1)[-1]
        if progress:
            progress(0, 1, f"writing {name}")
        manifest = save(imported.state, d, step=imported.step, metadata=imported.metadata)
        if progress:
            progress(1, 1, f"wrote {name}")
    return ConvertReport(
        format=fmt,
        src=str(s),
        dst=d,
        step=manifest.step,
        tensors=len(manifest.tensors),
        bytes=sum(f.size for f in manifest.files.values()),
        seconds=round(time.perf_counter() - t0, 3),
    )


def _local_source(src: str | os.PathLike[str]) -> Path:
    """``src`` as a local Path; UnknownFormatError for a URL (foreign checkpoints are read from local paths)."""
    text = os.fspath(src)
    if "://" in text:
        raise UnknownFormatError(
            f"source {text!r}: foreign checkpoints are read from local paths only (copy it to a local folder first)",
            file=text,
        )
    return Path(text)


def _check_destination(src: Path, dst: str, *, overwrite: bool) -> None:
    """DestinationError unless ``dst`` is free, or (``overwrite``) a UCP checkpoint not holding ``src``."""
    from ucp.store.storage import open_storage

    try:
        storage, name = open_storage(dst)
    except (ValueError, ImportError) as exc:  # unknown protocol, fsspec backend not installed
        raise DestinationError(f"destination {dst!r}: {exc}", file=dst) from None
    with storage:
        local = storage.local
        exists = storage.exists(name) or (local and os.path.islink(dst))  # a dangling link exists too
        if not exists:
            return
        if not overwrite:
            raise DestinationError(
                f"destination {dst!r} already exists (overwrite=True, or --overwrite, replaces a UCP checkpoint there)",
                file=dst,
            )
        if not storage.exists(f"{name}/manifest.json"):
            raise DestinationError(
                f"destination {dst!r} exists and is not a UCP checkpoint; not replacing it", file=dst
            )
    if local:
        source, target = src.resolve(), Path(dst).resolve()
        if target == source or target in source.parents:
            raise DestinationError(
                f"destination {dst!r} is or holds the source {str(src)!r}; replacing it would delete the source",
                file=dst,
            )
