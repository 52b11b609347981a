"""The plain data-parallel layout: what a checkpoint that recorded no layout is taken to be.

Every tensor is replicated over the mesh (no tensor or pipeline parallelism: pattern ``...``), and
ZeRO, if any, partitions the parameters as one group in the given order. This is the layout a
plain DP/ZeRO training run has, so ``--dp N --zero S`` needs nothing more from the user; tensor
or pipeline parallel targets do (a layout file or a model preset), since how to split a tensor
cannot be guessed from its name.
"""

from __future__ import annotations

from typing import Sequence

from .errors import LayoutError
from .layout import Layout, Mesh, Zero

REPLICATED = "..."


def plain_layout(
    dp: int = 1, stage: int = 0, *, alignment: int = 1, groups: Sequence[Sequence[str]] | None = None
) -> Layout:
    """A layout replicating every tensor over ``dp`` ranks under ZeRO ``stage``.

    ``groups``: the ZeRO parameter groups as name patterns, first match wins (default: one group of
    every parameter); ``alignment``: partition sizes are multiples of this many elements.
    """
    if stage not in (0, 1, 2, 3):
        raise LayoutError(f"ZeRO stage {stage} is not one of 0, 1, 2, 3")
    zero_groups = (("*",),) if groups is None else tuple(tuple(g) for g in groups)
    return Layout(
        mesh=Mesh(dp=dp),
        zero=Zero(stage=stage, alignment=alignment, groups=zero_groups),
        default=REPLICATED,
    )


def is_plain(layout: Layout) -> bool:
    """Whether ``layout`` splits no tensor across tp or pp (only dp/ZeRO): any checkpoint fits it."""
    return layout.mesh.tp == 1 and layout.mesh.pp == 1 and not layout.rules and layout.default == REPLICATED
