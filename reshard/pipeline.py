"""Pipeline stages: which stage(s) hold each tensor.

Layer tensors go with their layer (read from the name by ``pipeline.layer``'s ``{i}``); the rest
by name to the first stage, the last, or both (tied). The first stage listed for a tensor is the
one that writes it on save.
"""

from __future__ import annotations

from typing import Sequence

from .errors import LayoutError
from .names import layer_index, name_matches
from .spec import Pipeline


def contiguous_stages(num_layers: int, pp: int) -> list[list[int]]:
    """Layers in contiguous blocks, as even as possible, the first stages getting one more."""
    q, r = divmod(num_layers, pp)
    out, start = [], 0
    for s in range(pp):
        n = q + (1 if s < r else 0)
        out.append(list(range(start, start + n)))
        start += n
    return out


def stage_layers(pipe: Pipeline, layers: set[int], pp: int) -> list[list[int]]:
    """The layer indices of every stage, checked against the layers the model has."""
    num_layers = max(layers) + 1 if layers else 0
    if pipe.stages is None:
        if pp > 1 and pp > num_layers:
            raise LayoutError(
                f"pp={pp} is larger than the number of layers ({num_layers}) "
                f"(layers are found by the name pattern {pipe.layer!r})"
            )
        return contiguous_stages(num_layers, pp)
    stages = [list(s) for s in pipe.stages]
    if len(stages) != pp:
        raise LayoutError(f"pipeline.stages lists {len(stages)} stages but pp={pp}")
    owner: dict[int, int] = {}
    for s, idxs in enumerate(stages):
        for i in idxs:
            if i not in layers:
                have = f"0..{num_layers - 1}" if num_layers else "none"
                raise LayoutError(f"pipeline.stages: stage {s} lists layer {i}, which the model lacks (layers: {have})")
            if i in owner:
                raise LayoutError(f"pipeline.stages: layer {i} is on stage {owner[i]} and stage {s}")
            owner[i] = s
    missing = sorted(layers - owner.keys())
    if missing:
        raise LayoutError(f"pipeline.stages: layers {missing[:8]}{'...' if len(missing) > 8 else ''} are on no stage")
    return stages


def assign_stages(pipe: Pipeline, names: Sequence[str], pp: int) -> dict[str, tuple[int, ...]]:
    """The stages holding each tensor, the saving stage first."""
    layer_of = {n: layer_index(pipe.layer, n) for n in names}
    layers = {i for i in layer_of.values() if i is not None}
    stage_of_layer = {i: s for s, idxs in enumerate(stage_layers(pipe, layers, pp)) for i in idxs}
    out: dict[str, tuple[int, ...]] = {}
    for name in names:
        i = layer_of[name]
        if i is not None:
            out[name] = (stage_of_layer[i],)
            continue
        lists = [
            (what, pats)
            for what, pats in (("first", pipe.first), ("last", pipe.last), ("tied", pipe.tied))
            if any(name_matches(p, name) for p in pats)
        ]
        if len(lists) > 1:
            raise LayoutError(f"tensor {name!r} matches both pipeline.{lists[0][0]} and pipeline.{lists[1][0]}")
        if not lists:
            if pp > 1:
                raise LayoutError(
                    f"tensor {name!r} is in no layer (pattern {pipe.layer!r}) and matches none of pipeline.first, "
                    "pipeline.last, pipeline.tied: say which stage holds it"
                )
            out[name] = (0,)
            continue
        what = lists[0][0]
        out[name] = (0,) if what == "first" else (pp - 1,) if what == "last" else tuple(sorted({0, pp - 1}))
    return out
