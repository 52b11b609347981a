"""Pieces larger than a batch read and written part by part, source pieces checksummed span by span.

Covers ``reshard.box.split_region``, ``ucp.conversion.reshape`` (parts handed to the writer as iterators),
``ucp.loading.partial.read_targets`` / ``SourceIndex.feed`` / ``SourceIndex.finish`` and ``_direct_span``
(parts of a stored piece read straight into a target), through reshape, ``read_targets`` with a
small staging, and the exporters. Small memory budgets force the new paths with small tensors.
"""

from __future__ import annotations

import functools
import itertools
import math
import shutil
import threading
from pathlib import Path
from typing import Any, Literal

import pytest
import torch
from ucp_helpers import TrackedFileBuffers

import ucp
import ucp.conversion.exporters.stream
import ucp.loading.partial
import ucp.store.reader
from reshard import Box, FlatRange, Layout, Mesh, Pipeline, Rule
from reshard.box import split_region, transfers
from ucp.conversion.exporters import export
from ucp.conversion.placement import layout_metadata
from ucp.conversion.reshape import reshape
from ucp.loading.partial import SourceIndex, Target, read_targets
from ucp.store.storage import open_storage

BUDGET = 1 << 20  # the minimum: batches of ~184 KiB, read staging of ~46 KiB


# -- helpers ----------------------------------------------------------------------------------------


def flip_byte(ckpt: Path, piece: Any, at: int) -> None:
    """Flip one bit of byte ``at`` of a stored piece."""
    with open(ckpt / piece.file, "r+b") as f:
        f.seek(piece.offset + at)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x01]))


def values(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    return (torch.randn(shape, generator=g) * 3).to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.bool:
        return torch.equal(a, b)
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def one_tensor_source(path: Path, dims: str, want: torch.Tensor) -> Layout:
    lay = Layout(rules=(Rule(name="w", dims=dims),), pipeline=Pipeline())
    ucp.save(
        {"model": {"w": want}}, path, metadata=layout_metadata(lay, {"w": tuple(want.shape)}, {"model": "weights"})
    )
    return lay


def with_mesh(lay: Layout, tp: int = 1, dp: int = 1, zero: int = 0) -> Layout:
    return lay.replace(mesh=Mesh(tp=tp, dp=dp), zero=lay.zero.model_copy(update={"stage": zero}))


def region_of(w: torch.Tensor, region: Box | FlatRange) -> torch.Tensor:
    if isinstance(region, Box):
        return w[tuple(slice(o, o + s) for o, s in zip(region.offsets, region.shape))]
    return w.reshape(-1)[region.start : region.stop]


def fill(
    src: Path, targets: list[Target], *, verify: bool = True, staging: int = 1 << 14, index: SourceIndex | None = None
) -> None:
    manifest = ucp.read_manifest(src)
    storage, name = open_storage(str(src))
    with storage:
        read_targets(storage, name, manifest, targets, verify=verify, staging_bytes=staging, index=index)
        if index is not None:
            index.finish(storage, name, staging)


# -- split_region -------------------------------------------------------------------------------------


def test_split_region_parts_are_consecutive_bounded_and_cover_the_region() -> None:
    for shape, offsets in [((5, 3, 7), (1, 0, 2)), ((4, 9), (0, 3)), ((13,), (2,)), ((2, 1, 1, 6), (0, 0, 0, 1))]:
        glob = tuple(o + s for o, s in zip(offsets, shape))
        full = torch.arange(math.prod(glob)).reshape(glob)
        box = Box(offsets, shape)
        want = region_of(full, box).reshape(-1).tolist()
        for itemsize, max_bytes in itertools.product((1, 2, 4), (1, 5, 8, 24, 60, 10_000)):
            parts = split_region(box, itemsize, max_bytes)
            got, pos = [], 0
            for first, part in parts:
                assert first == pos
                assert part.numel * itemsize <= max(max_bytes, itemsize) or len(parts) == 1
                got += region_of(full, part).reshape(-1).tolist()
                pos += part.numel
            assert got == want, (shape, itemsize, max_bytes)
    parts = split_region(FlatRange(3, 20), 4, 16)
    assert parts == [
        (0, FlatRange(3, 7)),
        (4, FlatRange(7, 11)),
        (8, FlatRange(11, 15)),
        (12, FlatRange(15, 19)),
        (16, FlatRange(19, 20)),
    ]
    assert split_region(Box((), ()), 8, 1) == [(0, Box((), ()))]  # 0-d: one element, a part of its own
    assert split_region(Box((0, 4), (0, 5)), 4, 1) == [(0, Box((0, 4), (0, 5)))]  # empty


# -- reshape: parts, dtypes, layouts ---------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype, shape, dims",
    [
        (torch.bfloat16, (1024, 300), "(tp r) c"),
        (torch.bool, (1024, 300), "r (tp c)"),
        (torch.float8_e4m3fn, (700, 600), "r (tp c)"),
        (torch.float64, (2, 150000), "(tp r) c"),  # one row wider than a batch: parts cut the rows
        (torch.float32, (2, 2, 100000), "a b (tp c)"),  # parts of the last dimension
    ],
)
def test_reshape_of_tensors_larger_than_a_batch_is_bit_exact(
    tmp_path: Path, dtype: torch.dtype, shape: tuple[int, ...], dims: str
) -> None:
    want = values(dtype, shape)
    lay = one_tensor_source(tmp_path / "src", dims, want)
    steps = [
        ("tp2", with_mesh(lay, tp=2)),
        ("z3", with_mesh(lay, tp=2, dp=2, zero=3)),
        ("z1", with_mesh(lay, dp=3, zero=1)),
        ("cons", None),
    ]
    prev = tmp_path / "src"
    for name, layout in steps:
        reshape(prev, tmp_path / name, layout=layout, memory_budget=BUDGET, workers=2)
        got = ucp.load(tmp_path / name)["model"]["w"]
        assert same_bits(got, want), name
        prev = tmp_path / name


def test_reshape_with_empty_0d_and_boundary_sized_tensors(tmp_path: Path) -> None:
    """Pieces of a batch's size give or take a page, next to empty and 0-d tensors, consolidated from tp=2."""
    g = torch.Generator().manual_seed(3)
    batch = 188416  # ucp.conversion.reshape._share_budget(1 MiB, ...) for one file
    shapes = {
        "a": (300, 256),
        "e": (0, 8),
        "s": (),
        "b": (batch // 4096 - 1, 1024),
        "c": (batch // 4096, 1024),
        "d": (2, batch // 4),
        "f": (1, 3),
        "h": (3, 70000),
    }
    sd = {"model": {n: torch.randn(s, generator=g) for n, s in shapes.items()}}
    ucp.save(sd, tmp_path / "src")
    for workers in (1, 2):
        reshape(tmp_path / "src", tmp_path / f"cons{workers}", memory_budget=BUDGET, workers=workers)
        back = ucp.load(tmp_path / f"cons{workers}")["model"]
        for n in shapes:
            assert same_bits(back[n], sd["model"][n]), n


@pytest.mark.parametrize("where", [0.0, 0.51, 0.9999])
def test_flipped_byte_in_a_flat_zero_source_piece_fails_the_reshape(tmp_path: Path, where: float) -> None:
    """ZeRO-3 flat partitions (FlatRange pieces) read span by span into column-split parts."""
    want = values(torch.float32, (1024, 256))
    lay = one_tensor_source(tmp_path / "src", "r (tp c)", want)
    reshape(tmp_path / "src", tmp_path / "z3", layout=with_mesh(lay, dp=2, zero=3), memory_budget=BUDGET)
    pieces = ucp.read_manifest(tmp_path / "z3").tensors["model.w"].pieces
    assert all(isinstance(p.region(), FlatRange) for p in pieces) and len(pieces) == 2
    for k, piece in enumerate(pieces):
        bad = tmp_path / f"bad{k}"
        shutil.copytree(tmp_path / "z3", bad)
        flip_byte(bad, piece, int(piece.length * where))
        for layout in (with_mesh(lay, tp=2), None):
            with pytest.raises(ucp.CorruptCheckpointError, match=r"model\.w"):
                reshape(bad, tmp_path / "out", layout=layout, memory_budget=BUDGET, workers=2)
            assert not (tmp_path / "out").exists()
            assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []


def test_a_failing_file_stops_the_other_and_leaves_no_reader_threads(tmp_path: Path) -> None:
    """A corrupt byte only the second file reads: the reshape fails, the first file is abandoned, and
    no read-ahead thread of either file outlives the call."""
    want = values(torch.float32, (4096, 256))
    lay = one_tensor_source(tmp_path / "src", "(tp r) c", want)
    piece = ucp.read_manifest(tmp_path / "src").tensors["model.w"].pieces[0]
    flip_byte(tmp_path / "src", piece, piece.length * 3 // 4)  # in the rows of rank 1
    with pytest.raises(ucp.CorruptCheckpointError, match=r"model\.w"):
        reshape(tmp_path / "src", tmp_path / "dst", layout=with_mesh(lay, tp=2), memory_budget=BUDGET * 4, workers=2)
    assert not (tmp_path / "dst").exists()
    assert [t.name for t in threading.enumerate() if t.name.startswith("ucp-reshape")] == []


def test_a_writer_failing_on_its_own_stops_the_read_ahead_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The destination fails (say ENOSPC) after a few pieces: no fill reads on while the error is handled,
    even though the caller still holds the exception (and with it the writer's frames)."""
    import ucp.conversion.reshape
    import ucp.store.writer

    want = values(torch.float32, (4096, 256))
    one_tensor_source(tmp_path / "src", "(tp r) c", want)
    real = ucp.store.writer.write_rank_file
    fills: list[int] = []
    real_fill = ucp.conversion.reshape._fill

    def counted_fill(batch: Any, *a: Any) -> Any:
        fills.append(1)
        return real_fill(batch, *a)

    monkeypatch.setattr(ucp.conversion.reshape, "_fill", counted_fill)

    def failing(storage, rel_path, plan, views, **kw):  # noqa: ANN001, ANN003, ANN202
        it = iter(views)
        next(it)  # the first piece's bytes arrive, then the device is full
        raise OSError(28, "No space left on device", rel_path)

    monkeypatch.setattr(ucp.conversion.reshape, "write_rank_file", failing)
    with pytest.raises(OSError, match="No space left") as info:
        reshape(tmp_path / "src", tmp_path / "dst", memory_budget=BUDGET, workers=1)
    assert info.value is not None  # the exception (and its traceback) is alive here
    assert [t.name for t in threading.enumerate() if t.name.startswith("ucp-reshape")] == []
    settled = len(fills)
    threading.Event().wait(0.2)
    assert len(fills) == settled <= 1 + ucp.conversion.reshape.READ_AHEAD
    assert real is ucp.store.writer.write_rank_file
    assert not (tmp_path / "dst").exists()


# -- read_targets with a small staging: parts read straight in, spans fed to the running CRC ---------

R, C = 256, 64

SOURCES = {
    "whole": lambda w: w,
    "rows": lambda w: ucp.Shards(
        [ucp.ShardedTensor(w[:100].clone(), (R, C), (0, 0)), ucp.ShardedTensor(w[100:].clone(), (R, C), (100, 0))]
    ),
    "cols": lambda w: ucp.Shards(
        [
            ucp.ShardedTensor(w[:, :24].contiguous(), (R, C), (0, 0)),
            ucp.ShardedTensor(w[:, 24:].contiguous(), (R, C), (0, 24)),
        ]
    ),
    "flat": lambda w: ucp.Shards(
        [
            ucp.FlatShard(w.reshape(-1)[:5000].clone(), (R, C), 0),
            ucp.FlatShard(w.reshape(-1)[5000:].clone(), (R, C), 5000),
        ]
    ),
}

TARGETS = {
    "sub_rows": lambda: [Target("w", torch.empty(40, C), Box((100, 0), (40, C)))],
    "sub_rows_bf16": lambda: [Target("w", torch.empty(40, C, dtype=torch.bfloat16), Box((100, 0), (40, C)))],
    "sub_cols": lambda: [Target("w", torch.empty(R, 10), Box((0, 20), (R, 10)))],
    "transposed_view": lambda: [Target("w", torch.empty(C, 40).t(), Box((100, 0), (40, C)))],
    "two_with_a_gap": lambda: [
        Target("w", torch.empty(10, C), Box((5, 0), (10, C))),
        Target("w", torch.empty(10, C), Box((200, 0), (10, C))),
    ],
    "same_region_twice": lambda: [
        Target("w", torch.empty(R, C), Box((0, 0), (R, C))),
        Target("w", torch.empty(R, C), Box((0, 0), (R, C))),
    ],
    "flat_middle": lambda: [Target("w", torch.empty(3000), FlatRange(4000, 7000))],
    "full_f64": lambda: [Target("w", torch.empty(R, C, dtype=torch.float64), Box((0, 0), (R, C)))],
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor]:
    root = tmp_path_factory.mktemp("sources")
    w = values(torch.float32, (R, C), seed=7)
    for kind, make in SOURCES.items():
        ucp.save({"w": make(w)}, root / kind)
    return root, w


@pytest.mark.parametrize("kind", list(SOURCES))
@pytest.mark.parametrize("targets", list(TARGETS))
def test_small_staging_fills_are_bit_exact_and_detect_every_flipped_piece(
    sources, tmp_path: Path, kind: str, targets: str
) -> None:
    root, w = sources
    for verify in (True, False):
        ts = TARGETS[targets]()
        fill(root / kind, ts, verify=verify)
        for t in ts:
            assert same_bits(t.buffer, region_of(w, t.region).to(t.buffer.dtype)), (verify, t.region)
    for k, piece in enumerate(ucp.read_manifest(root / kind).tensors["w"].pieces):
        if not any(transfers(piece.region(), t.region, (R, C)) for t in TARGETS[targets]()):
            continue
        for where in (0.0, 0.5, 0.9999):
            bad = tmp_path / f"bad-{k}-{where}"
            shutil.copytree(root / kind, bad)
            flip_byte(bad, piece, int(piece.length * where))
            with pytest.raises(ucp.CorruptCheckpointError, match="CRC-32C mismatch"):
                fill(bad, TARGETS[targets]())
            shutil.rmtree(bad)


def test_shared_index_spans_out_of_order_are_completed_by_finish(sources, tmp_path: Path) -> None:
    """Two calls on one index read a piece's later rows first, then earlier ones; the bytes no span fed
    in order (here a gap no call wants) are read by ``finish``, which finds the flipped byte there."""
    root, w = sources
    shutil.copytree(root / "whole", tmp_path / "src")
    piece = ucp.read_manifest(tmp_path / "src").tensors["w"].pieces[0]
    flip_byte(tmp_path / "src", piece, 60 * C * 4 + 5)  # row 60: wanted by no call
    manifest = ucp.read_manifest(tmp_path / "src")
    index = SourceIndex.of(manifest)
    late, early = torch.empty(50, C), torch.empty(20, C)
    storage, name = open_storage(str(tmp_path / "src"))
    with storage:
        read_targets(
            storage,
            name,
            manifest,
            [Target("w", late, Box((150, 0), (50, C)))],
            verify=True,
            index=index,
            staging_bytes=1 << 14,
        )
        read_targets(
            storage,
            name,
            manifest,
            [Target("w", early, Box((0, 0), (20, C)))],
            verify=True,
            index=index,
            staging_bytes=1 << 14,
        )
        assert torch.equal(late, w[150:200]) and torch.equal(early, w[:20])
        with pytest.raises(ucp.CorruptCheckpointError, match="CRC-32C mismatch"):
            index.finish(storage, name, 1 << 14)


class _TrackedStaging(TrackedFileBuffers):
    """Bytes of ``ucp.loading.partial``'s FileBuffers (read staging, finish's chunk) alive at once."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        super().__init__(monkeypatch, ucp.loading.partial)


def test_a_sub_box_of_a_large_piece_stays_within_the_staging(sources, monkeypatch: pytest.MonkeyPatch) -> None:
    """A few rows of a 64 KiB piece under 8 KiB of staging: read straight in, the rest checked a chunk at a time."""
    root, w = sources
    tracked = _TrackedStaging(monkeypatch)
    staging = 8 << 10
    out = torch.empty(8, C)
    fill(root / "whole", [Target("w", out, Box((30, 0), (8, C)))], staging=staging)
    assert torch.equal(out, w[30:38])
    assert tracked.peak <= staging + 4096, tracked.peak


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.empty(R, C, dtype=torch.bfloat16),  # load(into=) of fp32 weights into a bf16 model
        lambda: torch.empty(C, R).t(),  # a transposed view
    ],
    ids=["cast", "non_contiguous"],
)
def test_a_cast_or_strided_target_of_a_large_piece_stays_within_the_staging(
    sources, monkeypatch: pytest.MonkeyPatch, make: Any
) -> None:
    root, w = sources
    tracked = _TrackedStaging(monkeypatch)
    staging = 8 << 10
    out = make()
    fill(root / "whole", [Target("w", out, Box.full((R, C)))], staging=staging)
    assert torch.equal(out, w.to(out.dtype))
    held = (ucp.loading.partial.READ_AHEAD + 1) * staging + 4096
    assert tracked.peak <= held, f"{tracked.peak} bytes of staging for {R * C * 4}-byte piece, staging {staging}"


# -- exporters --------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["hf", "zarr"])
def test_export_of_large_pieces_under_a_small_staging(
    sources, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: Literal["hf", "zarr"]
) -> None:
    """Column shards larger than the staging (checked span by span) export bit-exactly; a flipped byte fails."""
    from safetensors.torch import load_file

    root, w = sources
    monkeypatch.setattr(
        ucp.conversion.exporters.stream,
        "read_targets",
        functools.partial(ucp.conversion.exporters.stream.read_targets, staging_bytes=4096),
    )
    export(root / "cols", tmp_path / "ok", format=fmt, memory_budget=1 << 16)
    if fmt == "hf":
        got = load_file(tmp_path / "ok" / "model.safetensors")["w"]
    else:
        from zarr_checks import array, open_group, values

        got = torch.from_numpy(values(array(open_group(tmp_path / "ok", mode="r"), "w")))
    assert torch.equal(got, w)
    shutil.copytree(root / "cols", tmp_path / "bad")
    piece = ucp.read_manifest(tmp_path / "bad").tensors["w"].pieces[1]
    flip_byte(tmp_path / "bad", piece, piece.length - 2)
    with pytest.raises(ucp.CorruptCheckpointError, match="CRC-32C mismatch"):
        export(tmp_path / "bad", tmp_path / "out", format=fmt, memory_budget=1 << 16)
    assert not (tmp_path / "out").exists()
