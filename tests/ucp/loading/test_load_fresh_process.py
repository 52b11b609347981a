"""Full loads (``state = ucp.load(path)``) the way a user's first call makes them: in a fresh process,
into memory faulted in ahead of the reads (ucp.store.reader.FileBuffer.populate), every dtype
bit-exact, and the tensors returned never sharing memory with another load's."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import crc32c
import pytest
import torch
from repo_paths import REPO
from ucp_helpers import random_tensor, same_bytes

import ucp
import ucp.store.reader as reader
from ucp.format.dtypes import _TABLE

# Every dtype the format knows, large enough (with the big one) that the file is populated ahead.
DTYPES = [getattr(torch, attr) for _, attr in _TABLE.values() if hasattr(torch, attr)]


def _state() -> dict[str, Any]:
    state: dict[str, Any] = {
        f"t.{str(dt).removeprefix('torch.')}": random_tensor(dt, (37, 129), seed=i) for i, dt in enumerate(DTYPES)
    }
    state["big"] = random_tensor(torch.float32, (3 << 20,), seed=99)  # 12 MiB: several populate chunks
    state["scalar"] = random_tensor(torch.int64, (), seed=100)
    state["empty"] = torch.empty(0, 3, dtype=torch.bfloat16)
    state["meta"] = {"step": 3}
    return state


def _digest(t: torch.Tensor) -> list[Any]:
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    return [str(t.dtype), list(t.shape), crc32c.crc32c(raw.numpy().data) if raw.numel() else 0]


CHILD = """
import json, sys, crc32c, torch, ucp
state = ucp.load(sys.argv[1])
def digest(t):
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    return [str(t.dtype), list(t.shape), crc32c.crc32c(raw.numpy().data) if raw.numel() else 0]
print(json.dumps({k: digest(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}))
"""


def test_a_fresh_process_loads_every_dtype_bit_exact(tmp_path: Path) -> None:
    state = _state()
    assert state["big"].nbytes >= 2 * reader.POPULATE_MIN_BYTES
    ucp.save(state, tmp_path / "ck")
    res = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path / "ck")], capture_output=True, text=True, cwd=REPO, timeout=300
    )
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout.strip().splitlines()[-1])
    want = {k: _digest(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    assert got == want


def test_a_fresh_process_loads_a_sharded_checkpoint_bit_exact(tmp_path: Path) -> None:
    """Tensors split across four rank files (ZeRO-3 flat ranges) are read into whole tensors of their own."""
    from reshard import plain_layout
    from ucp.conversion.reshape import reshape

    state = _state()
    ucp.save(state, tmp_path / "ck")
    reshape(tmp_path / "ck", tmp_path / "z3", layout=plain_layout(4, 3))
    m = ucp.read_manifest(tmp_path / "z3")
    assert len(m.tensors["big"].pieces) == 4 and len(m.files) == 4
    res = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path / "z3")], capture_output=True, text=True, cwd=REPO, timeout=300
    )
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got == {k: _digest(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    a, b = ucp.load(tmp_path / "z3"), ucp.load(tmp_path / "z3")
    big = a["big"].untyped_storage()
    assert big.nbytes() == state["big"].nbytes  # its own memory, not a slice of a shared arena
    a["big"].fill_(1.0)
    assert same_bytes(b["big"], state["big"])


def test_a_damaged_piece_of_a_sharded_checkpoint_is_named(tmp_path: Path) -> None:
    """The sharded full-load path checks every piece's CRC as the whole-file path does."""
    from reshard import plain_layout
    from ucp.conversion.reshape import reshape

    ucp.save(_state(), tmp_path / "ck")
    reshape(tmp_path / "ck", tmp_path / "z3", layout=plain_layout(4, 3))
    piece = ucp.read_manifest(tmp_path / "z3").tensors["big"].pieces[2]
    with open(tmp_path / "z3" / piece.file, "r+b") as f:
        f.seek(piece.offset + 12345)
        byte = f.read(1)
        f.seek(piece.offset + 12345)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ucp.CorruptCheckpointError, match="big") as info:
        ucp.load(tmp_path / "z3")
    assert piece.file in str(info.value)


def test_reads_go_into_pages_already_faulted_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every read request of a whole-file load is submitted only after its range was populated."""
    ucp.save(_state(), tmp_path / "ck")
    populated: list[int] = []
    reads: list[tuple[int, int, int]] = []  # (offset, end, populated end when submitted)
    ready = reader.FileBuffer.ready

    def spy_ready(self: reader.FileBuffer, end: int) -> None:
        ready(self, end)
        populated.append(end)

    monkeypatch.setattr(reader.FileBuffer, "ready", spy_ready)
    original = reader.stream_file

    def spy_stream(storage: Any, rel: str, size: int, **kw: Any) -> Any:
        read_into = storage.read_into

        def recording(rel_: str, offset: int, dest: memoryview) -> None:
            reads.append((offset, offset + dest.nbytes, max(populated, default=0)))
            read_into(rel_, offset, dest)

        monkeypatch.setattr(storage, "read_into", recording)
        return original(storage, rel, size, **{**kw, "segment": 1 << 20})  # many requests per file

    monkeypatch.setattr(reader, "stream_file", spy_stream)
    got = ucp.load(tmp_path / "ck")
    assert same_bytes(got["big"], _state()["big"])
    assert len(reads) > 10 and all(end <= done for _, end, done in reads), reads


def _storage_span(t: torch.Tensor) -> tuple[int, int]:
    start = t.untyped_storage().data_ptr()
    return start, start + t.untyped_storage().nbytes()


def test_two_loads_share_no_memory(tmp_path: Path) -> None:
    """Load twice, mutate one: the other is unchanged; drop the first, load again: the second is unchanged."""
    state = _state()
    ucp.save(state, tmp_path / "ck")
    a, b = ucp.load(tmp_path / "ck"), ucp.load(tmp_path / "ck")
    tensors = [k for k, v in state.items() if isinstance(v, torch.Tensor) and v.numel()]
    spans_a = [_storage_span(a[k]) for k in tensors]
    for k in tensors:
        lo, hi = _storage_span(b[k])
        assert all(hi <= s or lo >= e for s, e in spans_a), f"{k}: the second load's memory overlaps the first's"
    for k in tensors:
        a[k].reshape(-1).view(torch.uint8).fill_(0xA5)
    for k in tensors:
        assert same_bytes(b[k], state[k]), k
    del a
    c = ucp.load(tmp_path / "ck")
    for k in tensors:
        c[k].reshape(-1).view(torch.uint8).bitwise_not_()
        assert same_bytes(b[k], state[k]), k
        assert not same_bytes(c[k], state[k]) or math.prod(c[k].shape) == 0, k


def test_without_populate_support_loads_still_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel without MADV_POPULATE_WRITE: the populator does nothing and the reads fault pages in."""
    import aio.populate as populate

    monkeypatch.setattr(populate, "_unsupported", True)
    state = _state()
    ucp.save(state, tmp_path / "ck")
    got = ucp.load(tmp_path / "ck")
    for k, v in state.items():
        assert same_bytes(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v, k
