"""Export to DeepSpeed's *universal checkpoint* folder, so a run can go back to DeepSpeed.

The source is a checkpoint in the training engines' structure (``training.initialize`` / ModuleEngine,
or ``ucp convert`` of a DeepSpeed checkpoint): ``model`` (the training-dtype weights),
``optimizer.fp32_master`` / ``exp_avg`` / ``exp_avg_sq`` (one full tensor per parameter, under the
module's ``named_parameters()`` names), ``optimizer.adam_step`` and ``hparams``, ``global_steps``,
``skipped_steps``. The output is what ``ds_to_universal`` writes and what
``engine.load_checkpoint(dst)`` reads with ``"checkpoint": {"load_universal": true}`` in the
DeepSpeed config, at any world size and ZeRO stage (1, 2 or 3)::

    dst/latest_universal                       the tag, e.g. global_step3
    dst/<tag>/mp_rank_00_model_states.pt       module weights, param_shapes, global_steps, dp_world_size...
    dst/<tag>/zero_pp_rank_0_mp_rank_00_model_states.pt   the same without the weights (ZeRO-3 reads it)
    dst/<tag>/zero/optimizer_state.pt          ds_version, param_groups (lr, betas, eps, weight_decay),
                                               optimizer_state_dict.state[0].step (read by ZeRO-3)
    dst/<tag>/zero/<param>/fp32.pt             {"param": fp32 master in its shape, "cat_dim": 0}
    dst/<tag>/zero/<param>/exp_avg.pt          the same for Adam's first moment
    dst/<tag>/zero/<param>/exp_avg_sq.pt       ... and second moment
    dst/<tag>/zero/<param>/step.pt             the Adam step, a float32 tensor as torch.optim keeps it

DeepSpeed's format is ``torch.save`` pickles by design: this module writes them (from tensors and
plain values only). UCP never unpickles them but through ``ucp convert``'s allow-listed reader.
Tensors are read one at a time (each written before the next is read), within the memory budget.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable

from ucp.conversion.exporters.options import ExportError
from ucp.conversion.exporters.selection import ExportTensor, find_section, select_tensors
from ucp.conversion.exporters.stream import one_by_one, read_batches
from ucp.format.manifest import Manifest
from ucp.format.tree import decode_state, tensor_refs
from ucp.store.storage import Storage

# The DeepSpeed release whose loader this layout was written for and tested against (ZeRO-1 refuses
# checkpoints older than 0.3.17; the universal loader asserts a ds_version is present).
DS_VERSION = "0.19.8"
MOMENT_FILES = {"fp32_master": "fp32", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
LATEST = "latest_universal"
Progress = Callable[[int, int, str], None]


def _value(manifest: Manifest, path: str, default: Any = None) -> Any:
    """The plain (tensor-free) value at dotted ``path`` of the state tree, or ``default``."""
    node = find_section(manifest.state, path)
    if node is None or next(tensor_refs(node), None) is not None:
        return default
    return decode_state(node, lambda name: None)


def _sections(manifest: Manifest, src: str) -> dict[str, list[ExportTensor]]:
    """The four per-parameter sections, each a list of tensors named by parameter; ExportError naming what
    is missing when ``src`` is not in the engines' structure."""
    out: dict[str, list[ExportTensor]] = {}
    for key in ("model", *(f"optimizer.{k}" for k in MOMENT_FILES)):
        try:
            out[key] = select_tensors(manifest, key).tensors
        except ExportError as exc:
            raise ExportError(
                f"{src} is not a training-engine checkpoint (model, optimizer.fp32_master/exp_avg/exp_avg_sq): "
                f"{exc}; only those export to DeepSpeed's universal layout"
            ) from None
    params = [t.out_name for t in out["optimizer.fp32_master"]]
    for key in ("optimizer.exp_avg", "optimizer.exp_avg_sq"):
        names = [t.out_name for t in out[key]]
        if sorted(names) != sorted(params):
            missing = sorted(set(params) - set(names))[:5]
            raise ExportError(f"{src}: {key} lacks the moments of {missing} (or holds others)")
    model = {t.out_name for t in out["model"]}
    lacking = [n for n in params if n not in model]
    if lacking:
        raise ExportError(f"{src}: model lacks the weights of parameters {lacking[:5]}")
    for t in out["optimizer.fp32_master"]:
        weight = next(w for w in out["model"] if w.out_name == t.out_name)
        if weight.shape != t.shape:
            raise ExportError(
                f"{src}: tensor {t.name!r} has shape {list(t.shape)}, its weight {weight.name!r} {list(weight.shape)}"
            )
    return out


def export_ds_universal(
    storage: Storage,
    name: str,
    manifest: Manifest,
    out_dir: Path,
    *,
    src: str,
    tag: str | None,
    budget: int,
    verify: bool,
    progress: Progress | None = None,
) -> tuple[list[str], int, int]:
    """Write the universal checkpoint of ``manifest`` into ``out_dir``; (files written relative to it,
    tensors, bytes)."""
    import torch

    sections = _sections(manifest, src)
    step = _value(manifest, "global_steps", manifest.step)
    if step is None:
        raise ExportError(f"{src}: no global_steps (and no step in the manifest)")
    adam_step = _value(manifest, "optimizer.adam_step", step)
    hparams = _value(manifest, "optimizer.hparams", {}) or {}
    tag = tag or f"global_step{int(step)}"
    if not tag or "/" in tag or tag in (".", ".."):
        raise ExportError(f"tag {tag!r}: a single folder name")
    root = out_dir / tag
    zero = root / "zero"
    zero.mkdir(parents=True)
    files: list[str] = []

    def save(obj: Any, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(obj, path)
        files.append(str(path.relative_to(out_dir)))

    masters = sections["optimizer.fp32_master"]
    order = [t.out_name for t in masters]
    wanted = [t for key in MOMENT_FILES for t in sections[f"optimizer.{key}"]]
    section_of = {id(t): key for key in MOMENT_FILES for t in sections[f"optimizer.{key}"]}
    total, done = sum(t.nbytes for t in wanted), 0
    step_value = torch.tensor(float(adam_step), dtype=torch.float32)
    for t, value in one_by_one(read_batches(storage, name, manifest, wanted, budget=budget, verify=verify)):
        section = section_of[id(t)]
        param_dir = zero / _escape(t.out_name, src)
        save({"param": value.to(torch.float32).clone(), "cat_dim": 0}, param_dir / f"{MOMENT_FILES[section]}.pt")
        if section == "fp32_master":
            save(step_value.clone(), param_dir / "step.pt")
        done += t.nbytes
        if progress is not None:
            progress(done, total, t.out_name)
        del value
    weights = {t.out_name: t for t in sections["model"]}
    module: OrderedDict[str, Any] = OrderedDict()
    for t, value in one_by_one(
        read_batches(storage, name, manifest, list(weights.values()), budget=budget, verify=verify)
    ):
        module[t.out_name] = value.clone()
    buffers = [n for n in module if n not in set(order)]
    world = int(manifest.metadata.get("world_size", 1) or 1)
    lr = float(hparams.get("lr", 0.0))
    group = {
        "lr": lr,
        "betas": tuple(float(b) for b in hparams.get("betas", (0.9, 0.999))),
        "eps": float(hparams.get("eps", 1e-8)),
        "weight_decay": float(hparams.get("weight_decay", 0.0)),
        "amsgrad": False,
        "params": [0],
    }
    save(
        {
            "ds_version": DS_VERSION,
            "zero_stage": int(manifest.metadata.get("zero_stage", 1) or 1),
            "partition_count": world,
            "dynamic_loss_scale": False,
            "overflow": False,
            "clip_grad": 0.0,
            "param_groups": [group],
            "optimizer_state_dict": {"state": {0: {"step": step_value.clone()}}, "param_groups": [group]},
        },
        zero / "optimizer_state.pt",
    )
    model_states: dict[str, Any] = {
        "module": module,
        "buffer_names": buffers,
        "optimizer": None,
        "param_shapes": [OrderedDict((n, torch.Size(weights[n].shape)) for n in order)],
        "frozen_param_shapes": None,
        "shared_params": {},
        "frozen_param_fragments": None,
        "lr_scheduler": None,
        "data_sampler": None,
        "random_ltd": None,
        "sparse_tensor_module_names": set(),
        "skipped_steps": int(_value(manifest, "skipped_steps", 0) or 0),
        "global_steps": int(step),
        "global_samples": int(step),
        "dp_world_size": world,
        "mp_world_size": 1,
        "ds_config": {},
        "ds_version": DS_VERSION,
    }
    save(model_states, root / "mp_rank_00_model_states.pt")
    # a ZeRO-3 engine looks its model states up under ZeRO-3's name (zero_pp_rank_0_mp_rank_*): the same
    # counters and shapes, without the weights (ZeRO-3 takes them from zero/, and the file above has them)
    save({**model_states, "module": OrderedDict()}, root / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    (out_dir / LATEST).write_text(tag)
    files.append(LATEST)
    return files, len(wanted) + len(module), total + sum(t.nbytes for t in weights.values())


def _escape(param: str, src: str) -> str:
    """The folder of parameter ``param`` under ``zero/`` (DeepSpeed names it by the parameter's name)."""
    if not param or "/" in param or os.sep in param or param in (".", ".."):
        raise ExportError(f"{src}: parameter name {param!r} cannot be a folder name under zero/")
    return param
