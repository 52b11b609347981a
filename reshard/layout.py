"""The layout: its document (:mod:`reshard.spec`) with resolving (:mod:`reshard.resolve`) on top.

``Layout`` is what users build, load and resolve; the models it is made of (``Mesh``, ``Zero``,
``Rule``, ``Pipeline``, ``RankCoord``) live in :mod:`reshard.spec` and are re-exported here.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from .resolve import RankView, Resolver, check_layout
from .spec import ORDER_AXES, LayoutSpec, Mesh, Pipeline, RankCoord, Rule, Zero, validation_line

__all__ = ["ORDER_AXES", "Layout", "Mesh", "Pipeline", "RankCoord", "Rule", "Zero", "validation_line"]


class Layout(LayoutSpec):
    """How every tensor of a model is laid out over a mesh. See docs/patterns.md."""

    # -- resolving (reshard.resolve) ----------------------------------------------------------
    def resolve(self, shapes: Mapping[str, Sequence[int]], coord: RankCoord | int) -> RankView:
        """What rank ``coord`` (a coordinate or a rank number) holds of every tensor; see reshard.resolve."""
        return Resolver(self, shapes).view(coord)

    def resolve_all(self, shapes: Mapping[str, Sequence[int]]) -> list[RankView]:
        """Every rank's view, in rank order."""
        res = Resolver(self, shapes)
        return [res.view(c) for c in self.mesh.coords()]

    def check(self, shapes: Mapping[str, Sequence[int]]) -> None:
        """Resolve every rank and verify that what ranks write on save tiles every tensor exactly once."""
        check_layout(self, shapes)
