"""Process groups for a (tp, pp, dp) mesh, numbered as the layout numbers ranks.

Rank numbering is :class:`reshard.Mesh`'s: ``mesh.order`` lists the axes from fastest- to
slowest-varying, default ``("tp", "dp", "pp")`` (Megatron): ``rank = tp + TP·(dp + DP·pp)``.
Using the layout's own numbering means a rank's coordinate here is the coordinate the checkpoint
layout resolves, with no translation table to get wrong.

Every rank must create every group, in the same order (torch.distributed.new_group is collective),
so :func:`build_mesh` walks all lines of every axis on every rank. Axes of size 1 get no group
(``None``): collectives over them are skipped. Without torch.distributed (one process) every
group is ``None``. Groups are handed out wrapped in :class:`training.comm.Comm`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from reshard import Mesh, RankCoord

from .comm import Comm

AXES = ("tp", "pp", "dp")


@dataclass(frozen=True)
class ParallelMesh:
    """This rank's place in the mesh and its groups (None: size 1 or not distributed)."""

    mesh: Mesh
    rank: int
    coord: RankCoord
    tp_comm: Comm
    pp_comm: Comm
    dp_comm: Comm
    embed_comm: Comm  # first and last pipeline stage (tied embedding gradients); solo unless pp > 1
    world: Comm

    @property
    def tp(self) -> int:
        return self.mesh.tp

    @property
    def pp(self) -> int:
        return self.mesh.pp

    @property
    def dp(self) -> int:
        return self.mesh.dp

    @property
    def first_stage(self) -> bool:
        return self.coord.pp == 0

    @property
    def last_stage(self) -> bool:
        return self.coord.pp == self.mesh.pp - 1

    def stage_rank(self, stage: int) -> int:
        """Global rank of pipeline stage ``stage`` with this rank's tp and dp index."""
        return self.pp_comm.ranks[stage]

    def as_dict(self) -> dict[str, int]:
        """Axis sizes, for ucp.save's ``mesh=`` (product = world size)."""
        return {"tp": self.mesh.tp, "pp": self.mesh.pp, "dp": self.mesh.dp}


def _line(mesh: Mesh, coord: RankCoord, axis: str) -> tuple[int, ...]:
    """Global ranks that share every coordinate of ``coord`` except ``axis``, in axis order."""
    return tuple(mesh.rank(coord._replace(**{axis: i})) for i in range(mesh.size(axis)))


def build_mesh(mesh: Mesh | dict[str, Any]) -> ParallelMesh:
    """Create the tp/pp/dp (and embedding) groups; call on every rank (collective)."""
    if isinstance(mesh, dict):
        mesh = Mesh(**mesh)
    distributed = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if distributed else 1
    rank = dist.get_rank() if distributed else 0
    if mesh.world_size != world:
        raise ValueError(
            f"mesh tp={mesh.tp} × pp={mesh.pp} × dp={mesh.dp} = {mesh.world_size} ranks, but the world has {world}"
        )
    if mesh.ep != 1:
        raise ValueError("expert parallelism (ep > 1) is not supported by the training runtime")
    coord = mesh.coord(rank)
    groups: dict[str, Any] = {}
    for axis in AXES:
        mine = _line(mesh, coord, axis)
        groups[axis] = None
        if mesh.size(axis) == 1 or not distributed:
            continue
        seen: set[tuple[int, ...]] = set()
        for c in mesh.coords():  # every line of this axis, in rank order, on every rank
            line = _line(mesh, c, axis)
            if line in seen:
                continue
            seen.add(line)
            g = dist.new_group(list(line))
            if line == mine:
                groups[axis] = g
    embed_ranks: tuple[int, ...]
    embed, embed_ranks = None, (rank,)
    if distributed and mesh.pp > 1:
        for tp_i, dp_i in itertools.product(range(mesh.tp), range(mesh.dp)):
            ends = (mesh.rank(RankCoord(tp_i, 0, dp_i)), mesh.rank(RankCoord(tp_i, mesh.pp - 1, dp_i)))
            g = dist.new_group(list(ends))
            if rank in ends:
                embed, embed_ranks = g, ends
    comm = {a: Comm.of(_line(mesh, coord, a), groups[a], rank) for a in AXES}
    return ParallelMesh(
        mesh, rank, coord, comm["tp"], comm["pp"], comm["dp"], Comm.of(embed_ranks, embed, rank), Comm.world()
    )
