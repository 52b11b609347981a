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

from .box import Box, FlatRange, check_exact_cover, flat_range_to_boxes, flat_span
from .errors import LayoutError, PatternError, PlanError
from .layout import Layout, Mesh, Pipeline, RankCoord, Rule, Zero
from .pattern import Dim, Part, Pattern, parse_pattern
from .plain import is_plain, plain_layout
from .plan import CheckedSources, Copy, Fill, Plan, SourcePiece, check_sources, plan, plan_layout
from .presets import ModelDims, gpt_layout, gpt_shapes, llama_layout, llama_shapes
from .resolve import LocalBuffer, RankView, Resolver, Slot, merge_slots, state_name, state_shapes
from .zero import local_flat_to_global, partition_size

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
