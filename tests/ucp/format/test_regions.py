"""``ucp.format.regions`` with numpy item buffers (the torch-free path of ``ucp reshape``), against torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from reshard.box import Box, FlatRange
from ucp.format.regions import copy_region


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
