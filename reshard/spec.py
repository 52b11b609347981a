"""The layout document (pydantic): mesh, ZeRO settings, dim-pattern rules and pipeline assignment.

A layout is data, saved and loaded as JSON (docs/patterns.md, section 2). This module holds the
models, the rank numbering and the rule matching: what :mod:`reshard.pipeline` and
:mod:`reshard.resolve` read. :class:`reshard.layout.Layout` adds resolving on top, so that the
dependencies run one way: spec <- pipeline <- resolve <- layout.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator, Literal, NamedTuple, Sequence, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import LayoutError, PatternError
from .names import name_matches, name_regex
from .pattern import Pattern, parse_pattern

_MODEL = ConfigDict(extra="forbid", frozen=True)
ORDER_AXES = ("tp", "dp", "pp")


class RankCoord(NamedTuple):
    """A rank's position in the mesh. The ep index is derived: ``dp % ep`` (docs/patterns.md, Mesh)."""

    tp: int = 0
    pp: int = 0
    dp: int = 0


class Mesh(BaseModel):
    """Mesh sizes. World size is tp·pp·dp; ep lives inside dp and must divide it."""

    model_config = _MODEL
    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    dp: int = Field(1, ge=1)
    ep: int = Field(1, ge=1)
    order: tuple[str, str, str] = Field(
        ORDER_AXES, description="axes from fastest- to slowest-varying in the rank number"
    )

    @model_validator(mode="after")
    def _check(self) -> "Mesh":
        if self.dp % self.ep:
            raise ValueError(
                f"ep={self.ep} must divide dp={self.dp} (expert parallelism lives inside data parallelism)"
            )
        if sorted(self.order) != sorted(ORDER_AXES):
            raise ValueError(f"order {list(self.order)} must be a permutation of {list(ORDER_AXES)}")
        return self

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def size(self, axis: str) -> int:
        return int(getattr(self, axis))

    def rank(self, coord: RankCoord) -> int:
        """The global rank number of a coordinate."""
        self._check_coord(coord)
        rank = 0
        for axis in reversed(self.order):
            rank = rank * self.size(axis) + getattr(coord, axis)
        return rank

    def coord(self, rank: int) -> RankCoord:
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} is outside world size {self.world_size}")
        values = {}
        for axis in self.order:
            rank, values[axis] = divmod(rank, self.size(axis))
        return RankCoord(**values)

    def coords(self) -> Iterator[RankCoord]:
        """Every coordinate, in rank order."""
        for r in range(self.world_size):
            yield self.coord(r)

    def _check_coord(self, coord: RankCoord) -> None:
        for axis in ORDER_AXES:
            v = getattr(coord, axis)
            if not 0 <= v < self.size(axis):
                raise LayoutError(f"rank coordinate {tuple(coord)}: {axis}={v} is outside 0..{self.size(axis) - 1}")

    def axis_sizes(self, expert: bool) -> dict[str, int]:
        """Rank counts along tp/dp/ep as seen by a tensor; for an expert tensor dp means expert-data-parallel."""
        return {"tp": self.tp, "ep": self.ep, "dp": self.dp // self.ep if expert else self.dp}

    def axis_index(self, coord: RankCoord, expert: bool) -> dict[str, int]:
        return {"tp": coord.tp, "ep": coord.dp % self.ep, "dp": coord.dp // self.ep if expert else coord.dp}


class Rule(BaseModel):
    """Tensors whose name matches ``name`` are laid out as ``dims`` says."""

    model_config = _MODEL
    name: str
    dims: str
    optional: bool = Field(False, description="no error when this rule matches no tensor")

    @model_validator(mode="after")
    def _parse(self) -> "Rule":
        try:
            name_regex(self.name)
            parse_pattern(self.dims)
        except PatternError as exc:
            raise ValueError(str(exc.within(f"rule {self.name!r}"))) from None
        except LayoutError as exc:
            raise ValueError(str(exc)) from None
        return self

    @property
    def pattern(self) -> Pattern:
        return parse_pattern(self.dims)


class Zero(BaseModel):
    """ZeRO stage, partition alignment (elements) and parameter groups (first matching group wins)."""

    model_config = _MODEL
    stage: Literal[0, 1, 2, 3] = 0
    alignment: int = Field(1, ge=1)
    groups: tuple[tuple[str, ...], ...] = (("*",),)

    @field_validator("groups")
    @classmethod
    def _names(cls, groups: tuple[tuple[str, ...], ...]) -> tuple[tuple[str, ...], ...]:
        for g in groups:
            for pat in g:
                name_regex(pat)
        return groups

    def group_of(self, name: str) -> int | None:
        for i, g in enumerate(self.groups):
            if any(name_matches(p, name) for p in g):
                return i
        return None


class Pipeline(BaseModel):
    """Which stage holds which tensor: layers by index, the rest by name (docs/patterns.md)."""

    model_config = _MODEL
    layer: str = Field("*layers.{i}.*", description="name pattern whose {i} is the layer index")
    stages: tuple[tuple[int, ...], ...] | None = Field(
        None, description="layer indices per stage; None: contiguous blocks"
    )
    first: tuple[str, ...] = ()
    last: tuple[str, ...] = ()
    tied: tuple[str, ...] = Field((), description="held by the first and the last stage, saved once")

    @model_validator(mode="after")
    def _check(self) -> "Pipeline":
        if self.layer.count("{i}") != 1:
            raise ValueError(f"pipeline.layer {self.layer!r} must hold exactly one {{i}}")
        for pat in (self.layer, *self.first, *self.last, *self.tied):
            name_regex(pat)
        return self


_L = TypeVar("_L", bound="LayoutSpec")  # the class a classmethod is called on: Layout.load gives a Layout


class LayoutSpec(BaseModel):
    """How every tensor of a model is laid out over a mesh, as data (docs/patterns.md); use :class:`reshard.Layout`."""

    model_config = _MODEL
    version: Literal[1] = 1
    mesh: Mesh = Mesh()
    zero: Zero = Zero()
    rules: tuple[Rule, ...] = ()
    default: str | None = Field(None, description="dim pattern for tensors no rule matches (e.g. '...'); None: error")
    pipeline: Pipeline = Pipeline()

    @field_validator("default")
    @classmethod
    def _default(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                parse_pattern(v)
            except PatternError as exc:
                raise ValueError(str(exc.within("default"))) from None
        return v

    # -- files --------------------------------------------------------------------------------
    @classmethod
    def from_json(cls: type[_L], data: str | bytes, source: str = "layout") -> _L:
        """Parse a layout document; errors are LayoutError naming ``source`` and the field at fault."""
        try:
            return cls.model_validate_json(data)
        except ValidationError as exc:
            raise LayoutError(f"{source}: {validation_line(exc)}") from None

    @classmethod
    def load(cls: type[_L], path: str | Path) -> _L:
        return cls.from_json(Path(path).read_bytes(), source=str(path))

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), indent=1) + "\n"

    def dump(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    def replace(self: _L, **changes: object) -> _L:
        """A copy with some fields changed (e.g. another mesh), validated again."""
        data = self.model_dump()
        for k, v in changes.items():
            data[k] = v.model_dump() if isinstance(v, BaseModel) else v
        return type(self).model_validate(data)

    # -- rules --------------------------------------------------------------------------------
    def patterns(self, names: Sequence[str]) -> dict[str, tuple[int | None, Pattern]]:
        """The rule index (None: default) and pattern of every name; errors on no match, ambiguity, unused rules."""
        out: dict[str, tuple[int | None, Pattern]] = {}
        used = [False] * len(self.rules)
        for name in names:
            hits = [i for i, r in enumerate(self.rules) if name_matches(r.name, name)]
            if len(hits) > 1:
                a, b = self.rules[hits[0]], self.rules[hits[1]]
                raise LayoutError(
                    f"tensor {name!r} matches two rules: {hits[0]} {a.name!r} ({a.dims}) and "
                    f"{hits[1]} {b.name!r} ({b.dims}); make the name patterns disjoint"
                )
            if hits:
                used[hits[0]] = True
                out[name] = (hits[0], self.rules[hits[0]].pattern)
            elif self.default is not None:
                out[name] = (None, parse_pattern(self.default))
            else:
                raise LayoutError(
                    f"tensor {name!r} matches no rule and the layout has no default "
                    '(add a rule, or "default": "..." to replicate such tensors)'
                )
        for i, (rule, hit) in enumerate(zip(self.rules, used)):
            if not hit and not rule.optional:
                raise LayoutError(
                    f"rule {i} {rule.name!r} ({rule.dims}) matches no tensor "
                    '(a typo? mark it "optional": true if the tensor may be absent)'
                )
        return out


def validation_line(exc: ValidationError) -> str:
    """pydantic's first error as one line: ``mesh.tp: Input should be a valid integer`` (+ how many more)."""
    errors = exc.errors(include_url=False)
    first = errors[0]
    loc = ".".join(str(p) for p in first.get("loc", ()))
    msg = str(first.get("msg", "")).removeprefix("Value error, ")
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{loc + ': ' if loc else ''}{msg}{more}"
