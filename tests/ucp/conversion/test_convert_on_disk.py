"""``ucp convert`` of DeepSpeed checkpoints through the torch-free on-disk path (byte ranges copied).

The on-disk conversion must give exactly what the torch path gives (same manifest state tree,
metadata, step, tensor names, dtypes, shapes, and bit-exact bytes), take the on-disk path wherever
it can (and not import torch there), fall back to torch where it cannot, and fail like the torch
path does: UnsafePickleError for a global outside the allow-list, ForeignCheckpointError naming a
damaged file, no partial checkpoint after a failed write, the source never touched.

Uses real DeepSpeed checkpoints, built on first use (tests/support/peer_checkpoints.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import signal
import struct
import subprocess
import sys
import zipfile
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import torch
from peer_checkpoints import CI_CONFIGS, config_id, deepspeed_checkpoint, deepspeed_universal  # noqa: E402
from repo_paths import REPO  # noqa: E402
from ucp_helpers import assert_same_state  # noqa: E402

import ucp  # noqa: E402
import ucp.conversion.importers.deepspeed as ds  # noqa: E402
from ucp.conversion.importers import ForeignCheckpointError, UnsafePickleError, convert, read  # noqa: E402
from ucp.conversion.importers.common import count_stored  # noqa: E402
from ucp.format.sharding import Shards  # noqa: E402

PY = sys.executable


def harness(ckpt: Path) -> dict[str, Any]:
    return json.loads((ckpt / "harness.json").read_text())


def find(stage: int, dtype: str, world: int | None = None) -> Path:
    """A real DeepSpeed checkpoint of that stage and dtype, built on first use (tests/support/peer_checkpoints.py)."""
    return deepspeed_checkpoint(stage, dtype, world)


def tag_of(ckpt: Path) -> Path:
    return ckpt / (ckpt / "latest").read_text().strip()


def copy_ckpt(ckpt: Path, dst: Path) -> Path:
    """A copy of the root's `latest` and current tag folder (small checkpoints only)."""
    dst.mkdir()
    shutil.copy2(ckpt / "latest", dst / "latest")
    shutil.copytree(tag_of(ckpt), dst / tag_of(ckpt).name)
    return dst


def digest(folder: Path) -> dict[str, tuple[str, int]]:
    """Every file under ``folder``: content hash and mtime."""
    return {
        str(f.relative_to(folder)): (hashlib.sha256(f.read_bytes()).hexdigest(), f.stat().st_mtime_ns)
        for f in sorted(folder.rglob("*"))
        if f.is_file()
    }


def tensor_leaves(state: Any) -> int:
    if isinstance(state, dict):
        return sum(tensor_leaves(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(tensor_leaves(v) for v in state)
    return 1 if isinstance(state, (torch.Tensor, Shards)) else 0


def convert_with_torch(monkeypatch: pytest.MonkeyPatch, src: Path, dst: Path, **kw: Any) -> Any:
    """convert() with the DeepSpeed reader forced onto the torch path (ucp.save writes it)."""
    real = ds.read_deepspeed

    def torch_only(*args: Any, **kwargs: Any) -> Any:
        kwargs["on_disk"] = False
        return real(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(ds, "read_deepspeed", torch_only)
        return convert(src, dst, **kw)


# -- zip surgery (a DeepSpeed file with an extra pickled value) ------------------------------------


def members_of(path: Path) -> list[tuple[str, bytes]]:
    with zipfile.ZipFile(path) as zf:
        return [(i.filename, zf.read(i)) for i in zf.infolist()]


def write_zip(path: Path, members: list[tuple[str, bytes]]) -> None:
    """Uncompressed members whose data start at multiples of 64 (as torch writes them)."""
    with open(path, "wb") as fh, zipfile.ZipFile(fh, "w") as zf:
        for name, data in members:
            info = zipfile.ZipInfo(name, date_time=(2024, 1, 1, 0, 0, 0))
            pad = (-(fh.tell() + 30 + len(name.encode()) + 4)) % 64
            info.extra = struct.pack("<HH", 0x4246, pad) + b"Z" * pad
            zf.writestr(info, data)


def add_top_level_value(path: Path, key: str, value: Any) -> None:
    """Rewrite a torch.save archive of a dict so that it also holds ``key: value`` (pickled as is)."""
    members = members_of(path)
    out = []
    for name, data in members:
        if name.endswith("/data.pkl"):
            assert data.endswith(b".")
            body = pickle.dumps(key, 2)[2:-1] + pickle.dumps(value, 2)[2:-1]  # no PROTO, no STOP
            data = data[:-1] + body + b"s."  # SETITEM into the top-level dict, STOP
        out.append((name, data))
    path.unlink()
    write_zip(path, out)


# -- 3. the on-disk conversion equals the torch one ----------------------------------------------------


@pytest.mark.parametrize("config", CI_CONFIGS, ids=config_id)
def test_on_disk_convert_equals_torch_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, config: tuple[int, str, int]
) -> None:
    ckpt = find(*config)
    h = harness(ckpt)
    before = digest(tag_of(ckpt))
    _, on_disk = read(ckpt, on_disk=True)
    _, with_torch = read(ckpt, on_disk=False)
    tensors = tensor_leaves(with_torch.state)
    assert tensors > 0 and count_stored(with_torch.state) == 0
    if h["zero_stage"] == 3 and h["dtype"] != "fp32":  # ZeRO-3 weights are cast from the fp32 masters: torch
        assert count_stored(on_disk.state) == 0 and tensor_leaves(on_disk.state) == tensors
    else:
        assert count_stored(on_disk.state) == tensors and tensor_leaves(on_disk.state) == 0

    a, b = tmp_path / "on-disk", tmp_path / "torch"
    ra = convert(ckpt, a)
    rb = convert_with_torch(monkeypatch, ckpt, b)
    ma, mb = ucp.read_manifest(a), ucp.read_manifest(b)
    assert ma.state == mb.state
    assert ma.metadata == mb.metadata
    assert ma.step == mb.step == ra.step == rb.step == h["steps"]
    assert {n: (e.dtype, list(e.shape)) for n, e in ma.tensors.items()} == {
        n: (e.dtype, list(e.shape)) for n, e in mb.tensors.items()
    }
    assert ra.tensors == rb.tensors == len(mb.tensors) and ra.format == rb.format == "deepspeed"
    assert ma.topology.world_size == mb.topology.world_size == 1
    report = ucp.verify(a)
    assert report.ok and report.tensors == len(ma.tensors), report.problems
    assert_same_state(ucp.load(a), ucp.load(b))
    assert digest(tag_of(ckpt)) == before  # the source is only read


@pytest.mark.parametrize("config", [(2, "fp32", 2), (3, "bf16", 4)], ids=config_id)
def test_universal_on_disk_convert_equals_torch_path(tmp_path: Path, config: tuple[int, str, int]) -> None:
    """ds_to_universal's per-parameter files take the same two paths (ZeRO-3 bf16: torch, for the cast)."""
    udir = deepspeed_universal(*config)
    h = harness(find(*config))
    _, on_disk = read(udir, on_disk=True)
    _, with_torch = read(udir)
    tensors = tensor_leaves(with_torch.state)
    cast = h["zero_stage"] == 3 and h["dtype"] != "fp32"
    assert count_stored(on_disk.state) == (0 if cast else tensors)
    report = convert(udir, tmp_path / "on-disk")
    ucp.save(with_torch.state, tmp_path / "torch", step=with_torch.step, metadata=with_torch.metadata)
    ma, mb = ucp.read_manifest(tmp_path / "on-disk"), ucp.read_manifest(tmp_path / "torch")
    assert report.format == "deepspeed-universal"
    assert (ma.state, ma.metadata, ma.step) == (mb.state, mb.metadata, mb.step)
    assert ucp.verify(tmp_path / "on-disk").ok
    assert_same_state(ucp.load(tmp_path / "on-disk"), ucp.load(tmp_path / "torch"))


def test_cli_convert_and_verify(tmp_path: Path) -> None:
    ckpt = find(1, "bf16")
    dst = tmp_path / "cli"
    run = subprocess.run(
        [PY, "-m", "ucp.cli", "convert", str(ckpt), str(dst), "--json"], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["format"] == "deepspeed" and report["tensors"] == len(ucp.read_manifest(dst).tensors)
    verify = subprocess.run([PY, "-m", "ucp.cli", "verify", str(dst)], capture_output=True, text=True, timeout=120)
    assert verify.returncode == 0, verify.stdout + verify.stderr


NO_TORCH = """
import sys
from ucp.conversion.importers import convert
report = convert(sys.argv[1], sys.argv[2])
print(report.tensors, 'torch' in sys.modules)
"""


@pytest.mark.parametrize(
    "config", [(2, "fp32"), (1, "bf16"), (3, "fp32"), (3, "bf16")], ids=["z2-fp32", "z1-bf16", "z3-fp32", "z3-bf16"]
)
def test_on_disk_convert_does_not_import_torch(tmp_path: Path, config: tuple) -> None:
    stage, dtype = config
    ckpt = find(stage, dtype)
    run = subprocess.run(
        [PY, "-c", NO_TORCH, str(ckpt), str(tmp_path / "out")], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert run.returncode == 0, run.stderr
    tensors, imported = run.stdout.split()
    expect_torch = stage == 3 and dtype == "bf16"  # the cast of the masters to bf16 weights needs torch
    assert imported == str(expect_torch), run.stdout
    assert int(tensors) == len(ucp.read_manifest(tmp_path / "out").tensors)
    assert ucp.verify(tmp_path / "out").ok


def test_cli_convert_does_not_import_torch(tmp_path: Path) -> None:
    ckpt = find(2, "fp32")
    run = subprocess.run(
        [PY, "-X", "importtime", "-m", "ucp.cli", "convert", str(ckpt), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    modules = [line.rsplit("|", 1)[-1].strip() for line in run.stderr.splitlines() if line.startswith("import time:")]
    assert "numpy" in modules  # importtime works here
    assert "torch" not in modules


def test_relative_source_and_destination(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = copy_ckpt(find(2, "fp32"), tmp_path / "src")
    monkeypatch.chdir(tmp_path)
    convert("src", "out")
    monkeypatch.chdir(tmp_path / "src")
    convert(".", "../out2")
    assert ucp.verify(tmp_path / "out").ok and ucp.verify(tmp_path / "out2").ok
    assert_same_state(ucp.load(tmp_path / "out"), ucp.load(tmp_path / "out2"))
    assert ucp.read_manifest(tmp_path / "out").metadata["source"]["path"] == str(tag_of(src).resolve())


def test_tag_folder_given_directly_and_url_destination(tmp_path: Path) -> None:
    ckpt = find(2, "fp32", 2)
    convert(tag_of(ckpt), tmp_path / "from-tag")
    convert(ckpt, tmp_path / "from-root")
    assert_same_state(ucp.load(tmp_path / "from-tag"), ucp.load(tmp_path / "from-root"))
    url = f"memory://ucp-test-convert-{os.getpid()}/ckpt"
    try:
        convert(ckpt, url)
        assert ucp.verify(url).ok
        assert_same_state(ucp.load(url), ucp.load(tmp_path / "from-root"))
    finally:
        import fsspec

        fs = fsspec.filesystem("memory")
        if fs.exists(url):
            fs.rm(url, recursive=True)


def test_progress_reaches_total(tmp_path: Path) -> None:
    calls: list[tuple[int, int, str]] = []
    convert(find(2, "fp32"), tmp_path / "out", progress=lambda d, t, w: calls.append((d, t, w)))
    writes = [c for c in calls if c[1] > 100]  # the write phase counts bytes
    assert writes and writes[-1][0] == writes[-1][1]
    assert all(x[0] <= y[0] for x, y in zip(writes, writes[1:]))


# -- 4. fallbacks and failures -----------------------------------------------------------------------


def test_unknown_global_in_optim_file_is_unsafe(tmp_path: Path) -> None:
    src = copy_ckpt(find(2, "fp32", 2), tmp_path / "src")
    optim = tag_of(src) / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    add_top_level_value(optim, "extra", Fraction(1, 3))
    with pytest.raises(UnsafePickleError) as info:
        convert(src, tmp_path / "out")
    assert "fractions.Fraction" in str(info.value) and info.value.file == str(optim)
    assert "fractions.Fraction" in info.value.globals
    assert not (tmp_path / "out").exists()


def test_unknown_global_with_trust_pickle_converts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = find(2, "fp32", 2)
    src = copy_ckpt(ckpt, tmp_path / "src")
    optim = tag_of(src) / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    add_top_level_value(optim, "extra", Fraction(1, 3))
    report = convert(src, tmp_path / "trusted", trust_pickle=True)
    convert(ckpt, tmp_path / "clean")
    assert report.tensors == len(ucp.read_manifest(tmp_path / "clean").tensors)
    assert_same_state(ucp.load(tmp_path / "trusted"), ucp.load(tmp_path / "clean"))
    ma, mb = ucp.read_manifest(tmp_path / "trusted"), ucp.read_manifest(tmp_path / "clean")
    assert ma.state == mb.state
    sa, sb = dict(ma.metadata["source"]), dict(mb.metadata["source"])
    assert sa.pop("path") != sb.pop("path") and sa == sb


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "no-storage"])
def test_damaged_file_names_the_file(tmp_path: Path, damage: str) -> None:
    src = copy_ckpt(find(2, "fp32", 2), tmp_path / "src")
    bad = tag_of(src) / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    data = bad.read_bytes()
    if damage == "truncated":
        bad.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        bad.write_bytes(os.urandom(4096))
    elif damage == "empty":
        bad.write_bytes(b"")
    else:
        write_zip(bad, [(n, d) for n, d in members_of(bad) if "/data/" not in n])
    with pytest.raises(ForeignCheckpointError) as info:
        convert(src, tmp_path / "out")
    assert info.value.file == str(bad) and str(bad) in str(info.value)
    assert not (tmp_path / "out").exists()


def build_on_first_storage(path: Path, state: dict) -> None:
    """Rewrite a torch.save archive so that its pickle BUILDs ``state`` onto the first storage it loads
    (torch's weights_only unpickler allows that on its storage objects: harmless attributes there)."""
    import pickletools

    out = []
    for name, data in members_of(path):
        if name.endswith("/data.pkl"):
            pos = next(p for op, _, p in pickletools.genops(data) if op.name == "BINPERSID")
            assert pos is not None  # genops gives positions when reading bytes
            pos += 1
            body = b"}" + b"".join(pickle.dumps(k, 2)[2:-1] + pickle.dumps(v, 2)[2:-1] + b"s" for k, v in state.items())
            data = data[:pos] + body + b"b" + data[pos:]
        out.append((name, data))
    path.unlink()
    write_zip(path, out)


def test_crafted_archive_cannot_copy_another_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = copy_ckpt(find(2, "fp32", 2), tmp_path / "src")
    secret = tmp_path / "secret" / "id_rsa"
    secret.parent.mkdir()
    secret.write_bytes(b"SECRET!!" * (1 << 17))  # 1 MiB, larger than the first weight
    build_on_first_storage(tag_of(src) / "mp_rank_00_model_states.pt", {"file": str(secret), "offset": 0})
    try:
        convert(src, tmp_path / "on-disk")
    except ForeignCheckpointError:
        return  # refused: fine
    convert_with_torch(monkeypatch, src, tmp_path / "torch")
    assert_same_state(ucp.load(tmp_path / "on-disk"), ucp.load(tmp_path / "torch"))


def test_pickle_crc_mismatch_fails_cleanly(tmp_path: Path) -> None:
    src = copy_ckpt(find(2, "fp32", 2), tmp_path / "src")
    bad = tag_of(src) / "mp_rank_00_model_states.pt"
    raw = bytearray(bad.read_bytes())
    i = raw.index(b"ds_version")  # a key of the pickle: same length, still a valid pickle
    raw[i] = ord("D")
    bad.write_bytes(bytes(raw))
    try:
        convert(src, tmp_path / "out")
    except ForeignCheckpointError as exc:
        assert exc.file == str(bad)
        return
    assert ucp.verify(tmp_path / "out").ok


def test_existing_destination_without_overwrite(tmp_path: Path) -> None:
    ckpt = find(2, "fp32")
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    convert(find(1, "bf16"), tmp_path / "ucp")
    for dst in (other, tmp_path / "ucp"):
        before = digest(dst)
        with pytest.raises(ucp.DestinationError, match="already exists"):
            convert(ckpt, dst)
        assert digest(dst) == before
    with pytest.raises(ucp.DestinationError, match="not a UCP checkpoint"):
        convert(ckpt, other, overwrite=True)
    assert (other / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "ucp"]


def test_overwrite_replaces_a_ucp_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = find(1, "bf16"), find(2, "fp32")
    dst = tmp_path / "dst"
    convert(first, dst)
    convert(second, dst, overwrite=True)
    convert_with_torch(monkeypatch, second, tmp_path / "ref")
    assert ucp.verify(dst).ok
    assert ucp.read_manifest(dst).metadata == ucp.read_manifest(tmp_path / "ref").metadata
    assert_same_state(ucp.load(dst), ucp.load(tmp_path / "ref"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "ref"]


def test_destination_holding_the_source_is_refused(tmp_path: Path) -> None:
    src = copy_ckpt(find(2, "fp32"), tmp_path / "src")
    (tmp_path / "src" / "manifest.json").write_text("{}")  # looks like a UCP checkpoint
    before = digest(src)
    with pytest.raises(ucp.DestinationError, match="would delete the source"):
        convert(tag_of(src), src, overwrite=True, source_format="deepspeed")
    assert digest(src) == before


def test_overwrite_through_a_symlink_keeps_its_target(tmp_path: Path) -> None:
    target, link = tmp_path / "target", tmp_path / "link"
    convert(find(1, "bf16"), target)
    before = digest(target)
    link.symlink_to(target)
    convert(find(2, "fp32"), link, overwrite=True)
    assert digest(target) == before
    assert ucp.verify(link).ok and ucp.read_manifest(link).metadata["source"]["zero_stage"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "target"]


def test_write_stored_every_dtype_and_parts_in_two_folders(tmp_path: Path) -> None:
    """write_stored on its own: dtypes DeepSpeed files do not hold, 0-d and empty tensors, a leaf whose
    parts lie in files of different folders, plain values; all bit-exact after ucp.load."""
    from ucp.conversion.importers.common import Imported
    from ucp.conversion.importers.stored import stored_leaf
    from ucp.conversion.importers.torch_archive import read_archive
    from ucp.conversion.importers.write_stored import write_stored

    values = {
        "f32": torch.randn(3, 4),
        "i64": torch.arange(-3, 5),
        "bool": torch.tensor([True, False, True]),
        "f16": torch.randn(7).half(),
        "bf16": torch.randn(2, 2, 2).bfloat16(),
        "zero_d": torch.tensor(3.5),
        "i8": torch.tensor([-1, 2], dtype=torch.int8),
        "f64": torch.randn(2, dtype=torch.float64),
        "empty": torch.empty(0),
        "u8": torch.arange(250, 256, dtype=torch.uint8),
    }
    (tmp_path / "a").mkdir()
    (tmp_path / "b" / "c").mkdir(parents=True)
    torch.save(values, tmp_path / "a" / "v.pt")
    torch.save({"x": torch.arange(10.0)}, tmp_path / "a" / "x.pt")
    torch.save({"y": torch.arange(10.0, 20.0)}, tmp_path / "b" / "c" / "y.pt")
    stored = read_archive(tmp_path / "a" / "v.pt")
    x, y = read_archive(tmp_path / "a" / "x.pt")["x"], read_archive(tmp_path / "b" / "c" / "y.pt")["y"]
    state = {"v": stored, "leaf": stored_leaf([(y[0:6], 4), (x[0:4], 0)], (2, 5)), "n": 3, "s": "text", "l": [1, None]}
    manifest = write_stored(Imported(state=state, step=7, metadata={"k": "v"}), str(tmp_path / "out"))
    assert manifest.step == 7 and ucp.verify(tmp_path / "out").ok
    got = ucp.load(tmp_path / "out")
    want = {
        "v": values,
        "leaf": torch.tensor([[0.0, 1, 2, 3, 10], [11, 12, 13, 14, 15]]),
        "n": 3,
        "s": "text",
        "l": [1, None],
    }
    assert_same_state(got, want)
    assert ucp.read_manifest(tmp_path / "out").metadata["k"] == "v"


@pytest.mark.parametrize(
    "parts",
    [[(0, 4, 0), (3, 10, 3)], [(0, 4, 0), (5, 10, 5)], [(0, 10, 0), (0, 10, 0)]],
    ids=["overlap", "gap", "twice"],
)
def test_write_stored_refuses_parts_that_do_not_cover(tmp_path: Path, parts: list) -> None:
    from ucp.conversion.importers.common import Imported
    from ucp.conversion.importers.stored import StoredLeaf
    from ucp.conversion.importers.torch_archive import read_archive
    from ucp.conversion.importers.write_stored import write_stored

    torch.save({"x": torch.arange(10.0)}, tmp_path / "x.pt")
    x = read_archive(tmp_path / "x.pt")["x"]
    leaf = StoredLeaf(tuple((x[a:b], s) for a, b, s in parts), (10,))
    with pytest.raises(ForeignCheckpointError, match="exactly once"):
        write_stored(Imported(state={"w": leaf}, step=None), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


class Boom(Exception):
    pass


def _fail_halfway(exc: BaseException):
    def progress(done: int, total: int, what: str) -> None:
        if total > 100_000 and done > total // 2:  # the write phase (bytes), half done
            raise exc

    return progress


@pytest.mark.parametrize("exc", [Boom("disk on fire"), KeyboardInterrupt()], ids=["error", "ctrl-c"])
def test_failed_write_leaves_nothing(tmp_path: Path, exc: BaseException) -> None:
    ckpt = find(2, "fp32")
    before = digest(tag_of(ckpt))
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(type(exc)):
        convert(ckpt, out / "dst", progress=_fail_halfway(exc))
    assert list(out.iterdir()) == []
    assert digest(tag_of(ckpt)) == before
    convert(ckpt, out / "dst")  # and a retry works
    assert ucp.verify(out / "dst").ok


def test_failed_overwrite_keeps_the_old_checkpoint(tmp_path: Path) -> None:
    dst = tmp_path / "dst"
    convert(find(1, "bf16"), dst)
    old = digest(dst)
    with pytest.raises(Boom):
        convert(find(2, "fp32"), dst, overwrite=True, progress=_fail_halfway(Boom("no")))
    assert digest(dst) == old and ucp.verify(dst).ok
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"]


def test_write_error_from_the_disk_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An OSError inside the data file writer (ENOSPC-like), not from a callback."""
    import ucp.conversion.reshape as reshape

    real: Any = reshape.write_rank_file  # called below with a test double for its views

    class Failing:
        def __init__(self, views: Any) -> None:
            self.views = views

        def __len__(self) -> int:
            return len(self.views)

        def __iter__(self) -> Any:
            for i, v in enumerate(self.views):
                if i == 3:
                    raise OSError(28, "No space left on device (injected)")
                yield v

    def failing(storage: Any, path: str, plan: Any, views: Any, **kwargs: Any) -> Any:
        return real(storage, path, plan, Failing(views), **kwargs)

    monkeypatch.setattr(reshape, "write_rank_file", failing)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(OSError, match="injected"):
        convert(find(2, "fp32"), out / "dst")
    assert list(out.iterdir()) == []


KILLED = """
import os, signal, sys
from ucp.conversion.importers import convert

def progress(done, total, what):
    if total > 100_000 and done > total // 2:
        os.kill(os.getpid(), signal.SIGKILL)

convert(sys.argv[1], sys.argv[2], progress=progress)
"""


def test_killed_write_leaves_no_checkpoint(tmp_path: Path) -> None:
    ckpt = find(2, "fp32")
    before = digest(tag_of(ckpt))
    dst = tmp_path / "out" / "dst"
    dst.parent.mkdir()
    run = subprocess.run([PY, "-c", KILLED, str(ckpt), str(dst)], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert run.returncode == -signal.SIGKILL, run.stderr
    assert not dst.exists()
    assert digest(tag_of(ckpt)) == before
    convert(ckpt, dst)  # a leftover temporary folder does not block the next conversion
    assert ucp.verify(dst).ok
