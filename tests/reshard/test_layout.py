"""The layout file: JSON round trip, rank numbering, rule matching, pipeline assignment, checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reshard import (
    Layout,
    LayoutError,
    Mesh,
    ModelDims,
    PatternError,
    Pipeline,
    RankCoord,
    Rule,
    Zero,
    gpt_layout,
    gpt_shapes,
    llama_layout,
    llama_shapes,
)
from reshard.pipeline import assign_stages, contiguous_stages

TINY = ModelDims(hidden=16, layers=4, heads=8, kv_heads=4, head_dim=2, ffn=32, vocab=37, max_positions=8)


def test_json_round_trip(tmp_path: Path) -> None:
    layout = gpt_layout(TINY, Mesh(tp=2, pp=2, dp=4), zero_stage=1, zero_alignment=2, pad_vocab_to=4)
    path = tmp_path / "layout.json"
    layout.dump(path)
    again = Layout.load(path)
    assert again == layout
    doc = json.loads(path.read_text())
    assert doc["rules"][0] == {
        "name": "embedding.word_embeddings.weight",
        "dims": "(tp v | pad=4) h",
        "optional": False,
    }


def test_bad_file_names_the_source_and_field(tmp_path: Path) -> None:
    doc = {"mesh": {"tp": 2}, "rules": [{"name": "a", "dims": "(tp r c"}]}
    with pytest.raises(LayoutError) as info:
        Layout.from_json(json.dumps(doc), source="my.json")
    msg = str(info.value)
    assert msg.startswith("my.json: rules.0: rule 'a': expected ')'") and "(tp r c" in msg
    with pytest.raises(LayoutError, match=r"my.json: mesh: .*ep=3 must divide dp=4"):
        Layout.from_json(json.dumps({"mesh": {"dp": 4, "ep": 3}}), source="my.json")
    with pytest.raises(LayoutError, match=r"my.json: mesh.tpp: Extra inputs"):
        Layout.from_json(json.dumps({"mesh": {"tpp": 4}}), source="my.json")
    with pytest.raises(LayoutError, match=r"zero.stage"):
        Layout.from_json(json.dumps({"zero": {"stage": 4}}))


def test_rank_numbering() -> None:
    mesh = Mesh(tp=2, pp=3, dp=4)
    coords = list(mesh.coords())
    assert len(coords) == 24 and len(set(coords)) == 24
    assert coords[:3] == [RankCoord(0, 0, 0), RankCoord(1, 0, 0), RankCoord(0, 0, 1)]  # tp fastest, then dp, then pp
    assert all(mesh.rank(c) == r for r, c in enumerate(coords))
    other = Mesh(tp=2, pp=3, dp=4, order=("dp", "tp", "pp"))
    assert other.coord(1) == RankCoord(tp=0, pp=0, dp=1)
    with pytest.raises(LayoutError, match="rank 24 is outside world size 24"):
        mesh.coord(24)
    with pytest.raises(LayoutError, match="tp=2 is outside 0..1"):
        mesh.rank(RankCoord(2, 0, 0))


def two_rules(*rules: tuple[str, str], default: str | None = None) -> Layout:
    return Layout(rules=tuple(Rule(name=n, dims=d) for n, d in rules), default=default)


def test_rule_matching_is_unambiguous() -> None:
    shapes = {"a.weight": (4, 4), "a.bias": (4,)}
    with pytest.raises(LayoutError, match=r"tensor 'a.weight' matches two rules: 0 'a.\*' .* and 1 '\*.weight'"):
        two_rules(("a.*", "..."), ("*.weight", "(tp r) c")).resolve(shapes, 0)
    with pytest.raises(LayoutError, match=r"tensor 'a.bias' matches no rule and the layout has no default"):
        two_rules(("*.weight", "(tp r) c")).resolve(shapes, 0)
    view = two_rules(("*.weight", "(tp r) c"), default="...").resolve(shapes, 0)
    assert set(view.tensors) == set(shapes)
    with pytest.raises(LayoutError, match=r"rule 1 'b.\*' \(r\) matches no tensor"):
        two_rules(("a.*", "..."), ("b.*", "r")).resolve(shapes, 0)
    ok = Layout(rules=(Rule(name="a.*", dims="..."), Rule(name="b.*", dims="r", optional=True)))
    ok.resolve(shapes, 0)


def test_layer_placeholder_matches_integers_only() -> None:
    layout = two_rules(("layers.{i}.w", "r"), default="r c")
    view = layout.resolve({"layers.12.w": (3,), "layers.x.w": (3, 3)}, 0)
    assert view.tensors["layers.x.w"].shape == (3, 3)
    with pytest.raises(ValueError, match=r"the only placeholder is \{i\}"):
        Rule(name="layers.{j}.w", dims="r")


def test_tensor_errors_name_the_tensor_and_rule() -> None:
    layout = two_rules(("w", "(tp r) c"))
    layout = layout.replace(mesh=Mesh(tp=3))
    with pytest.raises(PatternError) as info:
        layout.resolve({"w": (4, 2)}, 0)
    assert str(info.value).startswith("tensor 'w' [4, 2] (rule 0 'w'): dim 0 has size 4, not divisible by tp=3")


def test_contiguous_stages_and_errors() -> None:
    assert contiguous_stages(5, 2) == [[0, 1, 2], [3, 4]]
    names = [f"layers.{i}.w" for i in range(3)] + ["emb", "head"]
    pipe = Pipeline(first=("emb",), last=("head",))
    assert assign_stages(pipe, names, 2) == {
        "layers.0.w": (0,),
        "layers.1.w": (0,),
        "layers.2.w": (1,),
        "emb": (0,),
        "head": (1,),
    }
    with pytest.raises(LayoutError, match=r"pp=4 is larger than the number of layers \(3\)"):
        assign_stages(pipe, names, 4)
    explicit = Pipeline(first=("emb",), last=("head",), stages=((0, 2), (1,)))
    assert assign_stages(explicit, names, 2)["layers.2.w"] == (0,)
    with pytest.raises(LayoutError, match=r"layers \[1\] are on no stage"):
        assign_stages(Pipeline(first=("emb",), last=("head",), stages=((0, 2), ())), names, 2)
    with pytest.raises(LayoutError, match="layer 2 is on stage 0 and stage 1"):
        assign_stages(Pipeline(first=("emb",), last=("head",), stages=((0, 2), (1, 2))), names, 2)
    with pytest.raises(LayoutError, match="stage 1 lists layer 7, which the model lacks"):
        assign_stages(Pipeline(first=("emb",), last=("head",), stages=((0, 2), (1, 7))), names, 2)
    with pytest.raises(LayoutError, match="lists 2 stages but pp=3"):
        assign_stages(explicit, names, 3)
    with pytest.raises(LayoutError, match=r"tensor 'head' is in no layer .* say which stage holds it"):
        assign_stages(Pipeline(first=("emb",)), names, 2)
    assert assign_stages(Pipeline(), names, 1)["head"] == (0,)  # pp = 1: no need to say
    with pytest.raises(LayoutError, match="matches both pipeline.first and pipeline.tied"):
        assign_stages(Pipeline(first=("emb",), tied=("e*",), last=("head",)), names, 2)


def test_tied_embedding_is_held_by_both_ends_and_saved_once() -> None:
    shapes = gpt_shapes(TINY)
    layout = gpt_layout(TINY, Mesh(pp=2), pad_vocab_to=1)
    first, last = layout.resolve(shapes, RankCoord(pp=0)), layout.resolve(shapes, RankCoord(pp=1))
    name = "embedding.word_embeddings.weight"
    assert first.tensors[name].slots[0].replica == 0 and last.tensors[name].slots[0].replica == 1
    assert "final_layernorm.weight" in last.tensors and "final_layernorm.weight" not in first.tensors
    assert "layers.1.mlp.dense_h_to_4h.weight" in first.tensors and "layers.2.mlp.dense_h_to_4h.weight" in last.tensors


def test_averaged_tensors_are_reported() -> None:
    layout = gpt_layout(TINY, Mesh(tp=2), pad_vocab_to=4, sequence_parallel=True)
    view = layout.resolve(gpt_shapes(TINY), RankCoord(tp=1))
    assert view.average["layers.0.input_layernorm.weight"] == ("tp",)
    assert "layers.0.mlp.dense_4h_to_h.bias" not in view.average
    assert view.tensors["layers.0.input_layernorm.weight"].slots[0].replica == 1  # tp rank 0 writes the mean


@pytest.mark.parametrize("tp, pp, dp, stage", [(2, 2, 2, 0), (4, 1, 2, 1), (2, 2, 4, 3), (1, 1, 1, 2)])
def test_presets_pass_check(tp: int, pp: int, dp: int, stage: int) -> None:
    gpt_layout(TINY, Mesh(tp=tp, pp=pp, dp=dp), zero_stage=stage, zero_alignment=2, pad_vocab_to=4).check(
        gpt_shapes(TINY)
    )
    gpt_layout(TINY, Mesh(tp=tp, pp=pp, dp=dp), zero_stage=stage, pad_vocab_to=4, qkv_interleaved=True).check(
        gpt_shapes(TINY)
    )
    for fused in (False, True):
        dims = ModelDims(hidden=16, layers=2, heads=4, kv_heads=2, head_dim=4, ffn=24, vocab=32, experts=4)
        mesh = Mesh(tp=min(tp, 2), pp=pp, dp=dp * 2, ep=2)
        llama_layout(dims, mesh, zero_stage=stage, fused_qkv=fused, fused_gate_up=fused).check(
            llama_shapes(dims, fused_qkv=fused, fused_gate_up=fused)
        )


def test_target_that_cannot_hold_the_model() -> None:
    dims = ModelDims(hidden=16, layers=2, heads=4, kv_heads=2, head_dim=4, vocab=32, experts=3)
    shapes = llama_shapes(dims, fused_qkv=True)
    with pytest.raises(PatternError, match=r"part 'k' has 2 units of 4, not divisible by tp=4"):
        llama_layout(dims, Mesh(tp=4), fused_qkv=True).resolve(shapes, 0)
    with pytest.raises(PatternError, match=r"k_proj.weight.*dim 0 has 2 units of 4, not divisible by tp=4"):
        llama_layout(dims, Mesh(tp=4)).resolve(llama_shapes(dims), 0)
    with pytest.raises(PatternError, match=r"experts.gate_up_proj.*dim 0 has size 3, not divisible by ep=2"):
        llama_layout(dims, Mesh(dp=2, ep=2), fused_qkv=True).resolve(shapes, 0)


def test_zero_group_mixing_experts_is_refused() -> None:
    dims = ModelDims(hidden=8, layers=1, heads=2, vocab=16, experts=2)
    layout = llama_layout(dims, Mesh(dp=2, ep=2), zero_stage=1).replace(zero=Zero(stage=1))
    with pytest.raises(LayoutError, match=r"ZeRO group 0 mixes tensors split over ep .* and not"):
        layout.resolve(llama_shapes(dims), 0)


def test_check_reports_bad_stages() -> None:
    layout = Layout(mesh=Mesh(pp=2), rules=(Rule(name="*", dims="..."),), pipeline=Pipeline(stages=((0,), (1,))))
    with pytest.raises(LayoutError, match="stage 0 lists layer 0, which the model lacks"):
        layout.check({"emb": (2,)})


def test_check_catches_double_saves(monkeypatch: pytest.MonkeyPatch) -> None:
    """check() is the safety net under the resolver: break the replica rule and it must notice."""
    from reshard.resolve import Resolver

    layout = gpt_layout(TINY, Mesh(tp=2), pad_vocab_to=4)
    layout.check(gpt_shapes(TINY))
    monkeypatch.setattr(Resolver, "_replica", lambda self, n, coord, over_dp: 0)
    with pytest.raises(
        LayoutError,
        match=r"tensor 'embedding.position_embeddings.weight' .* weights saved by all "
        r"ranks do not tile it exactly once: pieces 0 and 1 overlap",
    ):
        layout.check(gpt_shapes(TINY))


def test_the_example_in_the_docs_loads_and_fits_gpt2() -> None:
    text = (Path(__file__).resolve().parents[2] / "docs" / "patterns.md").read_text()
    doc = text.split("```json\n", 1)[1].split("```", 1)[0]
    layout = Layout.from_json(doc, source="docs/patterns.md")
    gpt2 = ModelDims(hidden=768, layers=2, heads=12, vocab=50257, max_positions=16)
    view = layout.resolve(gpt_shapes(gpt2), RankCoord(tp=1, pp=1, dp=3))
    assert view.tensors["embedding.word_embeddings.weight"].shape == (50432 // 2, 768)  # ⌈50257 / (128·2)⌉·256 = 50432
    assert view.average["layers.1.input_layernorm.weight"] == ("tp",)
    assert "final_layernorm.bias" in view.tensors and "layers.0.mlp.dense_h_to_4h.bias" not in view.tensors
