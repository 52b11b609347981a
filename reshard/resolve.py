"""Resolving a layout for a rank: what it holds of every tensor, and where that sits globally.

The result, a :class:`RankView`, is a set of :class:`LocalBuffer` s (model-form tensors, ZeRO
flat partitions), each a list of :class:`Slot` s: "region ``local`` of this buffer holds region
``glob`` of global tensor ``tensor``". Everything later — saving each region once, planning a load
from any checkpoint — works on slots, whatever the parallelism that produced them.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping, Sequence

from .box import Box, FlatRange, check_exact_cover
from .errors import LayoutError, PatternError
from .pattern import Pattern
from .pipeline import assign_stages
from .shard import shard
from .spec import LayoutSpec, RankCoord
from .zero import group_partition, local_flat_to_global, param_partition

Region = Box | FlatRange


@dataclass(frozen=True)
class Slot:
    """Region ``local`` of a buffer holds region ``glob`` of global tensor ``tensor``, element for element.

    Both regions list their elements in row-major order (a box) or in sequence (a flat range).
    ``replica`` is 0 on exactly one of the ranks holding the same region: the one that saves it.
    """

    tensor: str
    local: Region
    glob: Region
    replica: int = 0


@dataclass(frozen=True)
class LocalBuffer:
    """A rank-local tensor (``shape``) and the global regions it holds; elements in no slot are padding."""

    name: str
    shape: tuple[int, ...]
    slots: tuple[Slot, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def renamed(self, name: str, tensor: Callable[[str], str]) -> "LocalBuffer":
        """The same buffer under another name, its slots pointing at ``tensor(old name)``: e.g. an optimizer state."""
        return LocalBuffer(name, self.shape, tuple(replace(s, tensor=tensor(s.tensor)) for s in self.slots))


def state_name(param: str, key: str) -> str:
    """Default checkpoint name of optimizer state ``key`` of parameter ``param``."""
    return f"{param}.{key}"


def state_shapes(
    shapes: Mapping[str, Sequence[int]], key: str, name: Callable[[str, str], str] = state_name
) -> dict[str, tuple[int, ...]]:
    """Global shapes of an optimizer state's tensors: the parameters' shapes, renamed."""
    return {name(p, key): tuple(s) for p, s in shapes.items()}


@dataclass(frozen=True)
class RankView:
    """Everything one rank holds (docs/patterns.md, section 3)."""

    coord: RankCoord
    rank: int
    zero_stage: int
    tensors: dict[str, LocalBuffer]  # model form: TP/EP-local, whole over dp
    zero_groups: tuple[LocalBuffer, ...] = ()  # stage ≥ 1: this rank's flat partition of each param group
    zero_params: dict[str, LocalBuffer] = field(default_factory=dict)  # stage 3: each param's own partition
    optimized: frozenset[str] = frozenset()  # params in some ZeRO group (the rest are frozen)
    average: dict[str, tuple[str, ...]] = field(default_factory=dict)  # tensors merged by mean over these axes
    dp_split: frozenset[str] = frozenset()  # tensors whose pattern splits them over dp (ZeRO leaves them alone)

    def weights(self) -> list[LocalBuffer]:
        """The buffers holding model weights: under stage 3 the partitions (where ZeRO partitions the tensor)."""
        return [self.zero_params.get(n, t) for n, t in self.tensors.items()]

    def optimizer_state(self, key: str, name: Callable[[str, str], str] = state_name) -> list[LocalBuffer]:
        """The buffers of an optimizer state shaped like the params (``exp_avg``, fp32 master...), renamed.

        Under ZeRO these are the group partitions, plus the model-form tensors of params whose pattern
        already splits them over dp (ZeRO leaves those alone).
        """
        rename = lambda p: name(p, key)  # noqa: E731
        out = [g.renamed(f"{g.name}.{key}", rename) for g in self.zero_groups]
        for n, t in self.tensors.items():
            if n in self.optimized and (self.zero_stage == 0 or n in self.dp_split):
                out.append(t.renamed(rename(n), rename))
        return out


@dataclass(frozen=True)
class _Info:
    """Per tensor, rank-independent: its pattern, stages, ZeRO group."""

    rule: int | None
    pattern: Pattern
    stages: tuple[int, ...]
    group: int | None

    @property
    def expert(self) -> bool:
        return "ep" in self.pattern.axes


class Resolver:
    """A layout applied to a model's tensor shapes; cheap to ask for many ranks."""

    def __init__(self, layout: LayoutSpec, shapes: Mapping[str, Sequence[int]]) -> None:
        self.layout = layout
        self.shapes = {n: tuple(int(d) for d in s) for n, s in shapes.items()}
        names = list(self.shapes)
        patterns = layout.patterns(names)
        stages = assign_stages(layout.pipeline, names, layout.mesh.pp)
        zero = layout.zero
        self.info: dict[str, _Info] = {}
        for n in names:
            rule, pat = patterns[n]
            group = zero.group_of(n)
            self.info[n] = _Info(rule, pat, stages[n], group)
        for g in range(len(zero.groups)):
            kinds = {
                self.info[n].expert: n
                for n in names
                if self.info[n].group == g and "dp" not in self.info[n].pattern.axes
            }
            if len(kinds) > 1 and zero.stage >= 1:
                raise LayoutError(
                    f"ZeRO group {g} mixes tensors split over ep ({kinds[True]!r}) and not "
                    f"({kinds[False]!r}); their data-parallel groups differ: use separate groups"
                )

    def _context(self, name: str) -> str:
        info = self.info[name]
        rule = "the default pattern" if info.rule is None else f"rule {info.rule} {self.layout.rules[info.rule].name!r}"
        return f"tensor {name!r} {list(self.shapes[name])} ({rule})"

    def _shard(self, name: str, coord: RankCoord) -> tuple[tuple[int, ...], list[tuple[Box, Box]]]:
        info, mesh = self.info[name], self.layout.mesh
        try:
            return shard(
                info.pattern, self.shapes[name], mesh.axis_sizes(info.expert), mesh.axis_index(coord, info.expert)
            )
        except PatternError as exc:
            raise exc.in_pattern(info.pattern.text, self._context(name)) from None

    def _replica(self, name: str, coord: RankCoord, over_dp: bool) -> int:
        """Index among the ranks holding the same region (0 saves it): mixed radix over the replicating axes."""
        info, mesh = self.info[name], self.layout.mesh
        axes = info.pattern.axes
        index, size = mesh.axis_index(coord, info.expert), mesh.axis_sizes(info.expert)
        digits = [(info.stages.index(coord.pp), len(info.stages))]
        if "tp" not in axes:
            digits.append((index["tp"], size["tp"]))
        if over_dp and "dp" not in axes:
            digits.append((index["dp"], size["dp"]))
        rep = 0
        for d, n in digits:
            rep = rep * n + d
        return rep

    def view(self, coord: RankCoord | int) -> RankView:
        mesh, zero = self.layout.mesh, self.layout.zero
        if isinstance(coord, int):
            coord = mesh.coord(coord)
        coord = RankCoord(*coord)
        rank = mesh.rank(coord)
        held = [n for n, i in self.info.items() if coord.pp in i.stages]
        tensors: dict[str, LocalBuffer] = {}
        local: dict[str, tuple[tuple[int, ...], list[tuple[Box, Box]]]] = {}
        for n in held:
            shape, pairs = local[n] = self._shard(n, coord)
            rep = self._replica(n, coord, over_dp=True)
            tensors[n] = LocalBuffer(n, shape, tuple(Slot(n, lb, gb, rep) for lb, gb in pairs))
        dp_split = frozenset(n for n in held if "dp" in self.info[n].pattern.axes)
        partitioned = [n for n in held if n not in dp_split]  # what ZeRO flattens
        params: dict[str, LocalBuffer] = {}
        if zero.stage == 3:
            for n in partitioned:
                params[n] = self._param_partition(n, coord, local[n])
        groups: list[LocalBuffer] = []
        if zero.stage >= 1:
            for g in range(len(zero.groups)):
                members = [n for n in partitioned if self.info[n].group == g]
                groups.append(self._group(g, members, coord, local, params))
        optimized = frozenset(n for n in held if self.info[n].group is not None)
        average = {n: self.info[n].pattern.average for n in held if self.info[n].pattern.average}
        return RankView(coord, rank, zero.stage, tensors, tuple(groups), params, optimized, average, dp_split)

    def _dp(self, n: str, coord: RankCoord) -> tuple[int, int]:
        """(data-parallel group size, this rank's index) that ZeRO partitions tensor ``n`` over."""
        mesh, expert = self.layout.mesh, self.info[n].expert
        return mesh.axis_sizes(expert)["dp"], mesh.axis_index(coord, expert)["dp"]

    def _slots(self, n: str, coord: RankCoord, shard_: tuple, start: int, stop: int, buf_off: int) -> list[Slot]:
        """Slots for elements ``[start, stop)`` of tensor ``n``'s local flattening, placed at ``buf_off`` of a flat buffer."""
        shape, pairs = shard_
        rep = self._replica(n, coord, over_dp=False)
        return [
            Slot(n, FlatRange(buf_off + off, buf_off + off + region.numel), region, rep)
            for off, region in local_flat_to_global(shape, pairs, self.shapes[n], start, stop)
        ]

    def _param_partition(self, n: str, coord: RankCoord, shard_: tuple) -> LocalBuffer:
        """Stage 3: this rank's flat partition of one parameter."""
        parts, index = self._dp(n, coord)
        size, a, b = param_partition(math.prod(shard_[0]), parts, index, self.layout.zero.alignment)
        return LocalBuffer(n, (size,), tuple(self._slots(n, coord, shard_, a, b, 0)))

    def _group(
        self, g: int, members: list[str], coord: RankCoord, local: dict, params: dict[str, LocalBuffer]
    ) -> LocalBuffer:
        """This rank's flat partition of parameter group ``g`` (stage 3: the members' partitions, concatenated)."""
        slots: list[Slot] = []
        if self.layout.zero.stage == 3:
            pos = 0
            for n in members:
                for s in params[n].slots:
                    assert isinstance(s.local, FlatRange)
                    slots.append(replace(s, local=FlatRange(pos + s.local.start, pos + s.local.stop)))
                pos += params[n].numel
            return LocalBuffer(f"zero.{g}", (pos,), tuple(slots))
        parts, index = self._dp(members[0], coord) if members else (1, 0)
        numels = [math.prod(local[n][0]) for n in members]
        size, entries = group_partition(numels, parts, index, self.layout.zero.alignment)
        starts = [0, *itertools.accumulate(numels)]
        for i, a, b in entries:
            slots += self._slots(members[i], coord, local[members[i]], a, b, starts[i] + a - index * size)
        return LocalBuffer(f"zero.{g}", (size,), tuple(slots))


def _adjacent_rows(a: Box, b: Box) -> Box | None:
    """``a`` and ``b`` stacked along dim 0 (``b`` right after ``a``, same extent elsewhere), or None."""
    if a.ndim != b.ndim or a.ndim == 0 or a.offsets[1:] != b.offsets[1:] or a.shape[1:] != b.shape[1:]:
        return None
    if a.offsets[0] + a.shape[0] != b.offsets[0]:
        return None
    return Box(a.offsets, (a.shape[0] + b.shape[0],) + a.shape[1:])


def merge_slots(slots: Sequence[Slot]) -> list[Slot]:
    """Join consecutive slots that continue each other both locally and globally.

    A fused tensor at tp = 1 (``(tp [q k v]) h``) resolves to one slot per part although the rank
    holds the whole tensor; merged, it is one piece, which is what ucp expects of a rank.
    """
    out: list[Slot] = []
    for s in slots:
        if out and out[-1].tensor == s.tensor and out[-1].replica == s.replica:
            prev = out[-1]
            if (
                isinstance(prev.local, Box)
                and isinstance(s.local, Box)
                and isinstance(prev.glob, Box)
                and isinstance(s.glob, Box)
            ):
                local, glob = _adjacent_rows(prev.local, s.local), _adjacent_rows(prev.glob, s.glob)
                if local is not None and glob is not None:
                    out[-1] = Slot(s.tensor, local, glob, s.replica)
                    continue
            if (
                isinstance(prev.local, FlatRange)
                and isinstance(s.local, FlatRange)
                and isinstance(prev.glob, FlatRange)
                and isinstance(s.glob, FlatRange)
                and prev.local.stop == s.local.start
                and prev.glob.stop == s.glob.start
            ):
                out[-1] = Slot(
                    s.tensor,
                    FlatRange(prev.local.start, s.local.stop),
                    FlatRange(prev.glob.start, s.glob.stop),
                    s.replica,
                )
                continue
        out.append(s)
    return out


def check_layout(layout: LayoutSpec, shapes: Mapping[str, Sequence[int]]) -> None:
    """Raise LayoutError unless the regions saved (replica 0) by all ranks tile every tensor exactly once.

    Checked separately for the weights and, where ZeRO partitions them, for the optimizer state.
    """
    res = Resolver(layout, shapes)
    weights: dict[str, list[Region]] = {n: [] for n in res.shapes}
    states: dict[str, list[Region]] = {n: [] for n in res.shapes if res.info[n].group is not None}
    for coord in layout.mesh.coords():
        view = res.view(coord)
        for buf in view.weights():
            for s in buf.slots:
                if s.replica == 0:
                    weights[s.tensor].append(s.glob)
        for buf in view.optimizer_state("state", lambda p, k: p):
            for s in buf.slots:
                if s.replica == 0:
                    states[s.tensor].append(s.glob)
    for what, table in (("weights", weights), ("optimizer state", states)):
        for n, regions in table.items():
            why = check_exact_cover(regions, res.shapes[n])
            if why is not None:
                raise LayoutError(
                    f"{res._context(n)}: the {what} saved by all ranks do not tile it exactly once: {why}"
                )
