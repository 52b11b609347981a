"""What turns an ``hf`` export's safetensors into a directory ``transformers`` loads: ``config.json``, the
generation config, the tokenizer files, and a check that the config builds a model of the tensors' shapes.

Where each comes from (first found wins):

* ``config.json``: the ``config`` option (a JSON file, a folder holding ``config.json``, or a dict), else
  the checkpoint's ``metadata.hf_config`` (recorded by ``ucp convert`` of a ``save_pretrained`` folder and
  by ``training.initialize`` around a ``transformers`` model). None: no ``config.json`` is written;
* ``generation_config.json``: ``metadata.hf_generation_config`` (recorded by ``ucp convert``);
* tokenizer files: the ``tokenizer`` option (a folder; its files named in :data:`TOKENIZER_FILES` are
  copied), else the folder ``metadata.hf_tokenizer`` names (``ucp convert`` records where the source's
  tokenizer files were; they are copied when still there, and a warning is logged when not).

Tensor names are kept as they are (identity): a checkpoint of a ``transformers`` model holds its
``state_dict`` names. The config is checked before anything is written: ``transformers`` builds the
model it describes on the meta device (no memory), and every exported tensor must be one of its
parameters or buffers with the same shape, and every parameter (or a tied alias of it) must be
exported; otherwise an ExportError names the tensor and both shapes. Without ``transformers`` installed
the check is skipped.

Only JSON is read from the checkpoint's metadata and the given files: nothing is unpickled.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ucp.conversion.exporters.options import ExportError
from ucp.conversion.hf_meta import (
    CONFIG,
    GENERATION_CONFIG,
    META_CONFIG,
    META_GENERATION,
    META_TOKENIZER,
    TOKENIZER_FILES,
)
from ucp.format.manifest import Manifest

log = logging.getLogger(__name__)

__all__ = ["CONFIG", "GENERATION_CONFIG", "TOKENIZER_FILES", "ModelFiles", "check_shapes", "resolve", "write"]


@dataclass
class ModelFiles:
    """The non-tensor files of an ``hf`` export, resolved before anything is written."""

    config: dict[str, Any] | None = None
    config_source: str | None = None  # where the config came from, for messages and the report
    generation_config: dict[str, Any] | None = None
    tokenizer_dir: Path | None = None
    tokenizer_files: list[str] = field(default_factory=list)


def read_json_object(path: str | os.PathLike[str], *, what: str) -> dict[str, Any]:
    """The JSON object in ``path``; ExportError naming the file when it is missing or not a JSON object."""
    try:
        with open(path, "rb") as fh:
            doc = json.load(fh)
    except (OSError, ValueError) as exc:
        raise ExportError(f"{what} {os.fspath(path)!r}: unreadable ({exc})") from None
    if not isinstance(doc, dict):
        raise ExportError(f"{what} {os.fspath(path)!r}: not a JSON object")
    return doc


def resolve(
    manifest: Manifest,
    *,
    config: str | os.PathLike[str] | Mapping[str, Any] | None,
    tokenizer: str | os.PathLike[str] | None,
    src: str,
) -> ModelFiles:
    """The config, generation config and tokenizer files for an ``hf`` export of ``manifest``."""
    out = ModelFiles()
    meta = manifest.metadata
    if isinstance(config, Mapping):
        out.config, out.config_source = dict(config), "the config given"
    elif config is not None:
        path = Path(config)
        if path.is_dir():
            path = path / CONFIG
        out.config, out.config_source = read_json_object(path, what="config file"), str(path)
    elif isinstance(meta.get(META_CONFIG), dict):
        out.config, out.config_source = dict(meta[META_CONFIG]), f"{src}/manifest.json metadata.{META_CONFIG}"
    if isinstance(meta.get(META_GENERATION), dict):
        out.generation_config = dict(meta[META_GENERATION])
    if tokenizer is not None:
        folder = Path(tokenizer)
        if not folder.is_dir():
            raise ExportError(f"tokenizer {os.fspath(tokenizer)!r}: not a folder")
        out.tokenizer_files = [n for n in TOKENIZER_FILES if (folder / n).is_file()]
        if not out.tokenizer_files:
            raise ExportError(
                f"tokenizer {os.fspath(tokenizer)!r} holds no tokenizer files (looked for {', '.join(TOKENIZER_FILES)})"
            )
        out.tokenizer_dir = folder
    elif isinstance(meta.get(META_TOKENIZER), dict):
        recorded = meta[META_TOKENIZER]
        folder = Path(str(recorded.get("dir", "")))
        names = [n for n in recorded.get("files", []) if isinstance(n, str) and n in TOKENIZER_FILES]
        present = [n for n in names if (folder / n).is_file()]
        if len(present) < len(names):
            log.warning(
                "%s: the tokenizer files recorded at import are gone from %s (%s); exporting without them "
                "(give the tokenizer option to copy them from elsewhere)",
                src,
                folder,
                ", ".join(sorted(set(names) - set(present))),
            )
        if present and len(present) == len(names):
            out.tokenizer_dir, out.tokenizer_files = folder, present
    return out


def check_shapes(
    config: dict[str, Any],
    shapes: Mapping[str, tuple[int, ...]],
    *,
    where: str,
    aliases: Mapping[str, str] | None = None,
) -> None:
    """ExportError unless the model ``config`` describes has exactly the tensors ``shapes`` lists (a tied
    parameter needs one of its names). Built by ``transformers`` on the meta device; skipped without it.
    ``aliases``: exported name -> the name the installed transformers gives that tensor, where they differ
    (``from_pretrained`` renames it on load)."""
    try:
        import torch
        import transformers
    except ImportError:  # pragma: no cover - transformers is in the test extras
        log.warning("transformers is not installed: %s is not checked against the tensor shapes", where)
        return
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        raise ExportError(f"config {where}: no 'model_type' (transformers needs it to know the model)")
    try:
        kwargs = {k: v for k, v in config.items() if k != "model_type"}
        hf_config = transformers.AutoConfig.for_model(model_type, **kwargs)
        archs = config.get("architectures") or []
        cls = getattr(transformers, archs[0], None) if archs and isinstance(archs[0], str) else None
        with torch.device("meta"):
            model = cls(hf_config) if cls is not None else transformers.AutoModelForCausalLM.from_config(hf_config)
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds for a bad config
        raise ExportError(f"config {where}: transformers cannot build the model from it: {exc}") from None
    arch = type(model).__name__
    expected = {name: tuple(t.shape) for name, t in model.state_dict(keep_vars=True).items()}
    shapes = {
        (aliases[n] if aliases and n in aliases and n not in expected and aliases[n] in expected else n): s
        for n, s in shapes.items()
    }
    tied: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        tied.setdefault(id(p), []).append(name)
    problems: list[str] = []
    for name, shape in shapes.items():
        if name not in expected:
            problems.append(f"tensor {name!r} (shape {list(shape)}) is not in {arch}")
        elif tuple(shape) != expected[name]:
            problems.append(
                f"tensor {name!r}: the checkpoint holds shape {list(shape)}, {arch} expects {list(expected[name])}"
            )
    for names in tied.values():
        if not any(n in shapes for n in names):
            problems.append(f"{arch} parameter {names[0]!r} (shape {list(expected.get(names[0], ()))}) is not exported")
    if problems:
        more = f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""
        raise ExportError(
            f"config {where} disagrees with the tensors exported: "
            + "; ".join(problems[:8])
            + more
            + " (give the matching config with --config FILE)"
        )


def write(out_dir: Path, files: ModelFiles) -> list[str]:
    """Write the config, generation config and tokenizer files into ``out_dir``; returns their names."""
    names: list[str] = []
    for name, doc in ((CONFIG, files.config), (GENERATION_CONFIG, files.generation_config)):
        if doc is not None:
            (out_dir / name).write_text(json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
            names.append(name)
    if files.tokenizer_dir is not None:
        for name in files.tokenizer_files:
            try:
                shutil.copyfile(files.tokenizer_dir / name, out_dir / name)
            except OSError as exc:
                raise ExportError(f"tokenizer file {str(files.tokenizer_dir / name)!r}: copy failed: {exc}") from None
            names.append(name)
    return names
