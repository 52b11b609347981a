"""Import a DeepSpeed ZeRO-1/2/3 checkpoint (fp32, bf16 or fp16 training) into the training Engine's structure.

The layout rules (flat fp32 buffers in ``param_shapes`` order, alignment and partition padding,
ZeRO-3's per-parameter chunks with uninitialised padding) are those of DeepSpeed 0.19.8, documented
with evidence in tools/peers/README.md. Every parameter's fp32 master and Adam moments come out as
views of the memory-mapped optimizer files: a parameter that straddles two ranks' partitions is a
``ucp.Shards`` of two flat pieces, never a concatenated copy. The result::

    {"model": {name: weight in the training dtype}, "optimizer": {"fp32_master" | "exp_avg" |
     "exp_avg_sq": {name: fp32}, "adam_step", "loss_scale": None, "hparams"}, "step",
     "scheduler", "rng"}

is what ``training.Engine.load`` resumes from at any mesh and ZeRO stage.

The layout code runs on either of two kinds of tensors (a :class:`Tensors` strategy): torch
tensors from ``torch.load`` (:data:`TORCH`), or byte ranges of the archives read without torch
(:data:`ON_DISK`, see :mod:`.torch_archive`), which ``ucp convert`` copies straight to the new
checkpoint. The on-disk reading covers what DeepSpeed writes in the common cases; a file or layout
it cannot express (a cast of ZeRO-3's fp32 masters to bf16 weights, a missing Adam moment, a
pickle outside its allow-list) raises NeedsTorch and the checkpoint is read again with torch.
"""

from __future__ import annotations

import logging
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Protocol, Sequence

from ucp.conversion.importers.common import Imported, Progress, Segments, cast_leaf, inside, json_plain, leaf, plain
from ucp.conversion.importers.errors import ForeignCheckpointError, UnknownFormatError
from ucp.conversion.importers.stored import NeedsTorch, StoredTensor, stored_leaf
from ucp.conversion.importers.torch_archive import read_archive
from ucp.format.dtypes import dtype_name, torch_dtype

log = logging.getLogger(__name__)

MOMENTS = ("exp_avg", "exp_avg_sq")
_OPTIM = re.compile(r"^(?:(bf16|fp16)_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_MODEL = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
MAX_TAG_BYTES = 4096  # a `latest` file holds one folder name
DTYPE_NAMES = {"F32": "fp32", "BF16": "bf16", "F16": "fp16"}  # DeepSpeed's names of the training dtypes


class Tensors(Protocol):
    """How the layout code gets and combines tensors: torch tensors (:data:`TORCH`) or byte ranges (:data:`ON_DISK`).

    Dtypes are ucp names ("F32", "BF16") on both.
    """

    def open(self, file: Path, trust_pickle: bool) -> Any:
        """The object a ``.pt`` file holds."""

    def dtype(self, t: Any) -> str: ...

    def is_tensor(self, value: Any) -> bool: ...

    def zeros(self, n: int) -> Any:
        """n fp32 zeros (an Adam moment the checkpoint lacks)."""

    def leaf(self, parts: Sequence[tuple[Any, int]], shape: Sequence[int]) -> Any:
        """A tensor of ``shape`` from flat ``(view, first element)`` parts."""

    def cast(self, value: Any, dtype: str) -> Any: ...


class _TorchTensors:
    def open(self, file: Path, trust_pickle: bool) -> Any:
        from ucp.conversion.importers.pickles import load_torch

        return load_torch(file, trust_pickle=trust_pickle)

    def dtype(self, t: Any) -> str:
        return dtype_name(t.dtype)

    def is_tensor(self, value: Any) -> bool:
        import torch

        return isinstance(value, torch.Tensor)

    def zeros(self, n: int) -> Any:
        import torch

        return torch.zeros(n)

    def leaf(self, parts: Sequence[tuple[Any, int]], shape: Sequence[int]) -> Any:
        return leaf(parts, shape)

    def cast(self, value: Any, dtype: str) -> Any:
        return cast_leaf(value, torch_dtype(dtype))


class _OnDiskTensors:
    def open(self, file: Path, trust_pickle: bool) -> Any:
        return read_archive(file)

    def dtype(self, t: Any) -> str:
        return t.dtype

    def is_tensor(self, value: Any) -> bool:
        return isinstance(value, StoredTensor)

    def zeros(self, n: int) -> Any:
        raise NeedsTorch("an Adam moment is missing (zeros to make)")

    def leaf(self, parts: Sequence[tuple[Any, int]], shape: Sequence[int]) -> Any:
        return stored_leaf(parts, shape)

    def cast(self, value: Any, dtype: str) -> Any:
        if value.dtype != dtype:
            raise NeedsTorch(f"weights to cast from {value.dtype} to {dtype}")
        return value


TORCH: Tensors = _TorchTensors()
ON_DISK: Tensors = _OnDiskTensors()


@dataclass
class DeepSpeedFiles:
    """The files of one DeepSpeed tag folder, by data-parallel rank."""

    tag_dir: Path
    model: list[Path]  # one (ZeRO-1/2) or one per rank (ZeRO-3)
    optim: list[Path]  # one per rank, rank order


def tag_dir(path: str | os.PathLike[str]) -> Path:
    """The tag folder of a checkpoint root (through its ``latest`` file) or the folder itself."""
    p = Path(path)
    if not p.is_dir():
        raise UnknownFormatError(f"{str(p)!r} is not a directory (a DeepSpeed checkpoint is a folder)", file=str(p))
    latest = p / "latest"
    if latest.is_file():
        tag = read_tag(inside(p, latest))
        if not (p / tag).is_dir():
            raise ForeignCheckpointError(
                f"file {str(latest)!r} names tag {tag!r}, but {str(p / tag)!r} is missing", file=str(latest)
            )
        return inside(p, p / tag)
    return p


def read_tag(file: Path) -> str:
    """The tag a ``latest`` (or ``latest_universal``) file names: a folder next to that file.

    Only a plain folder name is accepted: a path ('../x', '/abs', 'a/b') or '.'/'..' would make
    the import read a checkpoint outside the root it was given.
    """
    with open(file, "rb") as f:
        data = f.read(MAX_TAG_BYTES + 1)
    try:
        tag = data.decode().strip() if len(data) <= MAX_TAG_BYTES else ""
    except UnicodeDecodeError:
        tag = ""
    if tag in ("", ".", "..") or any(c in tag for c in ("/", os.sep, "\0")):
        shown = repr(tag[:80]) if tag else "nothing" if not data.strip() else f"{len(data)} bytes of something else"
        raise ForeignCheckpointError(
            f"file {str(file)!r} must name a tag folder next to it (a plain folder name), not {shown}", file=str(file)
        )
    return tag


def find_files(path: str | os.PathLike[str]) -> DeepSpeedFiles:
    """Locate the model-states and optimizer files; refuse tensor/pipeline-parallel checkpoints by name."""
    d = tag_dir(path)
    optim: dict[int, Path] = {}
    model: dict[int, Path] = {}
    for f in sorted(d.iterdir()):
        if f.name.startswith("layer_"):
            raise ForeignCheckpointError(
                f"file {str(f)!r}: pipeline-parallel DeepSpeed checkpoints (layer_* files) are not supported",
                file=str(f),
            )
        m = _OPTIM.match(f.name) or _MODEL.match(f.name)
        if m is None:
            continue
        mp = int(m.group(3) if m.re is _OPTIM else m.group(2))
        if mp != 0:
            raise ForeignCheckpointError(
                f"file {str(f)!r}: tensor-parallel DeepSpeed checkpoints (mp_rank > 0) are not supported", file=str(f)
            )
        if m.re is _OPTIM:
            optim[int(m.group(2))] = f
        else:
            model[int(m.group(1) or 0)] = f
    if not model:
        raise UnknownFormatError(f"no DeepSpeed *model_states.pt file in {str(d)!r}", file=str(d))
    if not optim:
        raise ForeignCheckpointError(
            f"no DeepSpeed *optim_states.pt file in {str(d)!r} (a weights-only save?)", file=str(d)
        )
    for what, files in (("optimizer", optim), ("model-states", model)):
        if sorted(files) != list(range(len(files))):
            raise ForeignCheckpointError(
                f"{str(d)!r}: {what} files for ranks {sorted(files)}, expected 0..{len(files) - 1}", file=str(d)
            )
    return DeepSpeedFiles(d, [inside(d, model[r]) for r in sorted(model)], [inside(d, optim[r]) for r in sorted(optim)])


def require(mapping: Mapping[str, Any], key: str, file: Path) -> Any:
    if not isinstance(mapping, Mapping) or key not in mapping:
        raise ForeignCheckpointError(f"file {str(file)!r} has no {key!r} entry", file=str(file))
    return mapping[key]


def param_shapes(states: Mapping[str, Any], file: Path) -> list[dict[str, tuple[int, ...]]]:
    """``param_shapes`` per optimizer group, in flat-buffer order."""
    groups = require(states, "param_shapes", file)
    if isinstance(groups, Mapping):  # very old DeepSpeed: one dict
        groups = [groups]
    return [{str(k): tuple(int(s) for s in v) for k, v in g.items()} for g in groups]


def hparams(
    ds_config: Mapping[str, Any] | None, param_groups: list[Mapping[str, Any]], *, config_file: Path, groups_file: Path
) -> dict[str, Any]:
    """The Engine's ``optimizer.hparams`` from DeepSpeed's config and the saved param groups (current values);
    ``config_file`` and ``groups_file`` are the files these came from."""
    opt = (ds_config or {}).get("optimizer") or {}
    params = opt.get("params") or {}
    g0 = dict(param_groups[0]) if param_groups else {}
    if "decoupled_weight_decay" in g0:
        kind = "adamw" if g0["decoupled_weight_decay"] else "adam"
    else:
        t = str(opt.get("type", "adamw")).lower()
        kind = "adamw" if t == "adamw" or (t == "adam" and params.get("adam_w_mode", True)) else t
    out: dict[str, Any] = {"kind": kind}
    for key, default in (
        ("lr", params.get("lr")),
        ("betas", params.get("betas")),
        ("eps", params.get("eps")),
        ("weight_decay", params.get("weight_decay", 0.0)),
    ):
        out[key] = json_plain(g0[key], file=groups_file) if key in g0 else json_plain(default, file=config_file)
    if len(param_groups) > 1:
        out["groups"] = [
            json_plain({k: v for k, v in g.items() if k != "params"}, file=groups_file) for g in param_groups
        ]
    return out


def adam_step(values: Iterable[tuple[Any, Path]]) -> int:
    """The one Adam step count of all ranks and groups (0-d tensors or ints); they must agree."""
    seen: dict[int, Path] = {}
    for v, file in values:
        seen.setdefault(int(v.item() if hasattr(v, "item") else v), file)
    if len(seen) > 1:
        raise ForeignCheckpointError(
            "optimizer files disagree on Adam's step: " + ", ".join(f"{s} in {str(f)!r}" for s, f in seen.items())
        )
    return next(iter(seen), 0)


def training_dtype(module: Mapping[str, Any], names: Iterable[str], tensors: Tensors) -> str:
    for n in names:
        if n in module:
            return tensors.dtype(module[n])
    return "F32"


def assemble(
    *,
    module: Mapping[str, Any],
    order: list[str],
    masters: dict[str, Any],
    moments: dict[str, dict[str, Any]],
    stage: int,
    dtype: str,
    extra_model: Mapping[str, Any],
    step: int,
    adam: int,
    param_groups: list[Mapping[str, Any]],
    groups_file: Path,
    states: Mapping[str, Any],
    states_file: Path,
    tensors: Tensors,
) -> dict[str, Any]:
    """The Engine-structured state dict. ``order``: trainable names in model order; ``extra_model``:
    buffers and frozen parameters (full tensors or leaves); ``states``: the model states (with the
    DeepSpeed config and the shared-parameter aliases), read from ``states_file``; ``param_groups``:
    the optimizer's, read from ``groups_file``. ZeRO-3 keeps no whole weights: they are cast from
    the masters."""
    weights_from_masters = stage == 3
    shared: Mapping[str, str] = states.get("shared_params") or {}
    hp = hparams(states.get("ds_config"), param_groups, config_file=states_file, groups_file=groups_file)
    model: dict[str, Any] = {}
    for name, value in module.items():
        if name in masters:
            model[name] = tensors.cast(masters[name], dtype) if weights_from_masters else value.detach()
        elif name in extra_model:
            model[name] = extra_model[name]
    for name in order:  # trainable names missing from module (should not happen): from the masters
        if name not in model:
            model[name] = tensors.cast(masters[name], dtype)
    for alias, source in shared.items():
        if source in model and alias not in model:
            model[alias] = tensors.cast(model[source], dtype)
    scheduler: dict[str, Any] = {"kind": "constant", "last_step": step}
    if states.get("lr_scheduler") is not None:
        scheduler = {"kind": "deepspeed", "last_step": step, "state": plain(states["lr_scheduler"], file=states_file)}
    rng = {k: int(states[k]) for k in ("seed", "data_seed") if isinstance(states.get(k), int)}
    return {
        "model": model,
        "optimizer": {
            "fp32_master": {n: masters[n] for n in order},
            "exp_avg": {n: moments["exp_avg"][n] for n in order},
            "exp_avg_sq": {n: moments["exp_avg_sq"][n] for n in order},
            "adam_step": adam,
            "loss_scale": None,
            "hparams": hp,
        },
        "step": step,
        "scheduler": scheduler,
        "rng": rng,
    }


def source_metadata(
    states: Mapping[str, Any],
    *,
    fmt: str,
    stage: int,
    world: int,
    dtype: str,
    path: Path,
    loss_scaler: Any,
    states_file: Path,
    scaler_file: Path,
) -> dict[str, Any]:
    """The imported checkpoint's ``metadata.source``: ``states`` are the model states (from ``states_file``),
    ``loss_scaler`` the optimizer's (from ``scaler_file``)."""
    meta = {
        "format": fmt,
        "zero_stage": stage,
        "dp_world_size": world,
        "dtype": DTYPE_NAMES.get(dtype, dtype),
        "ds_version": str(states.get("ds_version", "")),
        "path": str(path.resolve()),
        "global_samples": states.get("global_samples"),
        "skipped_steps": states.get("skipped_steps"),
    }
    if loss_scaler is not None:
        meta["loss_scaler"] = json_plain(loss_scaler, file=scaler_file)
    return {"source": json_plain(meta, file=states_file)}


# -- ZeRO-1/2: one flat buffer per group, cut into equal partitions -----------------------------------


def _zero12(
    files: DeepSpeedFiles,
    osds: list[dict[str, Any]],
    shapes: list[dict[str, tuple[int, ...]]],
    progress: Progress | None,
    tensors: Tensors,
) -> tuple[dict[str, Any], dict[str, dict[str, Any]], int]:
    world = len(osds)
    masters: dict[str, Any] = {}
    moments: dict[str, dict[str, Any]] = {m: {} for m in MOMENTS}
    steps: list[tuple[Any, Path]] = []
    for g, group in enumerate(shapes):
        fp32 = [require(o, "single_partition_of_fp32_groups", f)[g].detach() for o, f in zip(osds, files.optim)]
        base = [require(o, "base_optimizer_state", f) for o, f in zip(osds, files.optim)]
        for b, f in zip(base, files.optim):
            if not isinstance(b, Mapping) or "state" not in b:
                raise ForeignCheckpointError(
                    f"file {str(f)!r}: base_optimizer_state is not a torch optimizer state "
                    "dict (elastic_checkpoint saves are not supported)",
                    file=str(f),
                )
        states = [b["state"].get(g, {}) for b in base]
        pads = list(require(osds[0], "param_alignment_paddings", files.optim[0])[g])
        tail = [int(require(o, "group_paddings", f)[g]) for o, f in zip(osds, files.optim)]
        part = fp32[0].numel() + tail[0]  # every rank's partition has this many elements
        offsets, total = [], 0
        for i, shape in enumerate(group.values()):
            offsets.append(total)
            total += math.prod(shape) + (int(pads[i]) if i < len(pads) else 0)
        if sum(t.numel() for t in fp32) != total:
            raise ForeignCheckpointError(
                f"file {str(files.optim[0])!r} and its peers: the fp32 partitions of group {g} hold "
                f"{sum(t.numel() for t in fp32)} elements, param_shapes and alignment padding need {total}",
                file=str(files.optim[0]),
            )
        for r, (t, f) in enumerate(zip(fp32, files.optim)):
            if t.numel() + tail[r] != part:
                raise ForeignCheckpointError(
                    f"file {str(f)!r}: rank {r}'s partition of group {g} is "
                    f"{t.numel()} + {tail[r]} padding elements, rank 0's is {part}",
                    file=str(f),
                )
        moment_bufs: dict[str, list[Any]] = {m: [] for m in MOMENTS}
        for st, f in zip(states, files.optim):
            for m in MOMENTS:
                buf = st.get(m)
                if buf is not None and buf.numel() != part:
                    raise ForeignCheckpointError(
                        f"file {str(f)!r}: {m} of group {g} has {buf.numel()} elements, the partition {part}",
                        file=str(f),
                    )
                moment_bufs[m].append(None if buf is None else buf.detach().reshape(-1))
            if "step" in st:
                steps.append((st["step"], f))
        maps = [(o.get("param_slice_mappings") or [{}] * (g + 1))[g] for o in osds]
        for i, (name, shape) in enumerate(group.items()):
            n, off = math.prod(shape), offsets[i]
            pieces: dict[str, list[tuple[Any, int]]] = {"fp32": [], **{m: [] for m in MOMENTS}}
            ranks = range(off // part, min(world, (off + n - 1) // part + 1)) if n else range(0)
            for r in ranks:
                a, b = max(off, r * part), min(off + n, (r + 1) * part)
                if a >= b:
                    continue
                frag = maps[r].get(name) if maps[r] else None
                if frag is not None and (int(frag.start) != a - r * part or int(frag.numel) != b - a):
                    raise ForeignCheckpointError(
                        f"file {str(files.optim[r])!r}: param_slice_mappings says {name!r} is elements "
                        f"[{frag.start}, {frag.start + frag.numel}) of the partition; param_shapes gives "
                        f"[{a - r * part}, {b - r * part})",
                        tensor=name,
                        file=str(files.optim[r]),
                    )
                lo, hi = a - r * part, b - r * part
                pieces["fp32"].append((fp32[r][lo:hi], a - off))
                for m in MOMENTS:
                    buf = moment_bufs[m][r]
                    pieces[m].append((buf[lo:hi] if buf is not None else tensors.zeros(hi - lo), a - off))
            masters[name] = tensors.leaf(pieces["fp32"], shape)
            for m in MOMENTS:
                moments[m][name] = tensors.leaf(pieces[m], shape)
            if progress:
                progress(len(masters), sum(len(s) for s in shapes), name)
    return masters, moments, adam_step(steps)


# -- ZeRO-3: every parameter cut into W equal chunks -------------------------------------------------


def _zero3(
    files: DeepSpeedFiles,
    osds: list[dict[str, Any]],
    shapes: list[dict[str, tuple[int, ...]]],
    progress: Progress | None,
    tensors: Tensors,
) -> tuple[dict[str, Any], dict[str, dict[str, Any]], int]:
    world = len(osds)
    flat: list[Segments] = []
    moment_segs: dict[str, list[Segments | None]] = {m: [] for m in MOMENTS}
    steps: list[tuple[Any, Path]] = []
    for o, f in zip(osds, files.optim):
        groups = require(o, "fp32_flat_groups", f)
        flat.append(Segments(groups))
        inner = require(o, "optimizer_state_dict", f)
        state = inner.get("state", {}) if isinstance(inner, Mapping) else {}
        for m in MOMENTS:
            bufs = [state.get(g, {}).get(m) for g in range(len(groups))]
            moment_segs[m].append(Segments(bufs) if all(b is not None for b in bufs) else None)
        steps.extend((s["step"], f) for s in state.values() if isinstance(s, Mapping) and "step" in s)
    chained = [(n, s) for group in shapes for n, s in group.items()]
    need = sum(math.ceil(math.prod(s) / world) for _, s in chained)
    for r, (seg, f) in enumerate(zip(flat, files.optim)):
        if seg.numel != need:
            raise ForeignCheckpointError(
                f"file {str(f)!r}: rank {r}'s fp32_flat_groups hold {seg.numel} elements; "
                f"param_shapes split over {world} ranks need {need}",
                file=str(f),
            )
        for m in MOMENTS:
            ms = moment_segs[m][r]
            if ms is not None and ms.numel != need:
                raise ForeignCheckpointError(
                    f"file {str(f)!r}: rank {r}'s {m} holds {ms.numel} elements, the fp32 partition {need}", file=str(f)
                )
    masters: dict[str, Any] = {}
    moments: dict[str, dict[str, Any]] = {m: {} for m in MOMENTS}
    offset = 0
    for i, (name, shape) in enumerate(chained):
        n = math.prod(shape)
        chunk = math.ceil(n / world)
        pieces: dict[str, list[tuple[Any, int]]] = {"fp32": [], **{m: [] for m in MOMENTS}}
        for r in range(world):
            valid = max(0, min(chunk, n - r * chunk))  # the rest of the chunk is padding (garbage)
            if not valid:
                continue
            pieces["fp32"] += [(v, r * chunk + s) for v, s in flat[r].views(offset, offset + valid)]
            for m in MOMENTS:
                ms = moment_segs[m][r]
                got = ms.views(offset, offset + valid) if ms is not None else [(tensors.zeros(valid), 0)]
                pieces[m] += [(v, r * chunk + s) for v, s in got]
        offset += chunk
        masters[name] = tensors.leaf(pieces["fp32"], shape)
        for m in MOMENTS:
            moments[m][name] = tensors.leaf(pieces[m], shape)
        if progress:
            progress(i + 1, len(chained), name)
    return masters, moments, adam_step(steps)


def _zero3_frozen(model_states: list[Mapping[str, Any]], files: DeepSpeedFiles, tensors: Tensors) -> dict[str, Any]:
    """ZeRO-3 frozen (non-trainable) parameters: each rank's fragment, in rank order, truncated to the shape."""
    shapes = model_states[0].get("frozen_param_shapes") or {}
    out: dict[str, Any] = {}
    for name, shape in shapes.items():
        n, start, parts = math.prod(shape), 0, []
        for states, f in zip(model_states, files.model):
            frag = (states.get("frozen_param_fragments") or {}).get(name)
            if frag is None:
                raise ForeignCheckpointError(
                    f"file {str(f)!r} has no fragment of frozen parameter {name!r}", tensor=name, file=str(f)
                )
            frag = frag.detach().reshape(-1)
            take = max(0, min(frag.numel(), n - start))
            parts.append((frag[:take], start))
            start += take
        if start != n:
            raise ForeignCheckpointError(
                f"frozen parameter {name!r}: fragments hold {start} of {n} elements",
                tensor=name,
                file=str(files.model[0]),
            )
        out[str(name)] = tensors.leaf(parts, tuple(shape))
    return out


def read_deepspeed(
    path: str | os.PathLike[str], *, trust_pickle: bool = False, progress: Progress | None = None, on_disk: bool = False
) -> Imported:
    """Read a DeepSpeed checkpoint root (with ``latest``) or tag folder into the Engine's structure.

    ``on_disk``: leaves are :mod:`.stored` byte ranges of the archives where the torch-free reader
    can express the checkpoint (torch tensors otherwise, and always without ``on_disk``).
    """
    files = find_files(path)
    if on_disk:
        try:
            return _read(files, ON_DISK, trust_pickle, progress)
        except NeedsTorch as exc:
            log.info("%s: reading with torch.load (%s)", files.tag_dir, exc)
    return _read(files, TORCH, trust_pickle, progress)


def _read(files: DeepSpeedFiles, tensors: Tensors, trust_pickle: bool, progress: Progress | None) -> Imported:
    n_files = len(files.model) + len(files.optim)
    loaded = 0

    def load(f: Path) -> Any:
        nonlocal loaded
        value = tensors.open(f, trust_pickle)
        loaded += 1
        if progress:
            progress(loaded, n_files, f.name)
        return value

    model_states = [load(f) for f in files.model]
    optim_files = [load(f) for f in files.optim]
    states = model_states[0]
    osds = [require(o, "optimizer_state_dict", f) for o, f in zip(optim_files, files.optim)]
    stage = int(require(osds[0], "zero_stage", files.optim[0]))
    world = len(files.optim)
    ds_world = states.get("dp_world_size")
    if ds_world is not None and int(ds_world) != world:
        raise ForeignCheckpointError(
            f"file {str(files.model[0])!r} says dp_world_size {ds_world}, but {world} optimizer files are present",
            file=str(files.model[0]),
        )
    if int(states.get("mp_world_size", 1) or 1) != 1:
        raise ForeignCheckpointError(
            f"file {str(files.model[0])!r}: mp_world_size {states['mp_world_size']} "
            "(tensor parallelism) is not supported",
            file=str(files.model[0]),
        )
    shapes = param_shapes(states, files.model[0])
    module = require(states, "module", files.model[0])
    order = [n for n in module if any(n in g for g in shapes)] + [n for g in shapes for n in g if n not in module]
    dtype = training_dtype(module, order, tensors)
    if stage in (1, 2):
        masters, moments, adam = _zero12(files, osds, shapes, progress, tensors)
        extra = {n: t.detach() for n, t in module.items() if n not in masters}
    elif stage == 3:
        if len(files.model) != world:
            raise ForeignCheckpointError(
                f"{str(files.tag_dir)!r}: ZeRO-3 needs one model-states file per rank, "
                f"found {len(files.model)} for {world} ranks",
                file=str(files.tag_dir),
            )
        masters, moments, adam = _zero3(files, osds, shapes, progress, tensors)
        extra = {n: t.detach() for n, t in module.items() if n not in masters and t.numel() > 0}
        extra |= _zero3_frozen(model_states, files, tensors)
    else:
        raise ForeignCheckpointError(
            f"file {str(files.optim[0])!r}: ZeRO stage {stage} is not supported", file=str(files.optim[0])
        )
    if stage == 3:
        groups = (osds[0].get("optimizer_state_dict") or {}).get("param_groups", [])
    else:
        groups = (osds[0].get("base_optimizer_state") or {}).get("param_groups", [])
    step = int(states.get("global_steps", adam) or 0)
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
        groups_file=files.optim[0],
        states=states,
        states_file=files.model[0],
        tensors=tensors,
    )
    meta = source_metadata(
        states,
        fmt="deepspeed",
        stage=stage,
        world=world,
        dtype=dtype,
        path=files.tag_dir,
        loss_scaler=vars(osds[0]["loss_scaler"]) if hasattr(osds[0].get("loss_scaler"), "__dict__") else None,
        states_file=files.model[0],
        scaler_file=files.optim[0],
    )
    meta.update(recorded_layout(stage, world, shapes, osds, files.optim[0]))
    return Imported(state=state, step=step, metadata=meta)


def recorded_layout(
    stage: int, world: int, shapes: list[dict[str, tuple[int, ...]]], osds: list[dict[str, Any]], optim_file: Path
) -> dict[str, Any]:
    """DeepSpeed's own layout as manifest metadata (:func:`ucp.conversion.placement.layout_metadata`), so
    ``ucp reshape --dp/--zero`` starts from it and can write DeepSpeed's partitioning back: ``world``
    data-parallel ranks, ZeRO ``stage``, one ZeRO group per optimizer param group (the parameters in
    flat-buffer order) and the partition alignment. ZeRO-1/2 pad each group's flat buffer to a
    multiple of 2·world elements (``nccl_start_alignment_factor``), i.e. partitions are multiples of
    2; alignment 1 is recorded when the saved partitions say otherwise (older versions, or per-parameter
    alignment padding the layout cannot express). ZeRO-3 cuts each parameter into ⌈numel/world⌉."""
    from reshard import partition_size, plain_layout
    from ucp.conversion.placement import layout_metadata

    alignment = 1
    if stage in (1, 2):
        alignment = 2
        for g, group in enumerate(shapes):
            fp32 = require(osds[0], "single_partition_of_fp32_groups", optim_file)[g]
            part = int(fp32.numel()) + int(require(osds[0], "group_paddings", optim_file)[g])
            pads = list(osds[0].get("param_alignment_paddings", [[]] * len(shapes))[g])
            numel = sum(math.prod(s) for s in group.values())
            if any(int(p) for p in pads) or part != partition_size(numel, world, 2):
                alignment = 1
    layout = plain_layout(world, stage, alignment=alignment, groups=[tuple(g) for g in shapes if g])
    flat = {name: shape for group in shapes for name, shape in group.items()}
    return layout_metadata(layout, flat)
