"""reshard: pure layout math for moving tensors between parallel layouts (no I/O, no torch).

* ``box``      — N-d boxes and flat ranges of a tensor, and their intersections.
* ``pattern``  — the dim-pattern language (``(tp [q k v] | unit=128) h``), docs/patterns.md.
* ``shard``    — a pattern applied to one tensor and one rank: local shape and boxes.
* ``names``    — tensor-name patterns (``layers.{i}.*``).
* ``layout``   — the layout file (pydantic): mesh, ZeRO, rules, pipeline.
* ``pipeline`` — which stage holds which tensor.
* ``zero``     — ZeRO flat partitions and their global regions.
* ``resolve``  — what one rank holds: ``layout.resolve(shapes, coord) -> RankView``.
* ``runs``     — contiguity: boxes cut into row-major runs.
* ``plan``     — which stored bytes fill which target elements.
* ``presets``  — layouts for GPT (Megatron names) and Llama (Hugging Face names).
* ``plain``    — the plain DP/ZeRO layout (every tensor replicated): the default for unrecorded checkpoints.
"""

# ruff: noqa: F401 - the TYPE_CHECKING imports are for static tools

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .box import Box, FlatRange, check_exact_cover, flat_range_to_boxes, flat_span
    from .errors import LayoutError, PatternError, PlanError
    from .layout import Layout, Mesh, Pipeline, RankCoord, Rule, Zero
    from .pattern import Dim, Part, Pattern, parse_pattern
    from .plain import is_plain, plain_layout
    from .plan import CheckedSources, Copy, Fill, Plan, SourcePiece, check_sources, plan, plan_layout
    from .presets import ModelDims, gpt_layout, gpt_shapes, llama_layout, llama_shapes
    from .resolve import LocalBuffer, RankView, Resolver, Slot, merge_slots, state_name, state_shapes
    from .zero import local_flat_to_global, partition_size

# Public name -> its submodule, resolved on first use (PEP 562): ``import reshard.box`` (what reading a
# manifest needs) then costs the box math alone, not the layout language and planner (~40 ms at start-up
# of every command that reads a checkpoint).
_EXPORTS: dict[str, str] = {
    **dict.fromkeys(["Box", "FlatRange", "check_exact_cover", "flat_range_to_boxes", "flat_span"], "box"),
    **dict.fromkeys(["LayoutError", "PatternError", "PlanError"], "errors"),
    **dict.fromkeys(["Layout", "Mesh", "Pipeline", "RankCoord", "Rule", "Zero"], "layout"),
    **dict.fromkeys(["Dim", "Part", "Pattern", "parse_pattern"], "pattern"),
    **dict.fromkeys(["is_plain", "plain_layout"], "plain"),
    **dict.fromkeys(
        ["CheckedSources", "Copy", "Fill", "Plan", "SourcePiece", "check_sources", "plan", "plan_layout"], "plan"
    ),
    **dict.fromkeys(["ModelDims", "gpt_layout", "gpt_shapes", "llama_layout", "llama_shapes"], "presets"),
    **dict.fromkeys(
        ["LocalBuffer", "RankView", "Resolver", "Slot", "merge_slots", "state_name", "state_shapes"], "resolve"
    ),
    **dict.fromkeys(["local_flat_to_global", "partition_size"], "zero"),
}


class _Package(types.ModuleType):
    """This package's module type: ``reshard.plan`` stays the function ``plan`` (as when every name was
    imported eagerly) even after the submodule of that name is imported, which would otherwise replace it."""

    @property
    def plan(self) -> Any:
        from .plan import plan

        return plan

    @plan.setter
    def plan(self, value: Any) -> None:  # the import system setting the submodule: keep the function
        pass


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


__all__ = [
    "Box",
    "FlatRange",
    "check_exact_cover",
    "flat_range_to_boxes",
    "flat_span",
    "LayoutError",
    "PatternError",
    "PlanError",
    "Layout",
    "Mesh",
    "Pipeline",
    "RankCoord",
    "Rule",
    "Zero",
    "Dim",
    "Part",
    "Pattern",
    "parse_pattern",
    "CheckedSources",
    "Copy",
    "Fill",
    "Plan",
    "SourcePiece",
    "check_sources",
    "plan",
    "plan_layout",
    "is_plain",
    "plain_layout",
    "ModelDims",
    "gpt_layout",
    "gpt_shapes",
    "llama_layout",
    "llama_shapes",
    "LocalBuffer",
    "RankView",
    "Resolver",
    "Slot",
    "merge_slots",
    "state_name",
    "state_shapes",
    "local_flat_to_global",
    "partition_size",
]
