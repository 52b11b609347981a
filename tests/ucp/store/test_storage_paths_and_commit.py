"""Edges of the storage layer and the atomic commit: URLs, odd paths, overwrites that fail half-way,
crash windows of both commit paths, and CheckpointManager retention/concurrency on one root.
"""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import fsspec  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from fsspec.implementations.memory import MemoryFileSystem  # noqa: E402
from ucp_helpers import assert_same_state, random_tensor, save_ranks  # noqa: E402

import ucp  # noqa: E402
import ucp.saving.sync_save  # noqa: E402
from ucp.manager import CheckpointManager, list_checkpoints, read_latest  # noqa: E402
from ucp.store.storage import FsspecStorage, LocalStorage, rename_exchange  # noqa: E402

OLD = {
    "w": random_tensor(torch.float32, (7, 5), seed=11),
    "h": random_tensor(torch.bfloat16, (9,), seed=12),
    "meta": {"lr": 0.5, "tag": "old"},
}
NEW = {"x": random_tensor(torch.int16, (13,), seed=13), "meta": {"tag": "new"}}


def state_at(step: int) -> dict:
    return {"w": random_tensor(torch.float32, (6, 4), seed=step), "step": step}


@pytest.fixture
def mem_root():
    """A fresh memory:// prefix ("/ucp-edges-..."), removed afterwards."""
    fs = fsspec.filesystem("memory")
    root = f"/ucp-edges-{os.getpid()}-{id(object())}"
    yield root
    try:
        fs.rm(root, recursive=True)
    except FileNotFoundError:
        pass


def mem_names(root: str) -> list[str]:
    return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fsspec.filesystem("memory").ls(root, detail=False))


def _chattr(flag: str, path: Path) -> bool:
    try:
        return subprocess.run(["chattr", flag, str(path)], capture_output=True).returncode == 0
    except FileNotFoundError:
        return False


# -- URLs and odd paths: save, load, verify, async_save ----------------------------------------------


@pytest.mark.parametrize(
    "kind",
    ["memory", "memory-unicode-trailing-slash", "file-abs-spaces", "file-relative", "local-unicode-trailing-slash"],
)
def test_url_round_trip_verify_async_overwrite(tmp_path, monkeypatch, mem_root, kind):
    """Every spelling of a location saves, loads bit-exact, verifies, and is overwritten cleanly by async_save."""
    if kind == "memory":
        url, final, listing = f"memory://{mem_root}/ck", "ck", lambda: mem_names(mem_root)
    elif kind == "memory-unicode-trailing-slash":
        url, final, listing = f"memory://{mem_root}/d ir/ck é/", "ck é", lambda: mem_names(f"{mem_root}/d ir")
    elif kind == "file-abs-spaces":
        (tmp_path / "a b").mkdir()
        url, final, listing = f"file://{tmp_path}/a b/ck ü", "ck ü", lambda: sorted(os.listdir(tmp_path / "a b"))
    elif kind == "file-relative":
        monkeypatch.chdir(tmp_path)
        url, final, listing = "file://rel/ck", "ck", lambda: sorted(os.listdir(tmp_path / "rel"))
    else:
        url, final, listing = f"{tmp_path}/ck ✓/", "ck ✓", lambda: sorted(os.listdir(tmp_path))
    m = ucp.save(OLD, url, step=3)
    assert m.step == 3
    assert_same_state(ucp.load(url), OLD)
    assert ucp.read_manifest(url).step == 3
    report = ucp.verify(url)
    assert report.ok and report.files_checked == 1 and report.bytes_checked == report.bytes_total > 0
    assert listing() == [final]
    ucp.async_save(NEW, url, step=4).result(timeout=120)
    assert_same_state(ucp.load(url), NEW)
    assert ucp.verify(url).ok
    assert listing() == [final]  # old removed, no .tmp-/.old- left over


def test_fsspec_overwrite_with_fewer_files_leaves_only_the_new(mem_root):
    url = f"memory://{mem_root}/ck"
    full = random_tensor(torch.float32, (8, 3), seed=5)
    save_ranks(url, [{"w": ucp.ShardedTensor(full[r * 4 : (r + 1) * 4], (8, 3), (r * 4, 0))} for r in range(2)])
    assert mem_names(f"{mem_root}/ck") == ["manifest.json", "rank-00000.safetensors", "rank-00001.safetensors"]
    ucp.save(NEW, url)
    assert mem_names(f"{mem_root}/ck") == ["manifest.json", "rank-00000.safetensors"]
    assert mem_names(mem_root) == ["ck"]
    assert_same_state(ucp.load(url), NEW)


def test_fsspec_leftovers_are_never_loaded(mem_root):
    ucp.save(OLD, f"memory://{mem_root}/.ck.tmp-0123456789ab")  # complete-looking leftovers
    ucp.save(OLD, f"memory://{mem_root}/.ck.old-0123456789ab")
    with pytest.raises(ucp.NotACheckpointError, match="ck"):
        ucp.load(f"memory://{mem_root}/ck")
    assert not ucp.verify(f"memory://{mem_root}/ck").ok
    ucp.save(NEW, f"memory://{mem_root}/ck")
    assert_same_state(ucp.load(f"memory://{mem_root}/ck"), NEW)


class _RecordingMemoryFS(MemoryFileSystem):
    """A memory file system that records the storage_options it was built with."""

    protocol = ("ucpedgerec",)
    seen: list[dict] = []

    def __init__(self, *args, **kwargs):
        type(self).seen.append(dict(kwargs))
        super().__init__(*args, **kwargs)


def test_storage_options_reach_the_file_system(mem_root):
    fsspec.register_implementation("ucpedgerec", _RecordingMemoryFS, clobber=True)
    _RecordingMemoryFS.seen.clear()
    url = f"ucpedgerec://{mem_root}/ck"
    ucp.save(OLD, url, storage_options={"marker": "save"})
    assert_same_state(ucp.load(url, storage_options={"marker": "load"}), OLD)
    assert ucp.verify(url, storage_options={"marker": "verify"}).ok
    assert ucp.read_manifest(url, storage_options={"marker": "manifest"}).tensors.keys() == {"w", "h"}
    ucp.async_save(NEW, url, storage_options={"marker": "async"}).result(timeout=120)
    assert_same_state(ucp.load(url, storage_options={"marker": "load"}), NEW)
    markers = {kw.get("marker") for kw in _RecordingMemoryFS.seen}
    assert {"save", "load", "verify", "manifest", "async"} <= markers


@pytest.mark.parametrize("kind", ["local", "file-url", "memory"])
def test_existing_file_at_the_path_is_refused_and_kept(tmp_path, mem_root, kind):
    if kind == "memory":
        fs = fsspec.filesystem("memory")
        fs.pipe_file(f"{mem_root}/afile", b"precious")
        url = f"memory://{mem_root}/afile"
        content, names = (lambda: fs.cat_file(f"{mem_root}/afile")), (lambda: mem_names(mem_root))
    else:
        (tmp_path / "afile").write_bytes(b"precious")
        url = str(tmp_path / "afile") if kind == "local" else f"file://{tmp_path}/afile"
        content, names = (lambda: (tmp_path / "afile").read_bytes()), (lambda: sorted(os.listdir(tmp_path)))
    with pytest.raises(ucp.CheckpointError, match=r"afile exists and is not a checkpoint.*refusing"):
        ucp.save(NEW, url)
    assert content() == b"precious"
    assert names() == ["afile"]  # the temporary directory is gone too


def test_read_only_parent_gives_a_clean_error_and_leaves_nothing(tmp_path):
    """Root ignores permissions, so the parent is made immutable (ext4 ``chattr +i``)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    ucp.save(OLD, ro / "ck")
    if not _chattr("+i", ro):
        pytest.skip("chattr +i not available here")
    try:
        with pytest.raises(PermissionError) as info:
            ucp.save(NEW, ro / "ck")
        assert os.path.dirname(info.value.filename) == str(ro)  # names a path in the read-only parent
        with pytest.raises(PermissionError):
            ucp.save(NEW, ro / "fresh")
        assert sorted(os.listdir(ro)) == ["ck"]
        assert_same_state(ucp.load(ro / "ck"), OLD)
    finally:
        _chattr("-i", ro)


def test_parent_that_is_a_file_and_a_too_long_name_fail_cleanly(tmp_path):
    (tmp_path / "pf").write_text("x")
    with pytest.raises(NotADirectoryError) as info:
        ucp.save(NEW, tmp_path / "pf" / "ck")
    assert str(tmp_path / "pf") in info.value.filename
    assert (tmp_path / "pf").read_text() == "x"
    # a 240-byte name is legal, but ".<name>.tmp-<12 hex>" exceeds NAME_MAX: the error names that path
    with pytest.raises(OSError) as info:
        ucp.save(NEW, tmp_path / ("c" * 240))
    assert info.value.errno == errno.ENAMETOOLONG and ".tmp-" in info.value.filename
    assert sorted(os.listdir(tmp_path)) == ["pf"]


# -- overwrites that fail half-way ------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["local-fallback", "memory"])
def test_failed_second_rename_leaves_the_old_checkpoint_at_the_path(tmp_path, monkeypatch, mem_root, backend):
    if backend == "memory":
        url, names, cls = f"memory://{mem_root}/ck", (lambda: mem_names(mem_root)), FsspecStorage
    else:
        url, names, cls = str(tmp_path / "ck"), (lambda: sorted(os.listdir(tmp_path))), LocalStorage
        monkeypatch.setattr(LocalStorage, "exchange", lambda self, a, b: False)
    ucp.save(OLD, url)
    orig = cls.rename

    def failing(self, src, dst):
        if ".tmp-" in src:
            raise OSError(errno.EIO, "simulated rename failure", src)
        return orig(self, src, dst)

    monkeypatch.setattr(cls, "rename", failing)
    with pytest.raises(OSError, match="simulated"):
        ucp.save(NEW, url)
    monkeypatch.setattr(cls, "rename", orig)
    assert_same_state(ucp.load(url), OLD)
    assert names() == ["ck"]


@pytest.mark.parametrize("interrupt", ["copy-into-path", "delete-from-path"])
def test_interrupted_fsspec_rename_never_leaves_a_manifest_without_data(monkeypatch, mem_root, interrupt):
    url = f"memory://{mem_root}/ck"
    target = f"{mem_root}/ck/"
    if interrupt == "delete-from-path":
        ucp.save(OLD, url)  # the fallback moves it aside: copy, then delete from ck/
    done: list[str] = []
    orig_cp, orig_rm = MemoryFileSystem.cp_file, MemoryFileSystem.rm_file

    def cp_file(self, path1, path2, **kwargs):
        if interrupt == "copy-into-path" and path2.startswith(target) and self.isfile(path1):
            if done:  # the last file of two: a crash in the middle of the copy
                raise OSError(errno.EIO, "simulated interruption", path2)
            done.append(path2)
        return orig_cp(self, path1, path2, **kwargs)

    def rm_file(self, path):
        path = self._strip_protocol(path)
        if interrupt == "delete-from-path" and path.startswith(target) and self.isfile(path):
            if done:
                raise OSError(errno.EIO, "simulated interruption", path)
            done.append(path)
        return orig_rm(self, path)

    monkeypatch.setattr(MemoryFileSystem, "cp_file", cp_file)
    monkeypatch.setattr(MemoryFileSystem, "rm_file", rm_file)
    with pytest.raises(OSError, match="simulated"):
        ucp.save(NEW, url)
    monkeypatch.setattr(MemoryFileSystem, "cp_file", orig_cp)
    monkeypatch.setattr(MemoryFileSystem, "rm_file", orig_rm)
    assert done  # the interruption happened inside ck/
    try:
        loaded = ucp.load(url)
    except ucp.NotACheckpointError:
        return  # no manifest at the path: fine, the path is simply not a checkpoint
    assert_same_state(loaded, OLD if interrupt == "delete-from-path" else NEW)


# -- crash windows of the two commit paths ----------------------------------------------------------


def _exchange_works(tmp_path: Path) -> bool:
    a, b = tmp_path / "xa", tmp_path / "xb"
    a.mkdir()
    b.mkdir()
    try:
        return rename_exchange(str(a), str(b))
    finally:
        a.rmdir()
        b.rmdir()


def test_fallback_crash_after_rename_leaves_only_an_old_sibling(tmp_path, monkeypatch):
    """Fallback path, crash after the second rename (before the delete): the new at the path, old as .old-."""
    monkeypatch.setattr(LocalStorage, "exchange", lambda self, a, b: False)
    path = tmp_path / "ck"
    ucp.save(OLD, path)
    monkeypatch.setattr(LocalStorage, "remove_tree", lambda self, rel: None)  # the "crash": no delete
    ucp.save(NEW, path)
    assert_same_state(ucp.load(path), NEW)
    left = [n for n in os.listdir(tmp_path) if n != "ck"]
    assert len(left) == 1 and left[0].startswith(".ck.old-")
    assert_same_state(ucp.load(tmp_path / left[0]), OLD)


def test_exchange_crash_after_swap_leaves_the_old_under_an_old_name(tmp_path, monkeypatch):
    if not _exchange_works(tmp_path):
        pytest.skip("renameat2(RENAME_EXCHANGE) unsupported here")
    path = tmp_path / "ck"
    ucp.save(OLD, path)
    monkeypatch.setattr(LocalStorage, "remove_tree", lambda self, rel: None)  # the "crash": no delete
    ucp.save(NEW, path)
    assert_same_state(ucp.load(path), NEW)
    left = [n for n in os.listdir(tmp_path) if n != "ck"]
    assert len(left) == 1
    assert_same_state(ucp.load(tmp_path / left[0]), OLD)
    assert left[0].startswith(".ck.old-"), left


# -- CheckpointManager --------------------------------------------------------------------------------


def test_manager_retention_out_of_order_equal_steps_and_none(tmp_path):
    m = CheckpointManager(tmp_path / "a", keep_last=2)
    for step in (30, 10, 20, 40):
        m.save(state_at(step), step)
    assert sorted(os.listdir(tmp_path / "a")) == ["latest", "step-00000030", "step-00000040"]
    m.save(
        state_at(5), 5
    )  # older than latest: latest stays at the newest complete step; retention keeps it + the highest
    assert read_latest(tmp_path / "a") == (40, "step-00000040") and m.latest() == 40
    assert sorted(os.listdir(tmp_path / "a")) == ["latest", "step-00000005", "step-00000040"]
    assert_same_state(m.load(40), state_at(40))

    m1 = CheckpointManager(tmp_path / "b", keep_last=1)
    m1.save(state_at(1), 10)
    m1.save(state_at(2), 10)  # the same step twice: replaced atomically, nothing left over
    assert sorted(os.listdir(tmp_path / "b")) == ["latest", "step-00000010"]
    assert_same_state(m1.load(), state_at(2))

    mall = CheckpointManager(tmp_path / "c")  # keep_last=None keeps everything
    for step in (3, 1, 2):
        mall.save(state_at(step), step)
    assert [i.step for i in mall.list()] == [1, 2, 3] and mall.latest() == 3
    for bad in (0, -1):
        with pytest.raises(ValueError):
            CheckpointManager(tmp_path / "d", keep_last=bad)


def test_manager_leaves_foreign_entries_alone(tmp_path):
    for name in ("notes.txt", "step-abc", "step-00000099.bak", ".step-00000007.tmp-not-hex"):
        (tmp_path / name).write_text("x")
    (tmp_path / "step-00000001").mkdir()  # a foreign directory with a step-like name
    (tmp_path / "step-00000001" / "data.txt").write_text("keep")
    m = CheckpointManager(tmp_path, keep_last=1)
    for step in (2, 3, 4):
        m.save(state_at(step), step)
    assert sorted(os.listdir(tmp_path)) == [
        ".step-00000007.tmp-not-hex",
        "latest",
        "notes.txt",
        "step-00000001",
        "step-00000004",
        "step-00000099.bak",
        "step-abc",
    ]
    assert (tmp_path / "step-00000001" / "data.txt").read_text() == "keep"
    assert {i.name: i.status for i in m.list()} == {"step-00000001": "incomplete", "step-00000004": "complete"}
    with pytest.raises(ucp.CheckpointError, match="step-00000001 exists and is not a checkpoint"):
        m.save(state_at(1), 1)
    assert (tmp_path / "step-00000001" / "data.txt").read_text() == "keep"


def test_second_manager_does_not_delete_a_synchronous_save_in_flight(tmp_path, monkeypatch):
    a, b = CheckpointManager(tmp_path), CheckpointManager(tmp_path)
    orig = ucp.saving.sync_save.write_rank_file
    calls = {"n": 0}

    def write_then_other_manager_saves(storage, rel, plan, views):
        records = orig(storage, rel, plan, views)
        calls["n"] += 1
        if calls["n"] == 1:  # a's data file is written, its commit not yet done
            b.save(state_at(2), 2)
        return records

    monkeypatch.setattr(ucp.saving.sync_save, "write_rank_file", write_then_other_manager_saves)
    a.save(state_at(1), 1)
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-00000001", "step-00000002"]
    assert_same_state(a.load(1), state_at(1))
    assert_same_state(a.load(2), state_at(2))


def test_retention_of_a_symlinked_step_leaves_no_leftover(tmp_path):
    root = tmp_path / "run"
    root.mkdir()
    ucp.save(state_at(1), tmp_path / "elsewhere", step=1)
    os.symlink(tmp_path / "elsewhere", root / "step-00000001")
    m = CheckpointManager(root, keep_last=1)
    assert [(i.name, i.status) for i in m.list()] == [("step-00000001", "complete")]
    m.save(state_at(2), 2)
    m.save(state_at(3), 3)  # the next save's leftover cleaning does not get it either
    assert_same_state(ucp.load(tmp_path / "elsewhere"), state_at(1))  # the link's target is not touched
    assert sorted(os.listdir(root)) == ["latest", "step-00000003"]
    assert [i.name for i in list_checkpoints(root)] == ["step-00000003"]


# -- messages -----------------------------------------------------------------------------------------


def test_root_level_url_errors_name_the_url_given():
    name = f"ucp-edges-missing-{os.getpid()}"
    with pytest.raises(ucp.NotACheckpointError) as info:
        ucp.load(f"memory://{name}")
    assert f"memory://{name}" in str(info.value)


def test_root_level_url_round_trip():
    name = f"ucp-edges-top-{os.getpid()}"
    try:
        ucp.save(OLD, f"memory://{name}")
        ucp.save(NEW, f"memory://{name}")
        assert_same_state(ucp.load(f"memory://{name}"), NEW)
        assert not [p for p in fsspec.filesystem("memory").ls("/", detail=False) if name in p and p != f"/{name}"]
    finally:
        try:
            fsspec.filesystem("memory").rm(f"/{name}", recursive=True)
        except FileNotFoundError:
            pass
