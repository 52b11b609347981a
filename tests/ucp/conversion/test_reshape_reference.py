"""Edge cases of ``ucp reshape`` and the layout presets, checked against a torch reference.

Sources are consolidated checkpoints built here from known global tensors (every element distinct)
with the layout recorded in their metadata, as the training engine records it. Each target rank's
file is checked piece by piece against the slice that plain torch indexing takes from the global
tensor, besides round trips (A -> B -> A gives the same files, byte for byte) and ``ucp.load``.
Also: what the memory budget bounds (data buffers counted as they are allocated and freed),
consolidating sources with free-form or pipeline-staged metadata, tensors at the root of the
state tree, and progress reporting.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner
from ucp_helpers import TrackedFileBuffers, flat

import ucp
import ucp.conversion.reshape
import ucp.loading.partial
import ucp.store.reader
from reshard import Box, FlatRange, Layout, LayoutError, Mesh, Pipeline, Rule
from reshard.presets import ModelDims, gpt_layout, gpt_shapes, llama_layout, llama_shapes
from training.layout import gpt_layout as engine_gpt_layout
from training.layout import gpt_shapes as engine_gpt_shapes
from training.models.gpt import GPTConfig
from ucp.cli.main import app
from ucp.conversion.placement import layout_metadata, recorded_layout
from ucp.conversion.reshape import reshape

STATES = ("fp32_master", "exp_avg", "exp_avg_sq")
MEG = ModelDims(hidden=16, layers=2, heads=4, kv_heads=2, vocab=37, ffn=24, max_positions=8)  # vocab 37: padded
HF = ModelDims(hidden=16, layers=2, heads=4, kv_heads=2, vocab=37, ffn=8, experts=4)
ENGINE = GPTConfig(
    vocab_size=101, n_layer=3, n_head=8, n_kv_head=4, d_model=32, d_ff=51, max_seq=16, tied_embeddings=True
)


# -- building sources and the reference ---------------------------------------------------------


def global_state(
    shapes: dict[str, tuple[int, ...]], dtype: torch.dtype = torch.float32, states: tuple[str, ...] = STATES
) -> dict[str, Any]:
    """Engine-structured state: every element of every tensor distinct (misplaced data never matches)."""
    sd: dict[str, Any] = {"model": {}, "step": 3}
    if states:
        sd["optimizer"] = {**{k: {} for k in states}, "adam_step": 3, "hparams": {"lr": 0.5}}
    pos = 1
    for name, shape in shapes.items():
        n = math.prod(shape)
        sd["model"][name] = torch.arange(pos, pos + n, dtype=torch.float64).reshape(shape).to(dtype)
        pos += n
        for i, key in enumerate(states):
            values = torch.arange(pos, pos + n, dtype=torch.float64) + 0.25 * (i + 1)
            sd["optimizer"][key][name] = values.reshape(shape).float()
            pos += n
    return sd


def make_source(path: Path, layout: Layout, shapes: dict[str, tuple[int, ...]], **kw: Any) -> dict[str, Any]:
    """A consolidated checkpoint recording ``layout`` (like an engine's); returns its flat reference tensors."""
    sd = global_state(shapes, **kw)
    ucp.save(sd, path, step=3, metadata=layout_metadata(layout, shapes))
    return flat(sd)


def torch_region(t: torch.Tensor, region: Box | FlatRange) -> torch.Tensor:
    """The reference: a region of a global tensor by plain torch indexing."""
    if isinstance(region, Box):
        return t[tuple(slice(o, o + s) for o, s in zip(region.offsets, region.shape))]
    return t.reshape(-1)[region.start : region.stop]


def assert_pieces_are_reference_slices(path: Path, ref: dict[str, Any]) -> None:
    """Every stored piece's raw bytes equal the torch slice of the reference tensor it claims to hold."""
    manifest = ucp.read_manifest(path)
    tensors = {k: v for k, v in ref.items() if isinstance(v, torch.Tensor)}
    assert set(manifest.tensors) == set(tensors)
    for name, entry in manifest.tensors.items():
        for piece in entry.pieces:
            want = torch_region(tensors[name], piece.region()).contiguous()
            with open(path / piece.file, "rb") as f:
                f.seek(piece.offset)
                data = bytearray(f.read(piece.length))
            assert len(data) == want.numel() * want.element_size(), (name, piece)
            got = torch.frombuffer(data, dtype=want.dtype).reshape(want.shape) if data else want
            assert torch.equal(
                got.view(torch.uint8) if got.numel() else got, want.view(torch.uint8) if want.numel() else want
            ), (name, piece.file, piece.region())


def assert_loads_as(path: Path, ref: dict[str, Any]) -> None:
    back = flat(ucp.load(path))
    assert back.keys() == ref.keys()
    for k, v in ref.items():
        if isinstance(v, torch.Tensor):
            assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
        else:
            assert back[k] == v, k


def regions_by_file(path: Path, prefix: str) -> dict[tuple[str, str], list[Box | FlatRange]]:
    out: dict[tuple[str, str], list[Box | FlatRange]] = {}
    for name, entry in ucp.read_manifest(path).tensors.items():
        if name.startswith(prefix):
            for p in entry.pieces:
                out.setdefault((p.file, name[len(prefix) :]), []).append(p.region())
    return out


_Target = tuple[int, int, int, int, int, int]  # target()'s tp, pp, dp, ep, zero, alignment


def target(
    base: Layout, tp: int = 1, pp: int = 1, dp: int = 1, ep: int = 1, zero: int = 0, alignment: int | None = None
) -> Layout:
    update: dict[str, Any] = {"stage": zero}
    if alignment is not None:
        update["alignment"] = alignment
    return base.replace(mesh=Mesh(tp=tp, pp=pp, dp=dp, ep=ep), zero=base.zero.model_copy(update=update))


@pytest.fixture(scope="module")
def meg(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Layout, dict[str, Any]]:
    """Megatron GPT names (reshard.presets), GQA, vocab 37 padded to 4 per rank, fp32 + Adam state."""
    path = tmp_path_factory.mktemp("meg") / "src"
    base = gpt_layout(MEG, pad_vocab_to=4)
    return path, base, make_source(path, base, gpt_shapes(MEG))


# -- each target rank holds exactly the slices a torch reference computes ----------------------


def test_megatron_tp2_pp2_rank_files_hold_hand_computed_slices(meg, tmp_path: Path) -> None:
    src, base, ref = meg
    dst = tmp_path / "dst"
    reshape(src, dst, layout=target(base, tp=2, pp=2), memory_budget=1 << 20)
    assert_pieces_are_reference_slices(dst, ref)
    assert_loads_as(dst, ref)
    f = [f"rank-{r:05d}.safetensors" for r in range(4)]  # rank = tp + 2 * pp
    h = 16
    want: dict[tuple[str, str], list[Box | FlatRange]] = {
        # tied word embedding: saved by stage 0 only; 37 rows padded to 40: rank tp=1 holds 17 real rows
        (f[0], "embedding.word_embeddings.weight"): [Box((0, 0), (20, h))],
        (f[1], "embedding.word_embeddings.weight"): [Box((20, 0), (17, h))],
        (f[0], "embedding.position_embeddings.weight"): [Box((0, 0), (8, h))],
        (f[2], "final_layernorm.weight"): [Box((0,), (h,))],
        (f[2], "final_layernorm.bias"): [Box((0,), (h,))],
    }
    for layer, stage in ((0, 0), (1, 1)):
        p = f"layers.{layer}."
        for t in range(2):
            r = f[t + 2 * stage]
            # GQA fused QKV [q:16 k:8 v:8], head_dim 4: each rank 2 q heads, 1 k head, 1 v head
            want[(r, p + "self_attention.query_key_value.weight")] = [
                Box((8 * t, 0), (8, h)),
                Box((16 + 4 * t, 0), (4, h)),
                Box((24 + 4 * t, 0), (4, h)),
            ]
            want[(r, p + "self_attention.query_key_value.bias")] = [
                Box((8 * t,), (8,)),
                Box((16 + 4 * t,), (4,)),
                Box((24 + 4 * t,), (4,)),
            ]
            want[(r, p + "self_attention.dense.weight")] = [Box((0, 8 * t), (h, 8))]
            want[(r, p + "mlp.dense_h_to_4h.weight")] = [Box((12 * t, 0), (12, h))]
            want[(r, p + "mlp.dense_h_to_4h.bias")] = [Box((12 * t,), (12,))]
            want[(r, p + "mlp.dense_4h_to_h.weight")] = [Box((0, 12 * t), (h, 12))]
        for n in (
            "input_layernorm.weight",
            "input_layernorm.bias",
            "post_attention_layernorm.weight",
            "post_attention_layernorm.bias",
            "self_attention.dense.bias",
            "mlp.dense_4h_to_h.bias",
        ):
            want[(f[2 * stage], p + n)] = [Box((0,), (h,))]  # replicated over tp: tp rank 0 saves it
    got = regions_by_file(dst, "model.")
    assert {k: sorted(v, key=str) for k, v in got.items()} == {k: sorted(v, key=str) for k, v in want.items()}
    # ZeRO-0: the optimizer states are laid out like the weights
    for key in STATES:
        assert regions_by_file(dst, f"optimizer.{key}.") == got


def test_zero3_partitions_with_alignment_padding_are_hand_computed(meg, tmp_path: Path) -> None:
    """ZeRO-3 over dp=3, alignment 8: each parameter's flat partitions of roundup(ceil(n/3), 8) elements
    (n counts the vocabulary padding; padding elements are not stored)."""
    src, base, ref = meg
    dst = tmp_path / "dst"
    reshape(src, dst, layout=target(base, dp=3, zero=3, alignment=8), memory_budget=1 << 20, workers=8)
    assert_pieces_are_reference_slices(dst, ref)
    assert_loads_as(dst, ref)
    for prefix in ("model.", *(f"optimizer.{k}." for k in STATES)):
        want: dict[tuple[str, str], list[Box | FlatRange]] = {}
        for name, shape in gpt_shapes(MEG).items():
            n = math.prod(shape)
            # ZeRO partitions the rank-local tensor: the word embedding padded to 40 rows (pad=4)
            local = 40 * 16 if name == "embedding.word_embeddings.weight" else n
            per_rank = -(-local // 3)  # ceil(local / 3)
            size = -(-per_rank // 8) * 8  # rounded up to a multiple of 8
            for d in range(3):
                a, b = min(d * size, n), min((d + 1) * size, n)
                if a < b:
                    want[(f"rank-{d:05d}.safetensors", name)] = [FlatRange(a, b)]
        got = regions_by_file(dst, prefix)
        assert {k: [(r.start, r.stop) if isinstance(r, FlatRange) else r for r in v] for k, v in got.items()} == {
            k: [(r.start, r.stop) if isinstance(r, FlatRange) else r for r in v] for k, v in want.items()
        }, prefix


def _hf_source(root: Path, fused_qkv: bool, tie: bool) -> tuple[Path, Layout, dict[str, Any]]:
    base = llama_layout(HF, fused_qkv=fused_qkv, tie_embeddings=tie, pad_vocab_to=4)
    path = root / "src"
    return path, base, make_source(path, base, llama_shapes(HF, fused_qkv=fused_qkv, tie_embeddings=tie))


ROUND_TRIPS = [  # (source kind, A = (tp, pp, dp, ep, zero, alignment), B)
    ("meg", (2, 2, 2, 1, 1, 4), (1, 1, 3, 1, 3, 8)),
    ("meg", (2, 1, 3, 1, 3, 8), (2, 2, 1, 1, 0, 1)),
    ("meg_interleaved_sp", (2, 2, 2, 1, 2, 2), (1, 2, 1, 1, 0, 1)),
    ("hf_fused_tied", (2, 2, 2, 2, 1, 8), (1, 1, 4, 4, 3, 16)),
    ("hf_separate", (2, 1, 4, 2, 3, 4), (2, 2, 2, 1, 2, 1)),
    ("engine_bf16", (4, 3, 1, 1, 1, 8), (2, 1, 2, 1, 3, 4)),
]


@pytest.mark.parametrize("kind,a,b", ROUND_TRIPS, ids=[f"{k}-{i}" for i, (k, _, _) in enumerate(ROUND_TRIPS)])
def test_round_trip_a_b_a_is_byte_identical(tmp_path: Path, kind: str, a: _Target, b: _Target) -> None:
    """A -> B -> A gives the same files byte for byte; every piece on the way is the torch slice."""
    if kind == "meg":
        base, shapes, dtype = gpt_layout(MEG, pad_vocab_to=4), gpt_shapes(MEG), torch.float32
    elif kind == "meg_interleaved_sp":
        base = gpt_layout(MEG, pad_vocab_to=4, qkv_interleaved=True, sequence_parallel=True)
        shapes, dtype = gpt_shapes(MEG), torch.float32
    elif kind.startswith("hf"):
        fused = kind == "hf_fused_tied"
        base = llama_layout(HF, fused_qkv=fused, tie_embeddings=fused, pad_vocab_to=4)
        shapes, dtype = llama_shapes(HF, fused_qkv=fused, tie_embeddings=fused), torch.float32
    else:  # the engine's own GPT: GQA, tied embedding, plain MLP with an odd d_ff (uneven), bf16 weights
        base, shapes, dtype = engine_gpt_layout(ENGINE, pad_vocab_to=8), engine_gpt_shapes(ENGINE), torch.bfloat16
    ref = make_source(tmp_path / "src", base, shapes, dtype=dtype)
    la, lb = (target(base, *x[:5], alignment=x[5]) for x in (a, b))
    reshape(tmp_path / "src", tmp_path / "a", layout=la, memory_budget=1 << 20, workers=16)  # workers > files
    reshape(tmp_path / "a", tmp_path / "b", layout=lb, memory_budget=1 << 20, workers=3)  # reshape of a reshape
    reshape(tmp_path / "b", tmp_path / "a2", layout=la, memory_budget=1 << 20)
    for dst in ("a", "b", "a2"):
        assert_pieces_are_reference_slices(tmp_path / dst, ref)
        assert not ucp.verify(tmp_path / dst).problems
    assert_loads_as(tmp_path / "b", ref)
    ma, ma2 = ucp.read_manifest(tmp_path / "a"), ucp.read_manifest(tmp_path / "a2")
    assert ma.files.keys() == ma2.files.keys() and len(ma.files) == math.prod(a[:3])
    for f in ma.files:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "a2" / f).read_bytes(), f
    assert recorded_layout(ma2).layout == la and ma2.step == 3


def test_tied_embedding_is_saved_by_the_first_stage_only(tmp_path: Path) -> None:
    path, base, ref = _hf_source(tmp_path, fused_qkv=True, tie=True)
    reshape(path, tmp_path / "dst", layout=target(base, tp=2, pp=2, dp=2, ep=2, zero=1))
    manifest = ucp.read_manifest(tmp_path / "dst")
    stage0 = {f"rank-{r:05d}.safetensors" for r in range(4)}  # order tp, dp, pp: ranks 0..3 are stage 0
    for name in ("model.model.embed_tokens.weight", "optimizer.exp_avg.model.embed_tokens.weight"):
        files = {p.file for p in manifest.tensors[name].pieces}
        assert files and files <= stage0, (name, files)
    assert "model.lm_head.weight" not in manifest.tensors
    assert_loads_as(tmp_path / "dst", ref)


def test_experts_are_split_over_ep(tmp_path: Path) -> None:
    """Stacked experts (4) over ep=2: expert-parallel rank e saves experts 2e, 2e+1; ZeRO-0, dp=2."""
    path, base, ref = _hf_source(tmp_path, fused_qkv=False, tie=False)
    reshape(path, tmp_path / "dst", layout=target(base, dp=2, ep=2))
    got = regions_by_file(tmp_path / "dst", "model.")
    for e in range(2):  # ep index = dp index (dp % ep)
        f = f"rank-{e:05d}.safetensors"
        for name, shape in (
            ("model.layers.0.mlp.experts.gate_up_proj", (2, 16, 16)),
            ("model.layers.1.mlp.experts.down_proj", (2, 16, 8)),
        ):
            regions = got[(f, name)]  # fused [gate up] at tp=1: one box per part (dim 1 is not merged)
            assert all(isinstance(r, Box) and r.offsets[0] == 2 * e and r.shape[0] == 2 for r in regions), regions
            assert sum(r.numel for r in regions) == math.prod(shape)
    assert got[("rank-00000.safetensors", "model.layers.0.mlp.router.weight")] == [Box((0, 0), (4, 16))]
    assert_pieces_are_reference_slices(tmp_path / "dst", ref)


def test_checkpoint_without_optimizer_state(tmp_path: Path) -> None:
    base, shapes = gpt_layout(MEG, pad_vocab_to=4), gpt_shapes(MEG)
    ref = make_source(tmp_path / "src", base, shapes, states=())
    reshape(tmp_path / "src", tmp_path / "dst", layout=target(base, tp=2, dp=2, zero=3, alignment=8))
    assert not any(n.startswith("optimizer") for n in ucp.read_manifest(tmp_path / "dst").tensors)
    assert_pieces_are_reference_slices(tmp_path / "dst", ref)
    assert_loads_as(tmp_path / "dst", ref)


def test_gqa_with_fewer_kv_heads_than_tp_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    cfg = GPTConfig(vocab_size=50, n_layer=2, n_head=8, n_kv_head=2, d_model=32, d_ff=48, max_seq=16)
    base = engine_gpt_layout(cfg)
    make_source(tmp_path / "gpt", base, engine_gpt_shapes(cfg), states=())
    with pytest.raises(LayoutError, match=r"layers\.0\.attn\.qkv\.weight.*part 'k' has 2 units of 4, .* tp=4"):
        reshape(tmp_path / "gpt", tmp_path / "x", layout=target(base, tp=4))
    d = ModelDims(hidden=32, layers=2, heads=8, kv_heads=2, vocab=64)
    hf = llama_layout(d)
    make_source(tmp_path / "hf", hf, llama_shapes(d), states=())
    with pytest.raises(LayoutError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight.*2 units of 4.*tp=4"):
        reshape(tmp_path / "hf", tmp_path / "x", layout=target(hf, tp=4))
    assert not (tmp_path / "x").exists()


# -- memory budget -----------------------------------------------------------------------------


def test_tensor_larger_than_the_budget_is_bit_exact(tmp_path: Path) -> None:
    """One 4 MiB tensor at the 1 MiB minimum budget: consolidated -> tp=2 -> tp=4 -> consolidated."""
    lay = Layout(rules=(Rule(name="w", dims="(tp r) c"), Rule(name="b", dims="c")), pipeline=Pipeline())
    shapes = {"w": (4096, 256), "b": (256,)}
    ref = make_source(tmp_path / "src", lay, shapes, states=("exp_avg",))
    steps = [("tp2", lay.replace(mesh=Mesh(tp=2))), ("tp4", lay.replace(mesh=Mesh(tp=4))), ("cons", None)]
    prev = tmp_path / "src"
    for name, layout in steps:
        reshape(prev, tmp_path / name, layout=layout, memory_budget=1 << 20)
        assert_pieces_are_reference_slices(tmp_path / name, ref)
        prev = tmp_path / name
    assert_loads_as(prev, ref)


class _TrackedBuffers(TrackedFileBuffers):
    """Counts the bytes of reshape's data buffers (fill arenas and read staging) alive at once."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        super().__init__(monkeypatch, ucp.conversion.reshape, ucp.loading.partial)

    def run(self, *args: Any, **kw: Any) -> int:
        self.live = self.peak = 0
        reshape(*args, **kw)
        return self.peak


@pytest.mark.parametrize("dims", ["(tp r) c", "r (tp c)"])
@pytest.mark.parametrize("workers", [1, 2])
def test_a_tensor_larger_than_the_budget_stays_within_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dims: str, workers: int
) -> None:
    """A 16 MiB tensor, split in two and consolidated again under a 2 MiB budget: its pieces are read and
    written part by part and the source checksummed span by span, so the buffers stay within the budget
    (a column split's parts cut source rows twice as wide as they are: those are staged in parts too)."""
    tracked = _TrackedBuffers(monkeypatch)
    budget, rows = 2 << 20, 16384
    lay = Layout(rules=(Rule(name="w", dims=dims),), pipeline=Pipeline())
    want = torch.arange(rows * 256, dtype=torch.float32).reshape(rows, 256)
    ucp.save(
        {"model": {"w": want}},
        tmp_path / "src",
        metadata=layout_metadata(lay, {"w": (rows, 256)}, {"model": "weights"}),
    )
    peak_split = tracked.run(
        tmp_path / "src", tmp_path / "tp2", layout=lay.replace(mesh=Mesh(tp=2)), memory_budget=budget, workers=workers
    )
    assert [len(e.pieces) for e in ucp.read_manifest(tmp_path / "tp2").tensors.values()] == [2]
    peak_back = tracked.run(tmp_path / "tp2", tmp_path / "back", memory_budget=budget, workers=workers)
    assert torch.equal(ucp.load(tmp_path / "back")["model"]["w"], want)
    assert torch.equal(ucp.load(tmp_path / "tp2")["model"]["w"], want)
    assert peak_split <= budget and peak_back <= budget, (peak_split / 2**20, peak_back / 2**20)
    # the files written part by part are plain safetensors files: each piece is its entry, bit-exact
    from safetensors import safe_open

    for ckpt in ("tp2", "back"):
        for piece in ucp.read_manifest(tmp_path / ckpt).tensors["model.w"].pieces:
            with safe_open(str(tmp_path / ckpt / piece.file), framework="pt") as f:
                got = f.get_tensor(piece.entry or "model.w")
            assert piece.box is not None
            row_slice, col_slice = (slice(o, o + n) for o, n in zip(piece.box.offsets, piece.box.shape))
            assert torch.equal(got, want[row_slice, col_slice])


@pytest.mark.parametrize("where", [0.0, 0.3, 0.999])
@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("dims", ["(tp r) c", "r (tp c)"])  # parts read straight in / staged
def test_a_flipped_byte_in_a_piece_checked_span_by_span_fails_the_reshape(
    tmp_path: Path, where: float, workers: int, dims: str
) -> None:
    rows = 8192
    lay = Layout(rules=(Rule(name="w", dims=dims),), pipeline=Pipeline())
    ucp.save(
        {"model": {"w": torch.randn(rows, 256)}},
        tmp_path / "src",
        metadata=layout_metadata(lay, {"w": (rows, 256)}, {"model": "weights"}),
    )
    piece = ucp.read_manifest(tmp_path / "src").tensors["model.w"].pieces[0]
    with open(tmp_path / "src" / piece.file, "r+b") as f:
        f.seek(piece.offset + int(piece.length * where))
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(ucp.CorruptCheckpointError, match=r"model\.w"):
        reshape(
            tmp_path / "src",
            tmp_path / "dst",
            layout=lay.replace(mesh=Mesh(tp=2)),
            memory_budget=1 << 20,
            workers=workers,
        )
    assert not (tmp_path / "dst").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".dst")] == []


def test_the_rest_of_a_piece_checked_span_by_span_is_read_at_the_end(tmp_path: Path) -> None:
    """Only the first rows of a large piece are wanted; the bytes no span brought in are read at the end,
    so a flipped byte there still fails the load (as when the piece was read whole to check it)."""
    from ucp.loading.partial import Target, read_targets
    from ucp.store.storage import open_storage

    rows = 8192
    w = torch.randn(rows, 256)
    ucp.save({"w": w}, tmp_path / "src")
    manifest = ucp.read_manifest(tmp_path / "src")
    piece = manifest.tensors["w"].pieces[0]
    out = torch.empty(16, 256)
    storage, name = open_storage(str(tmp_path / "src"))
    with storage:
        read_targets(
            storage, name, manifest, [Target("w", out, Box((8, 0), (16, 256)))], verify=True, staging_bytes=1 << 20
        )
        assert torch.equal(out, w[8:24])
        with open(tmp_path / "src" / piece.file, "r+b") as f:
            f.seek(piece.offset + piece.length - 3)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0x80]))
        with pytest.raises(ucp.CorruptCheckpointError, match="CRC-32C mismatch"):
            read_targets(
                storage, name, manifest, [Target("w", out, Box((8, 0), (16, 256)))], verify=True, staging_bytes=1 << 20
            )


def test_minimum_memory_budget_bounds_the_buffers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """At the minimum budget, with more workers than it affords, fewer files are written at once."""
    tracked = _TrackedBuffers(monkeypatch)
    lay = Layout(rules=(Rule(name="*", dims="(tp r) c"),), pipeline=Pipeline())
    # 8 MiB in 32 KiB tensors: no piece, source or target, exceeds a batch or its read staging
    shapes = {f"t{i}": (32, 256) for i in range(256)}
    ucp.save(
        {"model": {n: torch.full(s, float(i)) for i, (n, s) in enumerate(shapes.items())}},
        tmp_path / "src",
        metadata=layout_metadata(lay, shapes, {"model": "weights"}),
    )
    budget = ucp.conversion.reshape.MIN_MEMORY_BUDGET
    peak = tracked.run(
        tmp_path / "src", tmp_path / "dst", layout=lay.replace(mesh=Mesh(tp=2)), memory_budget=budget, workers=2
    )
    assert peak <= budget, f"{peak / 2**20:.1f} MiB of buffers under a {budget / 2**20:.0f} MiB budget"
    back = ucp.load(tmp_path / "dst")["model"]
    assert all(torch.equal(back[n], torch.full(s, float(i))) for i, (n, s) in enumerate(shapes.items()))


def test_budget_below_the_minimum_is_refused(meg, tmp_path: Path) -> None:
    src, base, _ = meg
    with pytest.raises(ValueError, match="1 MiB minimum"):
        reshape(src, tmp_path / "dst", layout=target(base, tp=2), memory_budget=(1 << 20) - 1)
    res = CliRunner().invoke(app, ["reshape", str(src), str(tmp_path / "dst"), "--tp", "2", "--memory-budget", "1MB"])
    assert res.exit_code == 2 and "at least 1 MiB" in res.output
    assert not (tmp_path / "dst").exists()


# -- consolidated output -----------------------------------------------------------------------


def test_consolidated_output_loads_with_ucp_and_safetensors(meg, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    src, base, ref = meg
    reshape(src, tmp_path / "tp2", layout=target(base, tp=2, dp=2, zero=1))
    reshape(tmp_path / "tp2", tmp_path / "cons")
    manifest = ucp.read_manifest(tmp_path / "cons")
    assert manifest.metadata["consolidated"] is True and manifest.topology.world_size == 1
    assert all(
        len(e.pieces) == 1 and e.pieces[0].region() == Box.full(tuple(e.shape)) for e in manifest.tensors.values()
    )
    assert_loads_as(tmp_path / "cons", ref)
    [file] = manifest.files
    st = {k: v for k, v in load_file(str(tmp_path / "cons" / file)).items() if not k.startswith("__pad__")}
    assert st.keys() == {k for k, v in ref.items() if isinstance(v, torch.Tensor)}
    for k, v in st.items():
        assert v.dtype == ref[k].dtype and torch.equal(v, ref[k]), k


def test_consolidation_ignores_foreign_metadata_keys(tmp_path: Path) -> None:
    sd = {"w": torch.arange(12.0).reshape(3, 4)}
    ucp.save(sd, tmp_path / "src", metadata={"layout": "NCHW", "shapes": {"w": [3, 4]}})
    reshape(tmp_path / "src", tmp_path / "dst")
    assert torch.equal(ucp.load(tmp_path / "dst")["w"], sd["w"])
    meta = ucp.read_manifest(tmp_path / "dst").metadata
    assert meta["layout"] == "NCHW" and meta["shapes"] == {"w": [3, 4]} and meta["consolidated"] is True


def test_consolidated_output_with_explicit_stages_reshapes_again(meg, tmp_path: Path) -> None:
    src, base, ref = meg
    staged = target(base, pp=2).replace(pipeline=base.pipeline.model_copy(update={"stages": ((1,), (0,))}))
    reshape(src, tmp_path / "pp2", layout=staged)
    assert_pieces_are_reference_slices(tmp_path / "pp2", ref)
    reshape(tmp_path / "pp2", tmp_path / "cons")
    res = CliRunner().invoke(app, ["reshape", str(tmp_path / "cons"), str(tmp_path / "tp2"), "--tp", "2"])
    assert res.exit_code == 0, res.output
    assert_loads_as(tmp_path / "tp2", ref)


# -- sources whose metadata disagrees with their tensors ---------------------------------------


def test_recorded_shapes_disagreeing_with_a_tensor_name_it(meg, tmp_path: Path) -> None:
    src, base, ref = meg
    shapes = dict(gpt_shapes(MEG))
    sd = {
        "model": {k[6:]: v for k, v in ref.items() if k.startswith("model.")},
        "optimizer": {"exp_avg": {k: v for k, v in ref.items() if k.startswith("model.")}},
    }
    sd["optimizer"]["exp_avg"] = {k[6:]: v for k, v in sd["optimizer"]["exp_avg"].items()}
    sd["optimizer"]["exp_avg"]["layers.1.mlp.dense_4h_to_h.weight"] = torch.zeros(24, 16)  # transposed
    ucp.save(sd, tmp_path / "src", metadata=layout_metadata(base, shapes))
    with pytest.raises(ucp.LayoutMismatchError, match=r"optimizer\.exp_avg\.layers\.1\.mlp\.dense_4h_to_h\.weight"):
        reshape(tmp_path / "src", tmp_path / "dst", layout=target(base, tp=2))
    assert not (tmp_path / "dst").exists()


def test_recorded_layout_that_does_not_fit_the_tensors_names_the_tensor(tmp_path: Path) -> None:
    """metadata.layout claims fused q/k/v sizes the stored tensor does not have: the CLI says which tensor."""
    base, shapes = gpt_layout(MEG, pad_vocab_to=4), gpt_shapes(MEG)
    wrong = base.replace(
        rules=tuple(
            Rule(name=r.name, dims=r.dims.replace("k:8 v:8", "k:4 v:4")) if "query_key_value" in r.name else r
            for r in base.rules
        )
    )
    sd = global_state(shapes, states=())
    ucp.save(sd, tmp_path / "src", metadata=layout_metadata(wrong, shapes))
    res = CliRunner().invoke(app, ["reshape", str(tmp_path / "src"), str(tmp_path / "dst"), "--tp", "2"])
    assert res.exit_code == 2, res.output
    assert "layers.0.self_attention.query_key_value" in res.output and "do not add up" in res.output
    assert not (tmp_path / "dst").exists()


def test_recorded_mesh_is_not_trusted_over_the_pieces(meg, tmp_path: Path) -> None:
    """metadata.layout says tp=4 ZeRO-3 but the pieces are consolidated: the pieces are what is read."""
    src, base, ref = meg
    sd = {"model": {k[6:]: v for k, v in ref.items() if k.startswith("model.")}}
    ucp.save(sd, tmp_path / "src", metadata=layout_metadata(target(base, tp=4, dp=2, zero=3), gpt_shapes(MEG)))
    reshape(tmp_path / "src", tmp_path / "dst", layout=target(base, tp=2, dp=2, zero=1))
    model_ref = {k: v for k, v in ref.items() if k.startswith("model.")}
    assert_pieces_are_reference_slices(tmp_path / "dst", model_ref)


def test_top_level_tensors_can_be_reshaped(tmp_path: Path) -> None:
    w = torch.arange(12.0).reshape(4, 3)
    ucp.save({"w": w}, tmp_path / "src")
    lay = Layout(rules=(Rule(name="w", dims="(tp r) c"),), mesh=Mesh(tp=2))
    reshape(tmp_path / "src", tmp_path / "dst", layout=lay, shapes={"w": (4, 3)}, sections={"": "weights"})
    regions = regions_by_file(tmp_path / "dst", "")
    assert regions == {
        ("rank-00000.safetensors", "w"): [Box((0, 0), (2, 3))],
        ("rank-00001.safetensors", "w"): [Box((2, 0), (2, 3))],
    }
    # the root section is recorded: reshaping again needs no options but the mesh
    res = CliRunner().invoke(app, ["reshape", str(tmp_path / "dst"), str(tmp_path / "tp1"), "--tp", "1"])
    assert res.exit_code == 0, res.output
    assert regions_by_file(tmp_path / "tp1", "") == {("rank-00000.safetensors", "w"): [Box((0, 0), (4, 3))]}
    assert torch.equal(ucp.load(tmp_path / "tp1")["w"], w)


def test_top_level_tensors_are_the_weights_unless_sections_exist_then_refused_with_a_hint(tmp_path: Path) -> None:
    """A checkpoint whose tensors lie in no section (a plain state dict) reshapes with the root as its
    weights; one that also has the engine's sections is refused, with a hint, for its top-level tensors."""
    w = torch.arange(12.0).reshape(4, 3)
    ucp.save({"w": w}, tmp_path / "plain")
    lay = Layout(rules=(Rule(name="w", dims="(tp r) c"),), mesh=Mesh(tp=2))
    reshape(tmp_path / "plain", tmp_path / "plain-tp2", layout=lay, shapes={"w": (4, 3)})
    assert regions_by_file(tmp_path / "plain-tp2", "")[("rank-00001.safetensors", "w")] == [Box((2, 0), (2, 3))]
    assert torch.equal(ucp.load(tmp_path / "plain-tp2")["w"], w)

    ucp.save({"model": {"v": torch.ones(2)}, "w": w}, tmp_path / "mixed")
    hint = r"parameter 'w' .* no section \(model, .*sections=\{'': 'weights'\}"
    with pytest.raises(ucp.LayoutMismatchError, match=hint):
        reshape(tmp_path / "mixed", tmp_path / "dst", layout=lay, shapes={"w": (4, 3)})
    assert not (tmp_path / "dst").exists()


# -- where DST is, the command line ------------------------------------------------------------


def test_dst_inside_src_and_in_place_overwrite(meg, tmp_path: Path) -> None:
    src, base, ref = meg
    a = tmp_path / "a"
    reshape(src, a, layout=target(base, tp=2, dp=2, zero=2))
    reshape(a, a / "inner", memory_budget=1 << 20)  # temp dir and result inside the source checkpoint
    assert_pieces_are_reference_slices(a / "inner", ref)
    assert not ucp.verify(a).problems
    assert_loads_as(a, ref)
    reshape(a / "inner", a / "inner", layout=target(base, pp=2), overwrite=True)  # DST == SRC: read, then swapped
    assert ucp.read_manifest(a / "inner").topology.mesh == {"tp": 1, "pp": 2, "dp": 1}
    assert_pieces_are_reference_slices(a / "inner", ref)
    assert [p.name for p in a.iterdir() if p.name.startswith(".")] == []


def test_progress_reaches_its_total(meg, tmp_path: Path) -> None:
    src, base, _ = meg
    calls: list[tuple[int, int]] = []
    reshape(
        src,
        tmp_path / "dst",
        layout=target(base, tp=2, dp=2, zero=1),
        progress=lambda done, total, what: calls.append((done, total)),
    )
    assert calls and all(b >= a for (a, _), (b, _) in zip(calls, calls[1:]))
    assert calls[-1][0] == calls[-1][1], calls[-1]
    pieces = ucp.read_manifest(tmp_path / "dst").tensors.values()
    assert calls[-1][1] == sum(p.length for e in pieces for p in e.pieces)  # data bytes: headers are not counted


def test_cli_without_a_terminal_prints_no_progress_bar(meg, tmp_path: Path) -> None:
    src, _, ref = meg
    res = CliRunner().invoke(
        app,
        [
            "reshape",
            str(src),
            str(tmp_path / "dst"),
            "--tp",
            "2",
            "--pp",
            "2",
            "--workers",
            "64",
            "--memory-budget",
            "1MiB",
        ],
    )
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())  # the console wraps at 80 columns
    assert text.startswith("reshaped ") and "4 files" in text and text.count("reshaped") == 1, res.output
    assert "\r" not in res.output and "\x1b" not in res.output and "━" not in res.output
    assert_loads_as(tmp_path / "dst", ref)
