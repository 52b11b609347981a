"""Importers: foreign checkpoints (DeepSpeed ZeRO, DeepSpeed universal, PyTorch DCP, Hugging Face
safetensors) read into UCP checkpoints, without unpickling untrusted code.

::

    from ucp.importers import convert, detect
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

from .common import Imported, Progress
from .errors import ForeignCheckpointError, UnknownFormatError, UnsafePickleError

FORMATS = ("deepspeed", "deepspeed-universal", "dcp", "hf")
SourceFormat = Literal["auto", "deepspeed", "deepspeed-universal", "dcp", "hf"]

__all__ = ["FORMATS", "ConvertReport", "ForeignCheckpointError", "Imported", "UnknownFormatError",
           "UnsafePickleError", "convert", "detect", "read"]


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
    p = Path(path)
    if not p.exists():
        raise UnknownFormatError(f"{str(p)!r}: no such file or directory", file=str(p))
    if p.is_file():
        if p.suffix == ".safetensors" or p.name.endswith(".index.json"):
            return "hf"
        raise UnknownFormatError(f"file {str(p)!r} is not a checkpoint format ucp convert knows "
                                 "(a checkpoint is a folder, or a .safetensors / .index.json file)", file=str(p))
    names = {f.name for f in p.iterdir()}
    if "manifest.json" in names:
        return "ucp"
    if ".metadata" in names and any(n.endswith(".distcp") for n in names):
        return "dcp"
    if "latest" in names or any(n.endswith("_optim_states.pt") for n in names):
        return "deepspeed"
    if "latest_universal" in names or ("zero" in names and any(n.endswith("_model_states.pt") for n in names)):
        return "deepspeed-universal"
    if "model.safetensors" in names or "model.safetensors.index.json" in names \
            or sum(n.endswith(".safetensors") for n in names) == 1:
        return "hf"
    if ".metadata" in names:
        return "dcp"
    raise UnknownFormatError(f"{str(p)!r} is not a checkpoint of a known format (DeepSpeed: 'latest' or "
                             "*_optim_states.pt; universal: zero/; DCP: .metadata; Hugging Face: *.safetensors; "
                             "UCP: manifest.json)", file=str(p))


def read(src: str | os.PathLike[str], source_format: str = "auto", *, trust_pickle: bool = False,
         progress: Progress | None = None) -> tuple[str, Imported]:
    """Read a foreign checkpoint into memory-mapped leaves; ``(format, Imported)``."""
    fmt = detect(src) if source_format == "auto" else source_format
    if fmt == "ucp":
        raise UnknownFormatError(f"{str(src)!r} is already a UCP checkpoint", file=str(src))
    if fmt == "deepspeed":
        from .deepspeed import read_deepspeed as reader
    elif fmt == "deepspeed-universal":
        from .universal import read_universal as reader
    elif fmt == "dcp":
        from .dcp import read_dcp as reader
    elif fmt == "hf":
        from .hf import read_hf as reader
    else:
        raise UnknownFormatError(f"unknown source format {fmt!r}; known: auto, {', '.join(FORMATS)}")
    return fmt, reader(src, trust_pickle=trust_pickle, progress=progress)


def convert(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, source_format: SourceFormat | str = "auto",
            trust_pickle: bool = False, overwrite: bool = False,
            progress: Callable[[int, int, str], None] | None = None) -> ConvertReport:
    """Convert the checkpoint at ``src`` into a UCP checkpoint at ``dst`` (written atomically).

    ``dst`` must not exist unless ``overwrite`` (then only a UCP checkpoint there is replaced), so a
    typo cannot swap away a folder of other data. ``progress(done, total, what)`` is called while
    reading, then once before and after writing.
    """
    from ..saving import save

    t0 = time.perf_counter()
    s, d = Path(src), Path(dst)
    if d.exists() or d.is_symlink():
        if not overwrite:
            raise ForeignCheckpointError(f"destination {str(d)!r} already exists (overwrite=True / --force replaces "
                                         "a UCP checkpoint there)", file=str(d))
        if not (d / "manifest.json").is_file():
            raise ForeignCheckpointError(f"destination {str(d)!r} exists and is not a UCP checkpoint; not replacing it",
                                         file=str(d))
    if s.exists() and d.exists() and s.resolve() == d.resolve():
        raise ForeignCheckpointError(f"source and destination are the same path {str(s)!r}", file=str(s))
    fmt, imported = read(s, source_format, trust_pickle=trust_pickle, progress=progress)
    if progress:
        progress(0, 1, f"writing {d.name}")
    manifest = save(imported.state, d, step=imported.step, metadata=imported.metadata)
    if progress:
        progress(1, 1, f"wrote {d.name}")
    return ConvertReport(format=fmt, src=str(s), dst=str(d), step=manifest.step, tensors=len(manifest.tensors),
                         bytes=sum(f.size for f in manifest.files.values()), seconds=round(time.perf_counter() - t0, 3))
