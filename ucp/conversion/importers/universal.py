"""Import a DeepSpeed *universal* checkpoint (``ds_to_universal`` output) into the Engine's structure.

A universal checkpoint already holds one file per parameter and state
(``zero/<name>/{fp32,exp_avg,exp_avg_sq}.pt``): ZeRO-1/2 ones as ``{"param": tensor in its shape,
"cat_dim": 0}`` with a ``step.pt``, ZeRO-3 ones as bare 1-d tensors (shapes from ``param_shapes``).
Each file's tensor is written as one piece. The model states next to ``zero/`` give the names,
shapes, step and (ZeRO-1/2) the training-dtype weights. Like the native importer (:mod:`.deepspeed`),
it reads the files without torch where it can (``on_disk``: the tensors as byte ranges of the
archives, copied by ``convert``) and with ``torch.load`` otherwise.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Any

from ucp.conversion.importers.common import Imported, Progress, inside
from ucp.conversion.importers.deepspeed import (
    _MODEL,
    MOMENTS,
    ON_DISK,
    TORCH,
    Tensors,
    adam_step,
    assemble,
    param_shapes,
    read_tag,
    require,
    source_metadata,
    training_dtype,
)
from ucp.conversion.importers.errors import ForeignCheckpointError, UnknownFormatError
from ucp.conversion.importers.stored import NeedsTorch

log = logging.getLogger(__name__)


def universal_dir(path: str | os.PathLike[str]) -> Path:
    """The universal folder: ``path`` itself when it holds ``zero/``, else the one ``latest_universal`` names."""
    p = Path(path)
    if (p / "zero").is_dir():
        return p
    latest = p / "latest_universal"
    if latest.is_file():
        target = p / read_tag(inside(p, latest))
        if (target / "zero").is_dir():
            return inside(p, target)
        raise ForeignCheckpointError(
            f"file {str(latest)!r} names {str(target)!r}, which has no zero/ folder", file=str(latest)
        )
    raise UnknownFormatError(
        f"{str(p)!r} is not a DeepSpeed universal checkpoint (no zero/ folder, no latest_universal file)", file=str(p)
    )


def _param_tensor(udir: Path, file: Path, shape: tuple[int, ...], trust_pickle: bool, tensors: Tensors) -> Any:
    if not file.is_file():
        raise ForeignCheckpointError(f"file {str(file)!r} is missing", file=str(file))
    inside(udir, file)
    value = tensors.open(file, trust_pickle)
    t: Any = value.get("param") if isinstance(value, dict) else value  # an unpickled value, checked below
    if not tensors.is_tensor(t):
        raise ForeignCheckpointError(
            f"file {str(file)!r} holds neither a tensor nor {{'param': tensor}}", file=str(file)
        )
    if t.numel() != math.prod(shape):
        raise ForeignCheckpointError(
            f"file {str(file)!r} holds {t.numel()} elements, param_shapes says {list(shape)}", file=str(file)
        )
    return t.detach().reshape(shape)


def read_universal(
    path: str | os.PathLike[str], *, trust_pickle: bool = False, progress: Progress | None = None, on_disk: bool = False
) -> Imported:
    """Read a universal checkpoint (its folder, or a root with ``latest_universal``) into the Engine's structure.

    ``on_disk``: leaves as byte ranges of the files where the torch-free reader can (see
    :func:`.deepspeed.read_deepspeed`).
    """
    udir = universal_dir(path)
    if on_disk:
        try:
            return _read(udir, ON_DISK, trust_pickle, progress)
        except NeedsTorch as exc:
            log.info("%s: reading with torch.load (%s)", udir, exc)
    return _read(udir, TORCH, trust_pickle, progress)


def _read(udir: Path, tensors: Tensors, trust_pickle: bool, progress: Progress | None) -> Imported:
    found = [(f, hit) for f in udir.iterdir() if (hit := _MODEL.match(f.name))]
    model_files = [f for f, _ in sorted(found, key=lambda fh: int(fh[1].group(1) or 0))]
    if not model_files:
        raise ForeignCheckpointError(f"no *model_states.pt file in {str(udir)!r}", file=str(udir))
    states = tensors.open(inside(udir, model_files[0]), trust_pickle)
    opt_file = udir / "zero" / "optimizer_state.pt"
    osd = tensors.open(inside(udir, opt_file), trust_pickle) if opt_file.is_file() else {}
    stage = int(osd.get("zero_stage", 3 if len(model_files) > 1 else 2))
    shapes = param_shapes(states, model_files[0])
    module = require(states, "module", model_files[0])
    order = [n for n in module if any(n in g for g in shapes)] + [n for g in shapes for n in g if n not in module]
    all_shapes = {n: s for g in shapes for n, s in g.items()}
    dtype = training_dtype(module, order, tensors)
    masters: dict[str, Any] = {}
    moments: dict[str, dict[str, Any]] = {m: {} for m in MOMENTS}
    steps: list[tuple[Any, Path]] = []
    for i, name in enumerate(order):
        folder = udir / "zero" / name
        masters[name] = _param_tensor(udir, folder / "fp32.pt", all_shapes[name], trust_pickle, tensors)
        for m in MOMENTS:
            moments[m][name] = _param_tensor(udir, folder / f"{m}.pt", all_shapes[name], trust_pickle, tensors)
        if (folder / "step.pt").is_file():
            steps.append((tensors.open(inside(udir, folder / "step.pt"), trust_pickle), folder / "step.pt"))
        if progress:
            progress(i + 1, len(order), name)
    inner = osd.get("optimizer_state_dict")
    if not isinstance(inner, dict):
        inner = {}
    if not steps:
        steps = [(s["step"], opt_file) for s in inner.get("state", {}).values() if isinstance(s, dict) and "step" in s]
    step = int(states.get("global_steps", 0) or 0)
    adam = adam_step(steps) if steps else step
    groups = osd.get("param_groups") or inner.get("param_groups") or []
    if stage == 3:
        extra = {n: t.detach() for n, t in module.items() if n not in masters and t.numel() > 0}
    else:
        extra = {n: t.detach() for n, t in module.items() if n not in masters}
    world = int(states.get("dp_world_size", len(model_files)) or len(model_files))
    state = assemble(
        module=module,
        order=order,
        masters=masters,
        moments=moments,
        stage=stage,
        dtype=dtype,
        extra_model=extra,
        step=step,
        adam=adam,
        param_groups=list(groups),
        groups_file=opt_file,
        states=states,
        states_file=model_files[0],
        tensors=tensors,
    )
    ls = osd.get("loss_scaler")
    meta = source_metadata(
        states,
        fmt="deepspeed-universal",
        stage=stage,
        world=world,
        dtype=dtype,
        path=udir,
        loss_scaler=vars(ls) if hasattr(ls, "__dict__") else None,
        states_file=model_files[0],
        scaler_file=opt_file,
    )
    return Imported(state=state, step=step, metadata=meta)
