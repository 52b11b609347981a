"""tp > 1 checkpoint targets (several regions of one tensor per rank, as ucp.Shards) save and load with ucp.

Ranks are simulated in one process: each rank's buffers come from the resolved layout, the save
runs on threads (tests/support/ucp_helpers.save_ranks) through the real multi-rank save code.
"""

from __future__ import annotations

import torch
from training_helpers import GQA
from ucp_helpers import save_ranks  # noqa: E402

import ucp
from reshard import Mesh, Resolver
from training.checkpoint import assemble, build_targets, fill_from_full
from training.layout import gpt_layout, gpt_shapes
from training.models.gpt import GPTConfig


def rank_targets(mesh: Mesh, zero_stage: int):
    """Per rank: targets with sections ``model`` (TP-local weights) and ``exp_avg`` (ZeRO flat partitions)."""
    cfg = GPTConfig(**GQA)
    shapes = gpt_shapes(cfg)
    res = Resolver(gpt_layout(cfg, mesh, zero_stage=zero_stage, zero_alignment=4, pad_vocab_to=8), shapes)
    out = []
    for coord in mesh.coords():
        view = res.view(coord)
        bufs = [("model", b, torch.zeros(b.shape)) for b in view.tensors.values()]
        bufs += [("exp_avg", g, torch.zeros(g.shape)) for g in view.zero_groups]
        out.append((view.rank, build_targets(bufs, shapes)))
    return shapes, [t for _, t in sorted(out, key=lambda x: x[0])]


def test_tp2_targets_save_and_load(tmp_path) -> None:
    shapes, targets = rank_targets(Mesh(tp=2, dp=2), zero_stage=1)
    gen = torch.Generator().manual_seed(5)
    full = {(s, n): torch.randn(shape, generator=gen) for n, shape in shapes.items() for s in ("model", "exp_avg")}
    for t in targets:
        fill_from_full(t, lambda s, n: full[(s, n)])
    qkv = "layers.0.attn.qkv.weight"
    assert isinstance(targets[0].nested()["model"][qkv], ucp.Shards)  # q, k and v rows of rank tp 0
    assert any(isinstance(v, ucp.Shards) for t in targets for v in t.nested()["exp_avg"].values())

    save_ranks(tmp_path / "ck", [t.nested() for t in targets])
    assert ucp.verify(tmp_path / "ck").ok
    back = ucp.load(tmp_path / "ck")
    for (s, n), want in full.items():
        if n in back[s]:
            assert torch.equal(back[s][n], want), (s, n)
    assert set(back["model"]) == set(shapes)

    # into a tp=2, dp=1 layout (other pieces, same kinds of multi-region leaves)
    _, fresh = rank_targets(Mesh(tp=2), zero_stage=1)
    for t in fresh:
        nested = t.nested()
        ucp.load(tmp_path / "ck", into={"model": nested["model"]})
        for n, pieces in t.sections["model"].items():
            got, count = assemble(pieces, shapes[n], replicas=True)
            assert torch.equal(got[count > 0], full[("model", n)][count > 0]), n
