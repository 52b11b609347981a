"""A ``.pt`` zip whose members inflate far beyond the archive (a zip bomb: deflated zeros) is refused
by ``ucp convert`` before anything is inflated, with an error naming the archive and the member, and
without the reader's memory growing by the inflated size."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch

from ucp.conversion.importers import ForeignCheckpointError
from ucp.conversion.importers.pickles import load_torch
from ucp.conversion.importers.torch_archive import read_archive

BOMB_BYTES = 512 << 20  # inflated size of the bomb's data.pkl; the archive itself is ~0.5 MB


def _zip_bomb(path: Path, member: str = "archive/data.pkl", nbytes: int = BOMB_BYTES) -> None:
    """A zip shaped like a torch.save archive whose ``member`` is ``nbytes`` of deflated zeros."""
    chunk = bytes(16 << 20)
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
        zf.writestr(zipfile.ZipInfo("archive/byteorder"), "little", compress_type=zipfile.ZIP_STORED)
        info = zipfile.ZipInfo(member)
        info.compress_type = zipfile.ZIP_DEFLATED
        with zf.open(info, "w", force_zip64=True) as fh:
            for _ in range(nbytes // len(chunk)):
                fh.write(chunk)


def _deepspeed_root(root: Path) -> Path:
    root.mkdir()
    _zip_bomb(root / "mp_rank_00_model_states.pt")
    torch.save({"optimizer_state_dict": {"zero_stage": 1}}, root / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    return root


@pytest.fixture(scope="module")
def deepspeed_bomb(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _deepspeed_root(tmp_path_factory.mktemp("bomb") / "ds")


def test_convert_refuses_the_bomb_without_inflating_it(deepspeed_bomb: Path, tmp_path: Path) -> None:
    archive = deepspeed_bomb / "mp_rank_00_model_states.pt"
    assert archive.stat().st_size < 4 << 20
    script = textwrap.dedent(
        f"""
        import json, resource, sys
        from ucp.conversion.importers import convert, ForeignCheckpointError
        import torch  # everything the conversion imports is in before the baseline
        import ucp.conversion.importers.deepspeed, ucp.conversion.importers.pickles
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            convert({str(deepspeed_bomb)!r}, {str(tmp_path / "out")!r})
            error = None
        except ForeignCheckpointError as exc:
            error = str(exc)
        except Exception as exc:
            error = "other " + type(exc).__name__ + ": " + str(exc)
        grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024
        print(json.dumps({{"error": error, "grown": grown}}))
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    error = result["error"]
    assert result["grown"] < 300 << 20, f"peak RSS grew by {result['grown'] / 2**20:.0f} MiB"
    assert error is not None and not error.startswith("other"), error
    assert str(archive) in error and "archive/data.pkl" in error and "zip bomb" in error
    assert not (tmp_path / "out").exists()


def test_both_readers_refuse_an_inflating_member(tmp_path: Path) -> None:
    bomb = tmp_path / "bomb.pt"
    _zip_bomb(bomb, "archive/data/0", 64 << 20)  # a storage member this time, over 4x the archive + 16 MiB
    with zipfile.ZipFile(bomb, "a") as zf:
        zf.writestr("archive/data.pkl", b"\x80\x02}q\x00.")  # an empty dict
    for reader in (read_archive, load_torch):
        with pytest.raises(ForeignCheckpointError, match="zip bomb") as info:
            reader(bomb)
        assert "archive/data/0" in str(info.value) and str(bomb) in str(info.value)


def test_a_stored_member_declaring_more_than_it_holds_is_refused(tmp_path: Path) -> None:
    good = tmp_path / "good.pt"
    torch.save({"w": torch.arange(4.0)}, good)
    with zipfile.ZipFile(good) as zf:
        assert all(i.compress_type == zipfile.ZIP_STORED for i in zf.infolist())
    assert torch.equal(load_torch(good)["w"], torch.arange(4.0))  # a real archive passes the bound
    data = bytearray(good.read_bytes())
    with zipfile.ZipFile(good) as zf:
        info = next(i for i in zf.infolist() if i.filename.endswith("data.pkl"))
    # patch the central directory entry of data.pkl: uncompressed size (offset 24) grows to 1 GiB
    pos = 0
    while True:
        pos = data.find(b"PK\x01\x02", pos)
        assert pos >= 0
        name_len = int.from_bytes(data[pos + 28 : pos + 30], "little")
        if data[pos + 46 : pos + 46 + name_len].decode() == info.filename:
            break
        pos += 4
    data[pos + 24 : pos + 28] = (1 << 30).to_bytes(4, "little")
    bad = tmp_path / "bad.pt"
    bad.write_bytes(bytes(data))
    with pytest.raises(ForeignCheckpointError, match="declares 1073741824 bytes") as info_:
        load_torch(bad)
    assert info.filename in str(info_.value)
