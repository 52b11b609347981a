"""What a Storage can do is asked of the storage (local_path, supports_locks, config, remove_file),
never of its class: a local directory and an fsspec ``memory://`` prefix answer differently, and
the code that branches on the answers (locks, liveness files, manifest and data-file checks) works
on both."""

from __future__ import annotations

import os
from types import SimpleNamespace

import fsspec
import pytest
import torch

import ucp
from aio import AioConfig
from ucp.saving.background import handshake as bg
from ucp.store import commit, reader
from ucp.store.storage import FsspecStorage, LocalStorage, Storage, open_storage


@pytest.fixture
def mem_root():
    root = f"/ucp-caps-{os.getpid()}-{id(object())}"
    yield root
    try:
        fsspec.filesystem("memory").rm(root, recursive=True)
    except FileNotFoundError:
        pass


def test_local_directory_capabilities(tmp_path):
    cfg = AioConfig(block_size=1 << 20)
    storage, name = open_storage(tmp_path / "ck", aio_config=cfg)
    assert isinstance(storage, LocalStorage) and name == "ck"
    assert storage.local and storage.supports_locks
    assert storage.local_path("ck/manifest.json") == os.path.join(str(tmp_path), "ck", "manifest.json")
    assert storage.local_path("") == str(tmp_path)
    assert storage.config is cfg


def test_memory_capabilities(mem_root):
    storage, name = open_storage(f"memory://{mem_root}/ck")
    assert isinstance(storage, FsspecStorage) and name == "ck"
    assert not storage.local and not storage.supports_locks
    assert storage.local_path("ck") is None
    assert storage.config == AioConfig()  # defaults pace the streaming writes


def test_file_url_is_not_local(tmp_path):
    """A ``file://`` URL goes through fsspec: it gets no local-only treatment, whatever the files are."""
    storage, _ = open_storage(f"file://{tmp_path}/ck")
    assert isinstance(storage, FsspecStorage)
    assert storage.local_path("ck") is None and not storage.supports_locks


def test_remove_file(tmp_path, mem_root):
    local, _ = open_storage(tmp_path / "ck")
    local.write_small("f", b"x")
    local.remove_file("f")
    assert not local.exists("f")
    with pytest.raises(FileNotFoundError):
        local.remove_file("f")  # os.unlink: a missing file is an error locally
    mem, _ = open_storage(f"memory://{mem_root}/ck")
    mem.write_small("f", b"x")
    mem.remove_file("f")
    assert not mem.exists("f")
    mem.remove_file("f")  # best effort elsewhere


def test_in_flight_lock_only_where_locks_work(tmp_path, mem_root):
    local, _ = open_storage(tmp_path / "ck")
    local.makedirs("tmp")
    fd = commit.lock_temp(local, "tmp")
    assert fd is not None
    try:
        assert commit.dir_in_use(str(tmp_path / "tmp"))
    finally:
        os.close(fd)
    assert not commit.dir_in_use(str(tmp_path / "tmp"))
    mem, _ = open_storage(f"memory://{mem_root}/ck")
    mem.makedirs("tmp")
    assert commit.lock_temp(mem, "tmp") is None


def test_liveness_locks_and_identity(tmp_path, mem_root):
    job = SimpleNamespace(temp="tmp", rank=0, world_size=1)
    local, _ = open_storage(tmp_path / "ck")
    local.makedirs("tmp")
    st = os.stat(tmp_path / "tmp")
    assert bg.identity(local, "tmp") == (st.st_dev, st.st_ino)
    fd = bg.hold_alive(local, job)
    assert fd is not None
    assert not bg.rank_dead(local, job, 0)
    os.close(fd)  # the rank "dies": its lock goes with it
    assert bg.rank_dead(local, job, 0)
    bg.drop_alive_files(local, job)
    assert local.listdir("tmp") == []

    mem, _ = open_storage(f"memory://{mem_root}/ck")
    mem.makedirs("tmp")
    assert bg.identity(mem, "tmp") is None
    assert bg.hold_alive(mem, job) is None
    assert not bg.rank_dead(mem, job, 0)


def test_local_checks_refuse_special_files(tmp_path):
    """Local storage opens the manifest without blocking and stats data files: a FIFO manifest and a
    directory in place of a data file are named, not hung on or misread."""
    ucp.save({"w": torch.arange(6, dtype=torch.float32)}, tmp_path / "ck")
    storage, name = open_storage(tmp_path / "ck")
    data = tmp_path / "ck" / "rank-00000.safetensors"
    size = data.stat().st_size
    reader.check_file_size(storage, name, "rank-00000.safetensors", size)
    os.unlink(data)
    os.mkdir(data)
    with pytest.raises(
        ucp.CorruptCheckpointError, match="rank-00000.safetensors is not a regular file but a directory"
    ):
        reader.check_file_size(storage, name, "rank-00000.safetensors", size)
    os.rename(tmp_path / "ck" / "manifest.json", tmp_path / "ck" / "old.json")
    os.mkfifo(tmp_path / "ck" / "manifest.json")
    with pytest.raises(ucp.ManifestError, match="manifest.json: is not a regular file \\(a FIFO\\)"):
        reader._read_manifest_bytes(storage, f"{name}/manifest.json")


def test_memory_round_trip_and_data_file_checks(mem_root):
    url = f"memory://{mem_root}/ck"
    sd = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4)}
    ucp.save(sd, url)
    assert torch.equal(ucp.load(url)["w"], sd["w"])
    storage, name = open_storage(url)
    size = storage.size(f"{name}/rank-00000.safetensors")
    reader.check_file_size(storage, name, "rank-00000.safetensors", size)
    with pytest.raises(ucp.CorruptCheckpointError, match="rank-00000.safetensors"):
        reader.check_file_size(storage, name, "rank-00000.safetensors", size + 1)


def test_a_new_backend_gets_the_conservative_answers():
    """A Storage that declares nothing is treated as remote: no paths, no locks, default geometry."""
    assert Storage.local is False and Storage.supports_locks is False
    assert Storage.local_path(object.__new__(FsspecStorage), "x") is None
    assert Storage.config == AioConfig()
