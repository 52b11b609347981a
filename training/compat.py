"""Does a checkpoint fit this engine? Checked from its manifest, before a resume overwrites anything.

``ucp.load(path, into=...)`` refuses a tensor of another shape, or one the checkpoint lacks, but
loading an engine's pieces cannot see what else is wrong:

* model tensors the engine does not have (a deeper model loads into a shallower one: its first layers);
* another model config with the same tensor shapes (``n_head`` 8 instead of 4 at the same ``d_model``);
* another data seed: the data stream is a function of (data_seed, step), so the resumed run would
  train on another stream.

:func:`check_resumable` names every one of these at once. Checkpoints that do not record the model
config or the data seed (imported from another framework) are checked for what they do record.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from ucp import CheckpointError, Manifest
from ucp.format.tree import decode_state, dict_items

from .models.gpt import GPTConfig

MODEL_PREFIX = "model."  # manifest names of the weights: "model." + the parameter name
INIT_ONLY = frozenset({"init_std"})  # config fields that only shape the initial weights: free to differ
_ABSENT = object()


def check_resumable(
    manifest: Manifest, where: str, model: GPTConfig, shapes: Mapping[str, Iterable[int]], data_seed: int
) -> None:
    """Raise a CheckpointError naming what does not fit: model tensors (missing, extra, other shape),
    model config fields, data seed. ``shapes``: this engine's global parameter shapes by name."""
    problems = [*_tensor_problems(manifest, shapes), *_config_problems(manifest.metadata.get("model"), model)]
    saved_seed = _recorded_data_seed(manifest)
    if saved_seed is not None and saved_seed != data_seed:
        problems.append(
            f"it was trained on the data stream of data_seed {saved_seed}, this engine has data_seed "
            f"{data_seed} (resuming would train on another stream: use data_seed={saved_seed})"
        )
    if problems:
        raise CheckpointError(f"checkpoint {where} does not fit this engine: " + "; ".join(problems), file=where)


def _tensor_problems(manifest: Manifest, shapes: Mapping[str, Iterable[int]]) -> list[str]:
    saved = {n: tuple(t.shape) for n, t in manifest.tensors.items() if n.startswith(MODEL_PREFIX)}
    mine = {MODEL_PREFIX + n: tuple(s) for n, s in shapes.items()}
    problems = []
    missing = [n for n in mine if n not in saved]
    if missing:
        problems.append(f"tensors this model has and the checkpoint lacks: {_names(missing)}")
    extra = [n for n in saved if n not in mine]
    if extra:
        problems.append(f"tensors the checkpoint has and this model lacks: {_names(extra)}")
    problems += [
        f"tensor {n} is {list(saved[n])} in the checkpoint, {list(s)} in this model"
        for n, s in mine.items()
        if n in saved and saved[n] != s
    ]
    return problems


def _config_problems(recorded: Any, model: GPTConfig) -> list[str]:
    """Fields of the recorded model config (``metadata["model"]``, as Engine.save writes it) that differ."""
    if recorded is None:
        return []
    if not isinstance(recorded, Mapping):
        return [f"metadata['model'] is not a model config: {recorded!r}"]
    saved, mine = _with_defaults(recorded), _with_defaults(model.model_dump(mode="json"))
    differ = [
        f"{k} {_value(saved, k)} vs {_value(mine, k)}"
        for k in sorted(saved.keys() | mine.keys())
        if k not in INIT_ONLY and saved.get(k, _ABSENT) != mine.get(k, _ABSENT)
    ]
    return (
        [f"it was written by another model config (checkpoint vs this engine: {', '.join(differ)})"] if differ else []
    )


def _value(config: Mapping[str, Any], key: str) -> str:
    return repr(config[key]) if key in config else "(no such field)"


def _with_defaults(config: Mapping[str, Any]) -> dict[str, Any]:
    """A config as a dict of every field: defaults for those it does not record (an older writer), and
    ``n_kv_head`` resolved (None means ``n_head``), so equal models compare equal."""
    out = {k: f.default for k, f in GPTConfig.model_fields.items() if not f.is_required()} | dict(config)
    if out.get("n_kv_head") is None:
        out["n_kv_head"] = out.get("n_head")
    return out


def _recorded_data_seed(manifest: Manifest) -> int | None:
    """``rng.data_seed`` of the saved state (a plain value in the manifest's state tree), if recorded."""
    rng = dict(dict_items(manifest.state)).get("rng")
    if rng is None:
        return None
    rng = decode_state(rng, lambda name: None)
    seed = rng.get("data_seed") if isinstance(rng, dict) else None
    return seed if isinstance(seed, int) and not isinstance(seed, bool) else None


def _names(names: list[str], limit: int = 6) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
