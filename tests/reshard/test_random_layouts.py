"""Property tests: random tensors, random dim patterns, random meshes and ZeRO stages.

For any layout the ranks' saved regions tile every tensor exactly once (``Layout.check``), and a
checkpoint saved under one random layout loads exactly into another and back.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_plan import round_trip

from reshard import Layout, Mesh, Rule, Zero

SPLITS = ["even", "uneven", "ceil", "pad", "fused", "unit"]


@st.composite
def tensor(draw: st.DrawFn, name: str, expert: bool) -> tuple[str, tuple[int, ...], str]:
    """A tensor shape and a pattern for it. Sizes that must split evenly are multiples of 4 (tp, ep ≤ 4)."""
    ndim = draw(st.integers(1 if expert else 0, 3))
    dims = [f"d{i}" for i in range(ndim)]
    shape = [draw(st.integers(1, 4)) for _ in range(ndim)]
    if expert:
        shape[0] = 4 * draw(st.integers(1, 2))
        dims[0] = "(ep d0)"
    free = [i for i in range(ndim) if not (expert and i == 0)]
    avg = False
    if bool(free) and draw(st.booleans()):  # bool(): mypy types the draw by the left operand otherwise
        i = draw(st.sampled_from(free))
        kind = draw(st.sampled_from(SPLITS))
        if kind == "even":
            shape[i] = 4 * draw(st.integers(1, 3))
            dims[i] = f"(tp d{i})"
        elif kind == "uneven":
            shape[i] = draw(st.integers(1, 9))
            dims[i] = f"(tp d{i} | uneven)"
        elif kind == "ceil":
            shape[i] = draw(st.integers(1, 9))
            dims[i] = f"(tp d{i} | uneven=ceil)"
        elif kind == "pad":
            shape[i] = draw(st.integers(1, 9))
            dims[i] = f"(tp d{i} | pad={draw(st.integers(1, 3))})"
        elif kind == "fused":
            parts = [4 * draw(st.integers(1, 2)) for _ in range(draw(st.integers(1, 3)))]
            shape[i] = sum(parts)
            dims[i] = "(tp [" + " ".join(f"p{j}:{n}" for j, n in enumerate(parts)) + "])"
        else:
            unit = draw(st.integers(1, 3))
            shape[i] = 4 * unit * draw(st.integers(1, 2))
            dims[i] = f"(tp d{i} | unit={unit})"
    else:
        avg = draw(st.booleans())
    pattern = " ".join(dims) + (" | avg" if avg else "")
    return name, tuple(shape), pattern


@st.composite
def mesh_and_zero(draw: st.DrawFn, need_ep: bool) -> tuple[Mesh, Zero]:
    dp = draw(st.sampled_from([1, 2, 4]))
    ep = draw(st.sampled_from([e for e in (1, 2, 4) if dp % e == 0]))
    mesh = Mesh(tp=draw(st.sampled_from([1, 2, 4])), dp=dp, ep=ep)
    zero = Zero(
        stage=draw(st.integers(0, 3)),
        alignment=draw(st.integers(1, 3)),
        groups=(("x*",), ("t*",)) if need_ep else (("t*",),),
    )
    return mesh, zero


@st.composite
def layouts(draw: st.DrawFn) -> tuple[Layout, Layout, dict[str, tuple[int, ...]]]:
    n_dense = draw(st.integers(1, 3))
    n_expert = draw(st.integers(0, 2))
    specs = [draw(tensor(f"t{i}", False)) for i in range(n_dense)]
    specs += [draw(tensor(f"x{i}", True)) for i in range(n_expert)]
    rules = tuple(Rule(name=n, dims=p) for n, _, p in specs)
    shapes = {n: s for n, s, _ in specs}
    made = []
    for _ in range(2):
        mesh, zero = draw(mesh_and_zero(n_expert > 0))
        made.append(Layout(mesh=mesh, zero=zero, rules=rules))
    return made[0], made[1], shapes


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts())
def test_random_layouts_tile_and_round_trip(case: tuple[Layout, Layout, dict]) -> None:
    src, dst, shapes = case
    src.check(shapes)
    dst.check(shapes)
    round_trip(src, dst, shapes)
