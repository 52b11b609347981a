"""The dim-pattern language of docs/patterns.md: tokenizer, parser and AST.

A pattern such as ``(tp [q:32*128 k:8*128 v:8*128] | unit=128) h`` says how each dimension
of a global tensor is split over mesh axes. Parsing only checks the pattern itself; whether it
fits a given tensor (rank, divisibility, asserted sizes) is checked by :mod:`reshard.shard`.
Errors carry the pattern text and the span at fault, rendered with a caret.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache

from .errors import PatternError

AXES = ("tp", "dp", "ep")  # mesh axes that may split a dimension
MESH_AXES = AXES + ("pp",)
UNEVEN_RULES = ("first", "ceil")

_TOKEN = re.compile(r"\s*(?:(\.\.\.)|([A-Za-z_][A-Za-z0-9_]*)|(\d+)|([()\[\]|,=:*+]))")


@dataclass(frozen=True)
class Part:
    """One part of a fused dimension: its name and global size (None: derived, see Dim.part_sizes)."""

    name: str
    size: int | None
    span: tuple[int, int] = field(compare=False)


@dataclass(frozen=True)
class Dim:
    """One dimension of a pattern: a label, the axes splitting it (outer first) and split options."""

    label: str | None  # None for fused parts
    axes: tuple[str, ...] = ()
    size: int | None = None  # asserted global size (label:N)
    parts: tuple[Part, ...] | None = None
    unit: int = 1
    pad: int | None = None
    uneven: str | None = None  # None (even), "first" or "ceil"
    span: tuple[int, int] = field(default=(0, 0), compare=False)


@dataclass(frozen=True)
class Pattern:
    """A parsed dim pattern. ``dims`` excludes the ``...``, which stands at index ``ellipsis``."""

    text: str
    dims: tuple[Dim, ...]
    ellipsis: int | None = None
    average: tuple[str, ...] = ()
    ellipsis_span: tuple[int, int] = field(default=(0, 0), compare=False)

    @property
    def axes(self) -> tuple[str, ...]:
        """Every axis that splits some dimension, in pattern order."""
        return tuple(a for d in self.dims for a in d.axes)

    def fits_rank(self, ndim: int) -> bool:
        return ndim == len(self.dims) if self.ellipsis is None else ndim >= len(self.dims)

    def expand(self, ndim: int) -> tuple[Dim, ...]:
        """One Dim per tensor dimension, ``...`` replaced by unsplit dims (caller checked fits_rank)."""
        if self.ellipsis is None:
            return self.dims
        fill = tuple(Dim(None, span=self.ellipsis_span) for _ in range(ndim - len(self.dims)))
        return self.dims[: self.ellipsis] + fill + self.dims[self.ellipsis :]

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True)
class _Tok:
    kind: str  # "name", "int", "...", a punctuation character, or "end"
    text: str
    start: int
    stop: int


def _tokenize(text: str) -> list[_Tok]:
    toks, pos = [], 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        m = _TOKEN.match(text, pos)
        if m is None:
            bad = len(text) - len(text[pos:].lstrip())
            raise PatternError(f"unexpected character {text[bad]!r}", text, (bad, bad + 1))
        ell, name, num, punct = m.groups()
        start = m.start(m.lastindex or 0)
        kind = "..." if ell else "name" if name else "int" if num else punct
        toks.append(_Tok(kind, m.group(m.lastindex or 0), start, m.end()))
        pos = m.end()
    toks.append(_Tok("end", "", len(text), len(text)))
    return toks


class _Parser:
    """Recursive descent over the grammar in docs/patterns.md."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.toks = _tokenize(text)
        self.i = 0

    # -- helpers ------------------------------------------------------------------------------
    @property
    def tok(self) -> _Tok:
        return self.toks[self.i]

    def take(self) -> _Tok:
        t = self.toks[self.i]
        self.i += 1
        return t

    def fail(self, msg: str, start: int, stop: int) -> PatternError:
        return PatternError(msg, self.text, (start, stop))

    def expect(self, kind: str, what: str) -> _Tok:
        if self.tok.kind != kind:
            got = "the end of the pattern" if self.tok.kind == "end" else repr(self.tok.text)
            raise self.fail(f"expected {what}, found {got}", self.tok.start, max(self.tok.stop, self.tok.start + 1))
        return self.take()

    # -- grammar ------------------------------------------------------------------------------
    def pattern(self) -> Pattern:
        dims: list[Dim] = []
        ellipsis, ell_span = None, (0, 0)
        while self.tok.kind not in ("|", "end"):
            t = self.tok
            if t.kind == "...":
                if ellipsis is not None:
                    raise self.fail("only one '...' is allowed", t.start, t.stop)
                ellipsis, ell_span = len(dims), (t.start, t.stop)
                self.take()
            elif t.kind == "(":
                dims.append(self.group())
            elif t.kind == "name":
                dims.append(self.plain())
            elif t.kind == "[":
                raise self.fail("fused parts go inside a split group, e.g. (tp [q k v])", t.start, t.stop)
            else:
                raise self.fail(f"expected a dimension, found {t.text!r}", t.start, t.stop)
        average: tuple[str, ...] = ()
        if self.tok.kind == "|":
            self.take()
            for name, (value, span) in self.options("tensor").items():
                if name != "avg":
                    raise self.fail(f"unknown tensor option {name!r} (known: avg)", *span)
                average = self._axes_value(value, span, default=("tp",))
        self.expect("end", "the end of the pattern")
        pat = Pattern(self.text, tuple(dims), ellipsis, average, ell_span)
        self._check_axes(pat)
        return pat

    def plain(self) -> Dim:
        t = self.take()
        self._check_label(t)
        size = self.size_suffix()
        return Dim(t.text, size=size, span=(t.start, self.toks[self.i - 1].stop))

    def group(self) -> Dim:
        open_ = self.take()
        axes: list[str] = []
        names: list[_Tok] = []
        while self.tok.kind == "name":
            nxt = self.toks[self.i + 1]
            if nxt.kind in (":",) or self.tok.text not in MESH_AXES:
                break
            names.append(self.take())
        for t in names:
            if t.text == "pp":
                raise self.fail("pp cannot split a dimension: pipeline stages own whole tensors", t.start, t.stop)
            axes.append(t.text)
        if len(set(axes)) != len(axes):
            raise self.fail("an axis appears twice in one group", open_.start, self.tok.start)
        if not axes:
            t = self.tok
            nxt = self.toks[min(self.i + 1, len(self.toks) - 1)]
            if t.kind == "name" and nxt.kind == "name" and nxt.text in MESH_AXES:
                raise self.fail(
                    "the split axes must come before the extent, e.g. (tp r); interleaved (strided) "
                    "splits are not supported",
                    nxt.start,
                    nxt.stop,
                )
            if t.kind == "name":
                raise self.fail(
                    f"{t.text!r} is not a mesh axis (axes: {', '.join(AXES)}); a group is (axis... extent), e.g. (tp r)",
                    t.start,
                    t.stop,
                )
            raise self.fail(
                "a group needs at least one mesh axis before its extent, e.g. (tp r)",
                open_.start,
                max(t.stop, open_.stop),
            )
        label, size, parts = None, None, None
        if self.tok.kind == "[":
            parts = self.parts()
        elif self.tok.kind == "name":
            t = self.take()
            self._check_label(t)
            label, size = t.text, self.size_suffix()
        else:
            got = "the end of the pattern" if self.tok.kind == "end" else repr(self.tok.text)
            raise self.fail(
                f"expected the dimension's extent (a name or [parts]) after the axes, found {got}",
                self.tok.start,
                max(self.tok.stop, self.tok.start + 1),
            )
        opts: dict[str, tuple[object, tuple[int, int]]] = {}
        if self.tok.kind == "|":
            self.take()
            opts = self.options("split")
        if self.tok.kind == "name" and self.tok.text in MESH_AXES:
            t = self.tok
            raise self.fail(
                "the split axes must come before the extent, e.g. (tp r); interleaved (strided) "
                "splits are not supported",
                t.start,
                t.stop,
            )
        close = self.expect(")", "')' closing the group")
        dim = Dim(label, tuple(axes), size, parts, span=(open_.start, close.stop))
        return self._apply_split_options(dim, opts)

    def parts(self) -> tuple[Part, ...]:
        open_ = self.take()
        parts: list[Part] = []
        while self.tok.kind == "name":
            t = self.take()
            self._check_label(t)
            size = self.size_suffix()
            if any(p.name == t.text for p in parts):
                raise self.fail(f"part {t.text!r} appears twice", t.start, t.stop)
            parts.append(Part(t.text, size, (t.start, self.toks[self.i - 1].stop)))
        close = self.expect("]", "a part name or ']'")
        if not parts:
            raise self.fail("fused parts need at least one part", open_.start, close.stop)
        unsized = [p for p in parts if p.size is None]
        if unsized and len(unsized) != len(parts) and len(unsized) > 1:
            raise self.fail(
                "give every part a size, none (equal parts) or all but one (it takes the rest)", open_.start, close.stop
            )
        return tuple(parts)

    def size_suffix(self) -> int | None:
        if self.tok.kind != ":":
            return None
        self.take()
        return self.product()

    def product(self) -> int:
        first = self.expect("int", "a number")
        value = int(first.text)
        while self.tok.kind == "*":
            self.take()
            value *= int(self.expect("int", "a number after '*'").text)
        return value

    def options(self, what: str) -> dict[str, tuple[object, tuple[int, int]]]:
        out: dict[str, tuple[object, tuple[int, int]]] = {}
        while True:
            t = self.expect("name", f"a {what} option name")
            value: object = None
            if self.tok.kind == "=":
                self.take()
                if self.tok.kind == "int":
                    value = self.product()
                else:
                    names = [self.expect("name", "an option value").text]
                    while self.tok.kind == "+":
                        self.take()
                        names.append(self.expect("name", "a name after '+'").text)
                    value = tuple(names)
            span = (t.start, self.toks[self.i - 1].stop)
            if t.text in out:
                raise self.fail(f"option {t.text!r} given twice", *span)
            out[t.text] = (value, span)
            if self.tok.kind != ",":
                return out
            self.take()

    # -- semantic checks ----------------------------------------------------------------------
    def _check_label(self, t: _Tok) -> None:
        if t.text in MESH_AXES:
            raise self.fail(
                f"{t.text!r} is a mesh axis; to split a dimension over it write ({t.text} name)", t.start, t.stop
            )

    def _axes_value(self, value: object, span: tuple[int, int], default: tuple[str, ...]) -> tuple[str, ...]:
        if value is None:
            return default
        if not isinstance(value, tuple):
            raise self.fail("expected mesh axes, e.g. avg=tp or avg=tp+ep", *span)
        for a in value:
            if a not in AXES:
                raise self.fail(f"unknown mesh axis {a!r} (axes: {', '.join(AXES)})", *span)
        return value

    def _apply_split_options(self, dim: Dim, opts: dict[str, tuple[object, tuple[int, int]]]) -> Dim:
        unit, pad, uneven = 1, None, None
        for name, (value, span) in opts.items():
            if name in ("unit", "pad"):
                if not isinstance(value, int) or value < 1:
                    raise self.fail(f"{name} needs a positive number, e.g. {name}=128", *span)
                if name == "unit":
                    unit = value
                else:
                    pad = value
            elif name == "uneven":
                rule = "first" if value is None else value[0] if isinstance(value, tuple) and len(value) == 1 else None
                if rule not in UNEVEN_RULES:
                    raise self.fail(f"uneven takes one of {', '.join(UNEVEN_RULES)} (default first)", *span)
                uneven = rule
            else:
                raise self.fail(f"unknown split option {name!r} (known: unit, pad, uneven)", *span)
        if pad is not None and (dim.parts is not None or unit != 1 or uneven is not None):
            raise self.fail("pad does not combine with fused parts, unit or uneven", *dim.span)
        if uneven is not None and dim.parts is not None:
            raise self.fail("uneven does not combine with fused parts", *dim.span)
        if dim.parts is not None and unit > 1:
            for p in dim.parts:
                if p.size is not None and p.size % unit:
                    raise self.fail(f"part {p.name!r} size {p.size} is not a multiple of unit={unit}", *p.span)
        return Dim(dim.label, dim.axes, dim.size, dim.parts, unit, pad, uneven, dim.span)

    def _check_axes(self, pat: Pattern) -> None:
        seen: dict[str, Dim] = {}
        for d in pat.dims:
            for a in d.axes:
                if a in seen:
                    raise self.fail(f"axis {a!r} splits two dimensions (a rank would hold a diagonal block)", *d.span)
                seen[a] = d
        for a in pat.average:
            if a in seen:
                raise self.fail(
                    f"avg={a}: {a} splits this tensor, so there are no copies over it to average", *seen[a].span
                )


@lru_cache(maxsize=4096)
def parse_pattern(text: str) -> Pattern:
    """Parse a dim pattern; raises PatternError with a caret under the fault."""
    if not isinstance(text, str):
        raise PatternError(f"a dim pattern must be a string, got {type(text).__name__}")
    return _Parser(text).pattern()


def part_sizes(dim: Dim, total: int) -> list[int] | None:
    """The global sizes of a fused dim's parts for a dimension of ``total``, or None when they cannot add up."""
    assert dim.parts is not None
    sizes = [p.size for p in dim.parts]
    known = sum(s for s in sizes if s is not None)
    missing = [i for i, s in enumerate(sizes) if s is None]
    if not missing:
        return sizes if known == total else None  # type: ignore[return-value]
    if len(missing) == len(sizes):
        n = len(sizes)
        return [total // n] * n if total % n == 0 else None
    rest = total - known
    if rest < 0:
        return None
    sizes[missing[0]] = rest
    return sizes  # type: ignore[return-value]
