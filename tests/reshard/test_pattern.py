"""The dim-pattern parser: what it accepts, the AST, and errors with a caret at the fault."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard import PatternError, parse_pattern
from reshard.pattern import Dim


def test_plain_and_split_dims() -> None:
    p = parse_pattern("(tp r) c")
    assert [d.axes for d in p.dims] == [("tp",), ()]
    assert [d.label for d in p.dims] == ["r", "c"]
    assert parse_pattern("r (tp c)").axes == ("tp",)
    assert parse_pattern("r c").axes == ()
    assert parse_pattern("").dims == ()


def test_fused_parts_with_products_and_unit() -> None:
    p = parse_pattern("(tp [q:32*128 k:8*128 v:8*128] | unit=128) h")
    d = p.dims[0]
    assert d.parts is not None
    assert [(x.name, x.size) for x in d.parts] == [("q", 4096), ("k", 1024), ("v", 1024)]
    assert d.unit == 128 and d.label is None


def test_options() -> None:
    assert parse_pattern("(tp v | pad=128) h").dims[0].pad == 128
    assert parse_pattern("(tp r | uneven) c").dims[0].uneven == "first"
    assert parse_pattern("(tp r | uneven=ceil) c").dims[0].uneven == "ceil"
    assert parse_pattern("h | avg").average == ("tp",)
    assert parse_pattern("h | avg=tp+ep").average == ("tp", "ep")
    assert parse_pattern("v:50257 (tp h)").dims[0].size == 50257


def test_ellipsis_and_multi_axis_groups() -> None:
    p = parse_pattern("(ep tp e) ...")
    assert p.dims[0].axes == ("ep", "tp") and p.ellipsis == 1
    assert [d.label for d in p.expand(3)] == ["e", None, None]
    assert p.fits_rank(1) and not p.fits_rank(0)
    q = parse_pattern("... | avg")
    assert q.fits_rank(0) and q.expand(2) == (Dim(None), Dim(None))


def caret_at(exc: PatternError) -> str:
    """The characters of the pattern the caret points at."""
    text_line, caret_line = str(exc).splitlines()[-2:]
    start = caret_line.index("^")
    return text_line[start : start + caret_line.count("^")]


@pytest.mark.parametrize(
    "text, fragment, marked",
    [
        ("(tq r) c", "'tq' is not a mesh axis", "tq"),
        ("(r tp) c", "axes must come before the extent", "tp"),
        ("(tp r ep) c", "axes must come before the extent", "ep"),
        ("(pp r) c", "pp cannot split a dimension", "pp"),
        ("(tp r) (tp c)", "axis 'tp' splits two dimensions", "(tp c)"),
        ("(tp tp r) c", "an axis appears twice", "(tp tp "),
        ("tp c", "is a mesh axis", "tp"),
        ("(tp r | pad=0) c", "pad needs a positive number", "pad=0"),
        ("(tp r | foo=3) c", "unknown split option 'foo'", "foo=3"),
        ("h | mean", "unknown tensor option 'mean'", "mean"),
        ("(tp r) c | avg", "avg=tp: tp splits this tensor", "(tp r)"),
        ("(tp [q k:8 v]) h", "give every part a size", "[q k:8 v]"),
        ("(tp [q q]) h", "part 'q' appears twice", "q"),
        ("(tp [q:6 k:4] | unit=4) h", "part 'q' size 6 is not a multiple of unit=4", "q:6"),
        ("(tp [q k] | pad=8) h", "pad does not combine", "(tp [q k] | pad=8)"),
        ("[q k v] h", "fused parts go inside a split group", "["),
        ("... r ...", "only one '...'", "..."),
        ("(tp r c", "expected ')'", "c"),
        ("(tp) c", "expected the dimension's extent", ")"),
        ("r $ c", "unexpected character '$'", "$"),
        ("(tp r | uneven=last) c", "uneven takes one of", "uneven=last"),
    ],
)
def test_errors_point_at_the_fault(text: str, fragment: str, marked: str) -> None:
    with pytest.raises(PatternError) as info:
        parse_pattern(text)
    assert fragment in str(info.value)
    assert text in str(info.value)
    assert caret_at(info.value) == marked


def test_error_context_names_the_rule() -> None:
    from reshard import Rule

    with pytest.raises(ValueError, match=r"rule 'layers.\{i\}.qkv': 'tq' is not a mesh axis"):
        Rule(name="layers.{i}.qkv", dims="(tq r) c")


ALPHABET = "()[]|,=:*+. tpdepqkvrc0123456789_xunitpadavgceilfirst"


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet=ALPHABET, max_size=40))
def test_any_text_parses_or_raises_pattern_error(text: str) -> None:
    try:
        parse_pattern(text)
    except PatternError as exc:
        assert str(exc)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.sampled_from(
            [
                "(",
                ")",
                "[",
                "]",
                "|",
                "tp",
                "ep",
                "dp",
                "pp",
                "r",
                "q:4",
                "k",
                "...",
                ",",
                "pad=4",
                "unit=2",
                "uneven",
                "avg",
                "=",
                ":",
                "*",
                "3",
            ]
        ),
        max_size=12,
    )
)
def test_token_soup_parses_or_raises_pattern_error(tokens: list[str]) -> None:
    try:
        parse_pattern(" ".join(tokens))
    except PatternError as exc:
        assert str(exc)
