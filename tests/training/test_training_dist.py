"""Multi-process training on gloo: every parallel layout matches the single-process run.

Two worlds are launched once per module (2 and 4 processes); each runs several scenarios, and every
scenario is checked against the same run in this process (plain GPT, the global batch,
torch.optim.AdamW): per-step losses, and the final weights, fp32 masters and Adam moments
reassembled from the checkpoint pieces of all ranks (which must tile every tensor exactly once).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from training_helpers import (
    DEEP,
    GQA,
    PLAIN,
    Gathered,
    Reference,
    gather,
    module_reference,
    reference_run,
    rel_close,
    run_world,
    scenario,
    small_module,
)

from training.layout import gpt_shapes
from training.models.gpt import GPTConfig

TWO = [
    scenario("zero1_dp2", PLAIN, {"dp": 2}, zero_stage=1),
    scenario("zero2_dp2_accum_clip", PLAIN, {"dp": 2}, zero_stage=2, grad_accum=2, clip=0.5),
    scenario("zero3_dp2", PLAIN, {"dp": 2}, zero_stage=3, zero_alignment=4),
    scenario("tp2", PLAIN, {"tp": 2}, zero_stage=1),
    scenario("tp2_gqa_swiglu_tied", GQA, {"tp": 2}, zero_stage=0, optimizer="adam"),
    scenario("pp2_gqa_tied_1f1b", GQA, {"pp": 2}, zero_stage=1, grad_accum=3),
    scenario("pp2_plain_gpipe", PLAIN, {"pp": 2}, zero_stage=0, grad_accum=3, clip=0.5, pipeline_schedule="gpipe"),
    {
        **scenario("resume_dp2z3_to_tp2", PLAIN, {"dp": 2}, zero_stage=3, micro_batch=2),
        "kind": "resume",
        "split": 3,
        "then": {
            "mesh": {"tp": 2},
            "options": scenario("", PLAIN, {}, zero_stage=1, micro_batch=2, grad_accum=2)["options"],
        },
    },
    {**scenario("module_zero2", {}, {"dp": 2}, zero_stage=2, zero_alignment=4, micro_batch=3), "kind": "module"},
    {**scenario("module_zero3", {}, {"dp": 2}, zero_stage=3, zero_alignment=1, micro_batch=3), "kind": "module"},
]
BF16 = scenario("bf16_zero2_dp2", PLAIN, {"dp": 2}, steps=20, zero_stage=2, dtype="bf16", lr=5e-3, micro_batch=4)
FOUR = [
    scenario("zero2_dp4", PLAIN, {"dp": 4}, zero_stage=2, zero_alignment=8),
    scenario("tp2_dp2_zero2_gqa", GQA, {"tp": 2, "dp": 2}, zero_stage=2, clip=0.5),
    scenario("tp2_dp2_zero3_plain", PLAIN, {"tp": 2, "dp": 2}, zero_stage=3, zero_alignment=2),
    scenario("tp2_pp2_zero1", PLAIN, {"tp": 2, "pp": 2}, zero_stage=1, grad_accum=2),
    scenario("pp4_1f1b", DEEP, {"pp": 4}, zero_stage=1, grad_accum=6, micro_batch=1),
    scenario(
        "pp2_dp2_order_tp_pp_dp", GQA, {"pp": 2, "dp": 2, "order": ["tp", "pp", "dp"]}, zero_stage=1, grad_accum=2
    ),
    {
        **scenario("resume_tp2dp2_to_pp2dp2", GQA, {"tp": 2, "dp": 2}, zero_stage=2, micro_batch=2),
        "kind": "resume",
        "split": 2,
        "then": {
            "mesh": {"pp": 2, "dp": 2},
            "options": scenario("", GQA, {}, zero_stage=1, micro_batch=1, grad_accum=2)["options"],
        },
    },
]


@pytest.fixture(scope="module")
def world2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("world2")
    run_world(2, TWO + [BF16], out)
    return out


@pytest.fixture(scope="module")
def world4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("world4")
    run_world(4, FOUR, out)
    return out


def check_against_reference(g: Gathered, ref: Reference, sections: tuple[str, ...], atol: float = 2e-4) -> None:
    assert not g.cover_problems, g.cover_problems
    assert g.replicas_agree, "a replica's values differ from the replica-0 copy"
    assert rel_close(g.losses, ref.losses, 1e-5), (g.losses, ref.losses)
    wanted = {"model": ref.params, "fp32_master": ref.params, "exp_avg": ref.exp_avg, "exp_avg_sq": ref.exp_avg_sq}
    for section in sections:
        expect = wanted[section]
        assert {n for s, n in g.full if s == section} == set(expect), section
        for name, want in expect.items():
            got = g.full[(section, name)]
            tol = atol if section in ("model", "fp32_master") else atol * 1e-2
            assert torch.allclose(got, want, rtol=0, atol=tol), (
                f"{section} {name}: max diff {(got - want).abs().max().item():.3g}"
            )


SECTIONS = ("model", "fp32_master", "exp_avg", "exp_avg_sq")


@pytest.mark.parametrize("sc", TWO, ids=[s["name"] for s in TWO])
def test_two_ranks_match_single_process(world2: Path, sc: dict) -> None:
    if sc.get("kind") == "module":
        ref = module_reference(sc, 2)
        shapes = {n: tuple(p.shape) for n, p in small_module().named_parameters()}
    else:
        ref = reference_run(sc)
        shapes = gpt_shapes(GPTConfig(**sc["model"]))
    check_against_reference(gather(world2, sc["name"], 2, shapes), ref, SECTIONS)


@pytest.mark.parametrize("sc", FOUR, ids=[s["name"] for s in FOUR])
def test_four_ranks_match_single_process(world4: Path, sc: dict) -> None:
    ref = reference_run(sc)
    check_against_reference(gather(world4, sc["name"], 4, gpt_shapes(GPTConfig(**sc["model"]))), ref, SECTIONS)


def test_zero3_releases_gathered_parameters(world2: Path) -> None:
    g = gather(world2, "zero3_dp2", 2, gpt_shapes(GPTConfig(**PLAIN)))
    for rank in g.ranks:
        facts = rank["stage3"]
        assert facts["held_after_step"] == 0  # every parameter is back to its partition
        assert facts["packed"] > 0  # autograd kept references, not gathered weights, between forward and backward
        assert facts["gathers"] > facts["prefetched"] > 0  # later passes fetch the next module ahead of use


def test_bf16_trains_with_fp32_masters(world2: Path) -> None:
    g = gather(world2, BF16["name"], 2, gpt_shapes(GPTConfig(**PLAIN)))
    assert not g.cover_problems
    losses = g.losses
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.05, losses
    ref = reference_run(BF16)
    assert all(abs(a - b) < 0.05 * b for a, b in zip(losses, ref.losses))  # bf16 tracks the fp32 run loosely
    for rank in g.ranks:
        assert rank["master_dtypes"] == ["torch.float32"]
        assert rank["weight_dtypes"] == ["torch.bfloat16"]
    for (section, _), t in g.full.items():
        assert torch.isfinite(t).all(), section
    pieces = [p for r in g.ranks for p in r["pieces"]]
    assert {p["dtype"] for p in pieces if p["section"] == "model"} == {"torch.bfloat16"}
    assert {p["dtype"] for p in pieces if p["section"] != "model"} == {"torch.float32"}
