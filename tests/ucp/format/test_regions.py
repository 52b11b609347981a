"""``ucp.format.regions`` with raw and numpy item buffers (the torch-free paths of ``ucp reshape``, ``export`` and
``convert``), against torch."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from reshard.box import Box, FlatRange
from ucp.format.regions import RawArray, copy_region


def _items(t: torch.Tensor) -> np.ndarray:
    """A tensor's elements as opaque numpy items (a copy)."""
    flat = t.contiguous().reshape(-1).view(torch.uint8).numpy().copy()
    return flat.view(np.dtype(f"V{t.element_size()}")).reshape(tuple(t.shape))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.float8_e4m3fn])
def test_box_and_flat_copies_match_torch(dtype: torch.dtype) -> None:
    shape = (6, 10)
    full = torch.arange(60).to(dtype).reshape(shape)
    src_region, dst_region = Box((0, 3), (6, 5)), Box((2, 0), (3, 10))  # a column block -> a row block
    src_t = full[:, 3:8].contiguous().reshape(-1)
    dst_t = torch.zeros(3, 10, dtype=dtype)
    n_t = copy_region(src_t, src_region, 0, dst_t, dst_region, shape)
    dst_n = np.zeros((3, 10), dtype=np.dtype(f"V{full.element_size()}"))
    n_n = copy_region(_items(src_t), src_region, 0, dst_n, dst_region, shape)
    assert n_t == n_n == 15
    assert dst_n.tobytes() == dst_t.view(torch.uint8).numpy().tobytes()
    # a flat range (ZeRO) into a row block, from a partial read starting mid-region (``first``)
    part = full.reshape(-1)[20:41].contiguous()  # elements 3.. of the stored FlatRange(17, 41)
    dst_t, dst_n = torch.zeros(3, 10, dtype=dtype), np.zeros((3, 10), dtype=np.dtype(f"V{full.element_size()}"))
    copy_region(part, FlatRange(17, 41), 3, dst_t, Box((2, 0), (3, 10)), shape)
    copy_region(_items(part), FlatRange(17, 41), 3, dst_n, Box((2, 0), (3, 10)), shape)
    assert dst_n.tobytes() == dst_t.view(torch.uint8).numpy().tobytes()
    assert torch.equal(dst_t.reshape(-1)[:21].view(torch.uint8), full.reshape(-1)[20:41].view(torch.uint8))


def test_zero_dim_tensor_is_copied_into_a_view() -> None:
    src = _items(torch.tensor(3.5).reshape(1))
    dst = np.zeros((), dtype=np.dtype("V4"))
    assert copy_region(src, Box((), ()), 0, dst, Box((), ()), ()) == 1
    assert dst.tobytes() == torch.tensor([3.5]).view(torch.uint8).numpy().tobytes()


def test_a_box_outside_the_source_buffer_is_refused() -> None:
    shape = (4, 4)
    src = np.zeros(8, dtype=np.dtype("V4"))  # holds elements 4..11 of the region
    dst = np.zeros((4, 4), dtype=np.dtype("V4"))
    with pytest.raises(ValueError, match="outside a buffer"):
        copy_region(src, Box((0, 0), shape), 4, dst, Box((0, 0), shape), shape)  # wants elements 0..15


def test_numpy_targets_of_another_item_size_are_refused(tmp_path) -> None:
    import ucp
    from ucp.errors import CheckpointError
    from ucp.loading.partial import Target, read_targets
    from ucp.store.reader import read_manifest
    from ucp.store.storage import open_storage

    ucp.save({"w": torch.arange(12, dtype=torch.float32)}, tmp_path / "ck")
    storage, name = open_storage(tmp_path / "ck")
    with storage:
        manifest = read_manifest(storage, name)
        wrong = Target("w", np.zeros(12, dtype=np.dtype("V2")), Box((0,), (12,)))
        with pytest.raises(CheckpointError, match="tensor 'w'.*2-byte items.*F32"):
            read_targets(storage, name, manifest, [wrong], verify=True)
        right = Target("w", np.zeros(12, dtype=np.dtype("V4")), Box((0,), (12,)))
        read_targets(storage, name, manifest, [right], verify=True)
    assert right.buffer.tobytes() == torch.arange(12, dtype=torch.float32).numpy().tobytes()


# -- RawArray: the same copies without numpy (reshape, export and convert move bytes through it) --


def _raw(t: torch.Tensor) -> RawArray:
    """A tensor's elements as a RawArray over a copy of its bytes."""
    data = bytearray(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return RawArray(memoryview(data), tuple(t.shape), t.element_size())


def _raw_zeros(shape: tuple[int, ...], item: int) -> RawArray:
    return RawArray(memoryview(bytearray(math.prod(shape) * item)), shape, item)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.float8_e4m3fn])
@pytest.mark.parametrize(
    ("shape", "src_region", "dst_region"),
    [
        ((6, 10), Box((0, 3), (6, 5)), Box((2, 0), (3, 10))),  # a column block -> a row block: rows one by one
        ((6, 10), Box((0, 0), (6, 10)), Box((2, 0), (3, 10))),  # whole rows: one run
        ((4, 3, 5), Box((1, 0, 0), (3, 3, 5)), Box((0, 1, 2), (4, 2, 3))),  # 3-d, a run per (i, j)
        ((200, 4), Box((0, 1), (200, 2)), Box((0, 0), (200, 4))),  # 200 short rows: numpy's strided copy
        ((6, 10), FlatRange(17, 41), Box((2, 0), (3, 10))),  # a ZeRO flat range -> a row block
        ((6, 10), Box((0, 0), (3, 10)), FlatRange(5, 50)),  # a row block -> a flat range
    ],
    ids=["cols-to-rows", "rows", "3d", "many-short-rows", "flat-to-box", "box-to-flat"],
)
def test_raw_arrays_copy_what_torch_copies(
    dtype: torch.dtype, shape: tuple[int, ...], src_region: Box | FlatRange, dst_region: Box | FlatRange
) -> None:
    full = torch.arange(math.prod(shape)).to(dtype).reshape(shape)
    flat = full.reshape(-1)

    def held(region: Box | FlatRange) -> torch.Tensor:
        if isinstance(region, FlatRange):
            return flat[region.start : region.stop].contiguous()
        return full[tuple(slice(o, o + n) for o, n in zip(region.offsets, region.shape))].contiguous()

    src = held(src_region).reshape(-1)
    dst_shape = (dst_region.stop - dst_region.start,) if isinstance(dst_region, FlatRange) else dst_region.shape
    dst_t = torch.zeros(dst_shape, dtype=dtype)
    dst_r = _raw_zeros(tuple(dst_shape), full.element_size())
    n_t = copy_region(src, src_region, 0, dst_t, dst_region, shape)
    n_r = copy_region(_raw(src), src_region, 0, dst_r, dst_region, shape)
    assert n_t == n_r > 0
    assert dst_r.tobytes() == dst_t.view(torch.uint8).numpy().tobytes()


def test_raw_copies_from_a_partial_read_and_of_a_0d_tensor() -> None:
    shape = (6, 10)
    full = torch.arange(60, dtype=torch.float32).reshape(shape)
    part = full.reshape(-1)[20:41].contiguous()  # elements 3.. of the stored FlatRange(17, 41)
    dst_t, dst_r = torch.zeros(3, 10), _raw_zeros((3, 10), 4)
    copy_region(part, FlatRange(17, 41), 3, dst_t, Box((2, 0), (3, 10)), shape)
    copy_region(_raw(part), FlatRange(17, 41), 3, dst_r, Box((2, 0), (3, 10)), shape)
    assert dst_r.tobytes() == dst_t.view(torch.uint8).numpy().tobytes()
    scalar = _raw_zeros((), 4)
    assert copy_region(_raw(torch.tensor([3.5])), Box((), ()), 0, scalar, Box((), ()), ()) == 1
    assert scalar.tobytes() == torch.tensor([3.5]).view(torch.uint8).numpy().tobytes()


def test_raw_copies_refuse_a_box_outside_the_source_and_mismatched_sizes() -> None:
    shape = (4, 4)
    with pytest.raises(ValueError, match="outside a buffer"):
        copy_region(_raw_zeros((8,), 4), Box((0, 0), shape), 4, _raw_zeros(shape, 4), Box((0, 0), shape), shape)
    with pytest.raises(ValueError, match=r"shape \[4, 4\] and 4-byte items needs 64 bytes, not 32"):
        RawArray(memoryview(bytearray(32)), (4, 4), 4)
    with pytest.raises(TypeError, match="same item size"):
        copy_region(_raw_zeros((16,), 2), Box((0, 0), shape), 0, _raw_zeros(shape, 4), Box((0, 0), shape), shape)


def test_raw_targets_are_read_and_refused_like_numpy_ones(tmp_path) -> None:
    import ucp
    from ucp.errors import CheckpointError
    from ucp.loading.partial import Target, read_targets
    from ucp.store.reader import read_manifest
    from ucp.store.storage import open_storage

    w = torch.arange(12, dtype=torch.float32)
    ucp.save({"w": w}, tmp_path / "ck")
    storage, name = open_storage(tmp_path / "ck")
    with storage:
        manifest = read_manifest(storage, name)
        with pytest.raises(CheckpointError, match="tensor 'w'.*raw target of 2-byte items.*F32"):
            read_targets(storage, name, manifest, [Target("w", _raw_zeros((12,), 2), Box((0,), (12,)))], verify=True)
        whole = Target("w", RawArray.empty((12,), 4), Box((0,), (12,)))
        read_targets(storage, name, manifest, [whole], verify=True)
    assert whole.buffer.tobytes() == w.numpy().tobytes()
