"""The ``ucp`` package resolves its public names lazily, and the console script exits cleanly and at once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from repo_paths import REPO

import ucp


def _python(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_importing_ucp_and_its_cli_does_not_import_torch() -> None:
    out = _python("import sys, ucp, ucp.cli.main; print('torch' in sys.modules)")
    assert out == "False"
    assert _python("import sys, ucp; ucp.save; print('torch' in sys.modules)") == "True"


def test_the_deepspeed_byte_copy_path_does_not_import_torch() -> None:
    """``ucp convert`` of a DeepSpeed checkpoint reads and copies it without torch in the usual case."""
    modules = (
        "ucp.conversion.importers, ucp.conversion.importers.deepspeed, ucp.conversion.importers.universal, ucp.conversion.importers.torch_archive, "
        "ucp.conversion.importers.write_stored"
    )
    assert _python(f"import sys, {modules}; print('torch' in sys.modules)") == "False"


def test_every_public_name_resolves() -> None:
    for name in ucp.__all__:
        assert getattr(ucp, name) is not None, name
    assert ucp.save.__module__ == "ucp.saving.sync_save" and ucp.read_manifest.__name__ == "read_checkpoint_manifest"
    assert set(ucp.__all__) <= set(dir(ucp))
    with pytest.raises(AttributeError, match="no attribute 'sav'"):
        ucp.sav  # type: ignore[attr-defined]  # noqa: B018 - the missing name is the point
    from ucp import CheckpointManager, verify  # from-imports go through the same lookup

    assert CheckpointManager.__name__ == "CheckpointManager" and callable(verify)


def _ucp(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ucp.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def test_console_script_flushes_output_and_keeps_exit_codes(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ucp.save({"w": torch.arange(10, dtype=torch.float32)}, ckpt, step=3)
    ok = _ucp("inspect", str(ckpt), "--json")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["step"] == 3  # the whole JSON document came out before the fast exit
    missing = _ucp("inspect", str(tmp_path / "nope"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    usage = _ucp("reshape")
    assert usage.returncode == 2 and "Missing argument" in usage.stderr


def _resident_fraction(path: Path) -> float:
    """Share of ``path``'s pages in the page cache (mincore over a read-only mapping)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = path.stat().st_size
    pages = -(-size // 4096)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
        assert addr not in (None, ctypes.c_void_p(-1).value)
        vec = ctypes.create_string_buffer(pages)
        assert libc.mincore(addr, size, vec) == 0
        libc.munmap(addr, size)
    finally:
        os.close(fd)
    return sum(b & 1 for b in vec.raw) / pages


def test_reshape_prefetches_its_source_and_stays_bit_exact(tmp_path: Path) -> None:
    """With the prefetch the source's pages end up cached (read buffered); without it they do not
    (O_DIRECT); both give the same checkpoint."""
    from aio import open_file
    from aio.tune import evict_file

    state: dict[str, Any] = {"a": torch.randn(300, 257), "b": torch.arange(1000, dtype=torch.int64), "step": 1}
    ucp.save(state, tmp_path / "src")
    data = tmp_path / "src" / "rank-00000.safetensors"
    with open_file(data, "r") as f:
        if not f.direct:
            pytest.skip("this file system refuses O_DIRECT: every read goes through the page cache")
    resident = {}
    for prefetch in ("0", "1"):
        assert evict_file(data) and _resident_fraction(data) == 0.0
        out = tmp_path / f"dst{prefetch}"
        done = subprocess.run(
            [sys.executable, "-m", "ucp.cli", "reshape", str(tmp_path / "src"), str(out), "--json", "--verify"],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO), "UCP_PREFETCH": prefetch},
        )
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["verified"] is True
        back = ucp.load(out)
        assert torch.equal(back["a"], state["a"]) and torch.equal(back["b"], state["b"])
        resident[prefetch] = _resident_fraction(data)
    assert resident == {"0": 0.0, "1": 1.0}


def test_reshape_runs_without_importing_torch(tmp_path: Path) -> None:
    """``ucp reshape`` moves bytes with numpy only: no torch import (~1.5-2 s) before it can start."""
    w = torch.randn(64, 33)
    state: dict[str, Any] = {
        "w": ucp.Shards(
            [
                ucp.ShardedTensor(w[:, :20].contiguous(), (64, 33), (0, 0)),  # column blocks:
                ucp.ShardedTensor(w[:, 20:].contiguous(), (64, 33), (0, 20)),
            ]
        ),  # staged box copies
        "e": torch.randn(10, 7).to(torch.bfloat16),
        "s": torch.tensor(2.5),
    }
    ucp.save(state, tmp_path / "src")
    probe = (
        "import sys\n"
        "from ucp.cli.main import app\n"
        f"sys.argv = ['ucp', 'reshape', {str(tmp_path / 'src')!r}, {str(tmp_path / 'dst')!r}, '--json']\n"
        "try:\n    app(prog_name='ucp')\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "print('torch imported:', 'torch' in sys.modules)\n"
    )
    out = _python(probe)
    assert out.endswith("torch imported: False"), out
    back = ucp.load(tmp_path / "dst")
    assert torch.equal(back["w"], w) and torch.equal(back["e"], state["e"]) and torch.equal(back["s"], state["s"])
    assert len(ucp.read_manifest(tmp_path / "dst").tensors["w"].pieces) == 1  # consolidated from two column blocks


@pytest.mark.parametrize("entry", [["-m", "ucp.cli"], ["-m", "ucp.cli.main"]])
def test_every_way_of_starting_the_command_line_works(entry: list[str]) -> None:
    """``python -m ucp.cli.main`` (what the benchmark tools run) must not depend on the console script's import."""
    done = subprocess.run(
        [sys.executable, *entry, "ls", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stderr
    assert "Usage" in done.stdout
