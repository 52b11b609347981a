"""Writes straight from the caller's memory where it lines up with the file, and the shared handle."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from aio import AioConfig, AioHandle, AlignedBuffer, shared_handle
from aio.buffers import address_of

MIB = 1 << 20


def _record_submits(
    io: AioHandle, monkeypatch: pytest.MonkeyPatch, method: str = "submit_write"
) -> list[tuple[int, int]]:
    """Wrap the engine's ``method`` (submit_write / submit_read; reads also submit_readv, whose buffers are
    recorded one by one) to record (buffer address, length) of every buffer a request moves."""
    seen: list[tuple[int, int]] = []
    original = getattr(io.engine, method)

    def spy(f, offset, buf, future=None):
        seen.append((address_of(buf), buf.nbytes))
        return original(f, offset, buf, future)

    monkeypatch.setattr(io.engine, method, spy)
    if method == "submit_read":
        original_v = io.engine.submit_readv

        def spy_v(f, offset, buffers, future=None):
            seen.extend((address_of(b), b.nbytes) for b in buffers)
            return original_v(f, offset, buffers, future)

        monkeypatch.setattr(io.engine, "submit_readv", spy_v)
    return seen


@pytest.mark.parametrize("shift", [0, 1, 100, 4095])
@pytest.mark.parametrize("borrow", [False, True])
def test_congruent_memory_is_written_without_copy(
    disk_dir: Path, engine: str, shift: int, borrow: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A source whose address ≡ file position (mod 4096) is written from its own memory, bit-exact."""
    cfg = AioConfig(engine=engine, block_size=1 * MIB, queue_depth=4)
    src = AlignedBuffer(6 * MIB + 8192)
    src.numpy()[:] = np.random.default_rng(shift).integers(0, 256, src.nbytes, dtype=np.uint8)
    prefix = np.arange(shift, dtype=np.uint8)  # puts the file position at `shift`
    body = src.view(5 * MIB + 333, shift)  # address ≡ shift (mod 4096): congruent
    lo, hi = src.address, src.address + src.capacity
    with AioHandle(cfg) as io:
        seen = _record_submits(io, monkeypatch)
        path = disk_dir / "zc.bin"
        with io.writer(path, size_hint=shift + body.nbytes) as w:
            assert w.direct
            w.write(prefix)
            w.write(body, borrow=borrow)
        from_source = sum(n for addr, n in seen if lo <= addr < hi)
        assert from_source >= 5 * MIB - 4096  # all but the unaligned head and tail
        assert path.read_bytes() == prefix.tobytes() + bytes(body)


def test_incongruent_memory_is_staged(disk_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = AlignedBuffer(3 * MIB)
    src.numpy()[:] = 7
    with AioHandle(AioConfig(block_size=1 * MIB)) as io:
        seen = _record_submits(io, monkeypatch)
        io.write_file(disk_dir / "st.bin", src.view(2 * MIB, 5))  # file position 0, address ≡ 5
        assert not any(src.address <= addr < src.address + src.capacity for addr, _ in seen)
    assert (disk_dir / "st.bin").read_bytes() == bytes(src.view(2 * MIB, 5))


def test_shared_handle_is_one_per_config() -> None:
    a = shared_handle()
    assert a is shared_handle(AioConfig())
    b = shared_handle(AioConfig(queue_depth=3))
    assert b is not a and b.config.queue_depth == 3


@pytest.mark.parametrize("shift", [1, 64, 4095])
def test_congruent_memory_is_read_into_without_copy(
    disk_dir: Path, engine: str, shift: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A destination whose address ≡ file offset (mod 4096) gets all but its head and tail read straight in."""
    data = np.random.default_rng(shift).integers(0, 256, 6 * MIB, dtype=np.uint8)
    path = disk_dir / "rd.bin"
    path.write_bytes(data.tobytes())
    dest = AlignedBuffer(6 * MIB)
    lo, hi = dest.address, dest.address + dest.capacity
    n = 5 * MIB + 333
    with AioHandle(AioConfig(engine=engine, block_size=1 * MIB, queue_depth=4)) as io:
        seen = _record_submits(io, monkeypatch, "submit_read")
        io.read_into(path, shift, dest.view(n, shift))  # offset `shift`, address ≡ shift: congruent
        into_dest = sum(k for addr, k in seen if lo <= addr < hi)
    assert into_dest >= n - 2 * 4096
    assert bytes(dest.view(n, shift)) == data[shift : shift + n].tobytes()
    assert bytes(dest.view(shift)) == bytes(shift)  # nothing written before the destination ...
    assert not any(dest.view(dest.capacity - shift - n, shift + n))  # ... or after it


def test_congruent_read_past_the_end_of_file_fails(disk_dir: Path, engine: str) -> None:
    path = disk_dir / "short.bin"
    path.write_bytes(bytes(range(256)) * 40)  # 10240 bytes
    dest = AlignedBuffer(3 * 4096)
    with AioHandle(AioConfig(engine=engine, block_size=1 * MIB)) as io:
        with pytest.raises(OSError, match="short.bin"):
            io.read_into(path, 100, dest.view(3 * 4096 - 200, 100))  # in phase, ends past the file
        io.read_into(path, 100, dest.view(10_000, 100))  # in phase, inside the file
    assert bytes(dest.view(10_000, 100)) == path.read_bytes()[100:10_100]
