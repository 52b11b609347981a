"""The executor: how the budget is spent (resident groups and tensors, the ring, prefetch depth) at the
tensor grain (the cpu path) and the layer grain (the device paths, run here as ``staged`` on the CPU),
byte-exact loads of tensors in unaligned and many-piece runs, reads bypassing the page cache under
O_DIRECT, continuous prefetch across passes, and a read failure surfacing in the compute thread."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

import pytest
import torch
from inference_models import save_hf, tiny_llama

from aio import AioHandle, AlignedBuffer
from training.inference.config import load_model
from training.inference.errors import InferenceError
from training.inference.executor import READ_CONFIG, Executor, load_group, tensor_views
from training.inference.generate import generate
from training.inference.layout import FileSizes, layout_group
from training.inference.sources import Run, TensorSource, WeightSource, open_weights

pytest.importorskip("transformers")

LAYER = 131072  # one layer's buffer in the tiny model (126976 bytes of weights, page-rounded)
EDGES = 32768 + 256 + 32768  # embedding, final norm and head, resident in fp32


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf(tiny_llama(), tmp_path_factory.mktemp("ex") / "hf")


def executor(path: Path, budget: int, **kw: object) -> Executor:
    """Layers streamed, none pinned, unless ``pin_layers=True`` is passed."""
    model, source = load_model(open_weights(path))
    kw.setdefault("pin_layers", False)
    return Executor(model, source, budget, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "budget, prefetch, resident, slots",
    [
        (1 << 20, None, True, 4),  # plenty: edges resident, a buffer per layer + 1
        (EDGES + 2 * LAYER, None, True, 2),  # edges + two layer buffers: one read ahead
        (EDGES + 3 * LAYER - 1, None, True, 2),
        (1 << 20, 1, True, 2),  # --prefetch 1
        (EDGES + 2 * LAYER - 1, None, False, 2),  # edges + 2 layers do not fit: everything streams
        (LAYER, None, False, 1),  # exactly one buffer: no overlap, still runs
    ],
)
def test_layer_grain_budget_plan(weights: Path, budget: int, prefetch: int | None, resident: bool, slots: int) -> None:
    with executor(weights, budget, prefetch=prefetch, read_path="staged") as ex:
        assert ex.plan.grain == "layer"
        p = ex.plan
        assert bool(p.resident) == resident and p.slots == slots and p.prefetch == slots - 1
        assert p.resident_bytes + p.ring_bytes <= budget
        assert p.resident_bytes == (EDGES if resident else 0)
        got = generate(ex, [[1, 2, 3]], 3).tokens
    with executor(weights, 1 << 20) as ex:
        assert generate(ex, [[1, 2, 3]], 3).tokens == got


A, L = 126976, 131072  # the layers' read sizes: 0 and 1 start mid-page in the file, 2 spans one page more
SIZES = [A, A, L]


@pytest.mark.parametrize(
    "budget, prefetch, pinned, slots",
    [
        (EDGES + 2 * A + L, None, [0, 1, 2], 1),  # every layer fits: all pinned, no ring, nothing streamed
        (EDGES + 2 * A + L - 1, None, [], 2),  # a two-buffer ring leaves less than a layer
        (EDGES + 2 * A + L - 1, 0, [1], 1),  # --prefetch 0: a one-buffer ring leaves one (the middle one)
        (EDGES + A + L, 0, [1], 1),
        (EDGES + A + L - 1, 0, [], 1),
    ],
)
def test_layer_grain_pins_whole_layers_beyond_the_ring(
    weights: Path, budget: int, prefetch: int | None, pinned: list[int], slots: int
) -> None:
    with executor(weights, budget, prefetch=prefetch, pin_layers=True, read_path="staged") as ex:
        p = ex.plan
        assert p.pinned == pinned and p.slots == slots and p.slot_bytes == L
        assert p.resident == ["embedding", "final norm and head", *(f"layer {i}" for i in pinned)]
        assert p.resident_bytes == EDGES + sum(SIZES[i] for i in pinned)
        assert p.resident_bytes + p.ring_bytes <= budget
        assert [g.label for g in p.streamed] == [f"layer {i}" for i in range(3) if i not in pinned]
        got = generate(ex, [[1, 2, 3]], 3).tokens
        n, reads = len(p.streamed), ex.stats.groups_read
        assert reads >= 3 * n and (reads == 0) == (n == 0)  # 3 passes: each streamed layer read at least 3 times
        assert ex.stats.bytes_read == sum(p.streamed[i % n].read_bytes for i in range(reads))
    with executor(weights, 1 << 20) as ex:
        assert generate(ex, [[1, 2, 3]], 3).tokens == got


# the tiny model at the tensor grain: parts [norm, q] [k] [v] [o, norm] [gate] [up] [down] per layer, each
# page-rounded (a tensor at an unaligned file offset spans one page more)
PART = 28672  # the largest part of a layer: gate, up or down (24 KiB of fp32)
PASS = 483328  # every layer part of a pass
ALL_PART = 4096 + 36864  # the largest part when everything streams: final norm and head (32 KiB)


@pytest.mark.parametrize(
    "budget, prefetch, resident, ring",
    [
        (1 << 20, None, True, PASS),  # plenty: edges resident, the ring holds a whole pass's parts
        (EDGES + 2 * PART, None, True, 2 * PART),  # edges + two of the largest part: one read ahead
        (EDGES + 3 * PART + 4095, None, True, 3 * PART),  # more: a bigger ring (page-rounded)
        (1 << 20, 0, True, PART),  # --prefetch 0: one part at a time, no overlap
        (EDGES + 2 * PART - 1, None, False, (EDGES + 2 * PART - 1) // 4096 * 4096),  # everything streams
        (ALL_PART, None, False, ALL_PART),  # exactly the largest part: no overlap, still runs
    ],
)
def test_tensor_grain_budget_plan(weights: Path, budget: int, prefetch: int | None, resident: bool, ring: int) -> None:
    with executor(weights, budget, prefetch=prefetch) as ex:
        p = ex.plan
        assert p.grain == "tensor" and bool(p.resident) == resident and p.ring_bytes == ring
        assert p.resident_bytes + p.ring_bytes <= budget and p.resident_bytes == (EDGES if resident else 0)
        assert len(p.units) == 3 * 7 + (0 if resident else 2)
        assert p.streamed_bytes_per_pass == sum(u.read_bytes for u in p.units)
        got = generate(ex, [[1, 2, 3]], 3)
    n, reads = len(p.units), ex.stats.groups_read  # once closed: the readers (running ahead) have stopped
    assert reads >= 3 * n and ex.stats.bytes_read == sum(p.units[i % n].read_bytes for i in range(reads))
    with executor(weights, 1 << 20, read_path="staged") as ex:
        assert generate(ex, [[1, 2, 3]], 3).tokens == got.tokens


def test_tensor_grain_pins_tensors_beside_the_ring_and_streams_the_rest(weights: Path) -> None:
    budget = EDGES + 2 * PART + 3 * PART + 20000  # --prefetch 1: a ring of two parts, room for about 3.7 more
    with executor(weights, budget, prefetch=1, pin_layers=True) as ex:
        p = ex.plan
        assert p.ring_bytes == 2 * PART and p.resident_bytes + p.ring_bytes <= budget and p.pinned == []
        pinned = set(p.pinned_tensors)
        assert len(pinned) >= 3 and all(n in ex.resident for n in pinned)
        held = {t.name: t.nbytes for u in p.units for t in u.tensors}  # streamed: not resident, each once a pass
        assert not pinned & set(held) and len(pinned) + len(held) == 3 * 9
        left = budget - p.resident_bytes - p.ring_bytes
        assert left < 4096  # no streamed tensor (each at least a page) fits in what is left
        assert p.streamed_bytes_per_pass < PASS - 3 * PART  # fewer bytes a pass than with only the edges resident
        got = generate(ex, [[1, 2, 3]], 3, keep_logits=True)
    assert ex.stats.bytes_read == sum(p.units[i % len(p.units)].read_bytes for i in range(ex.stats.groups_read))
    with executor(weights, 1 << 20, read_path="staged") as ex:
        want = generate(ex, [[1, 2, 3]], 3, keep_logits=True)
    assert got.tokens == want.tokens
    for a, b in zip(got.logits, want.logits):
        assert torch.equal(a, b)


def test_reads_continue_into_the_next_pass(weights: Path) -> None:
    with executor(weights, 1 << 20) as ex:
        generate(ex, [[1, 2, 3]], 4)  # 4 passes of 3 layers of 7 parts
        units = ex.plan.units
    stats = ex.stats  # once closed: the readers, running into the next pass, have stopped
    assert stats.groups_read >= 4 * len(units) == 4 * 21
    assert stats.bytes_read == sum(units[i % 21].read_bytes for i in range(stats.groups_read))
    assert 0.0 <= stats.hidden_fraction <= 1.0


def test_unaligned_and_many_piece_runs_load_byte_exact(tmp_path: Path) -> None:
    data = torch.randint(0, 256, (300_000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    f = tmp_path / "blob.bin"
    f.write_bytes(data.numpy().tobytes())
    want_a = data[4099 : 4099 + 4 * 1000]  # element-misaligned float32 at an odd file offset
    # a 2-d tensor whose rows come from two places of the file, out of order
    runs = tuple(Run(str(f), 200_000 + 40 * (9 - r), 40, 40 * r) for r in range(10))
    want_b = torch.cat([data[200_000 + 40 * (9 - r) : 200_000 + 40 * (10 - r)] for r in range(10)])
    want_c = data[300_000 - 4000 :]  # ends exactly at the file's end, mid-page
    src = WeightSource(
        str(tmp_path),
        {
            "a": TensorSource("a", "F32", (1000,), (Run(str(f), 4099, 4000, 0),)),
            "b": TensorSource("b", "F32", (10, 10), runs),
            "c": TensorSource("c", "U8", (4000,), (Run(str(f), 296_000, 4000, 0),)),
        },
        "test",
    )
    g = layout_group("g", ["a", "b", "c"], src, FileSizes())
    from aio import AioHandle

    buf = AlignedBuffer(g.nbytes)
    with AioHandle(READ_CONFIG) as io:
        load_group(io, g, buf)
    views = tensor_views(buf, g.tensors, torch.float32)
    assert torch.equal(views["a"].view(torch.uint8), want_a)
    assert torch.equal(views["b"].contiguous().view(torch.uint8).view(-1), want_b)
    assert torch.equal(views["c"], want_c)


def _cached_pages(path: Path) -> int:
    """Pages of ``path`` in the page cache (mincore(2) on a read-only mapping of it)."""
    import numpy as np

    size = path.stat().st_size
    with open(path, "rb") as fh:
        m = mmap.mmap(fh.fileno(), size, prot=mmap.PROT_READ)
    try:
        arr = np.frombuffer(m, dtype=np.uint8)  # its address, without touching (faulting in) any page
        vec = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
        libc = ctypes.CDLL(None, use_errno=True)
        rc = libc.mincore(ctypes.c_void_p(arr.ctypes.data), ctypes.c_size_t(size), vec)
        del arr
        assert rc == 0, os.strerror(ctypes.get_errno())
        return sum(v & 1 for v in vec)
    finally:
        m.close()


def test_weights_bypass_the_page_cache(weights: Path, tmp_path: Path) -> None:
    path = tmp_path / "cold"
    path.mkdir()
    for p in weights.iterdir():
        (path / p.name).write_bytes(p.read_bytes())
    data = path / "model.safetensors"
    fd = os.open(data, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if _cached_pages(data) > 2:
        pytest.skip("this file system keeps the file cached after DONTNEED")
    with executor(path, 1 << 20) as ex:
        generate(ex, [[1, 2, 3]], 3)
        assert ex.stats.bytes_read > 0
        assert isinstance(ex.handle, AioHandle)  # a local file: read through aio
        direct = ex.handle.config.use_direct
    if not direct:
        pytest.skip("O_DIRECT is off")
    # the header is read buffered (a few pages with read-ahead); weights go device -> ring buffer only
    cached = _cached_pages(data)
    with open(data, "rb") as fh:
        header_pages = -(-(8 + int.from_bytes(fh.read(8), "little")) // mmap.PAGESIZE)
    assert data.stat().st_size > 100 * mmap.PAGESIZE
    assert cached <= header_pages + 4, (cached, header_pages)  # the header's buffered read, and its read-ahead


def test_a_read_failure_reaches_the_compute_thread_naming_the_file(weights: Path, tmp_path: Path) -> None:
    path = tmp_path / "short"
    path.mkdir()
    for p in weights.iterdir():
        (path / p.name).write_bytes(p.read_bytes())
    with executor(path, LAYER, prefetch=0) as ex:  # one buffer: layer 1 is read only once layer 0 is done
        os.truncate(path / "model.safetensors", 100_000)
        with pytest.raises(OSError, match="model.safetensors"):
            generate(ex, [[1, 2, 3]], 2)
        with pytest.raises(InferenceError, match="stopped after an earlier error: .*model.safetensors"):
            generate(ex, [[1, 2, 3]], 2)
