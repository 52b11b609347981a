"""Safety edges: untrusted checkpoints (UCP and foreign) must not run code, reach outside their folder,
allocate or preallocate what their metadata claims before checking it, or blow up in time and memory
(each fails with a CheckpointError naming the file at fault); shared-memory staging must be private and
must not outlive the save; a tuning run in a user's directory must not touch files it did not make.
"""

from __future__ import annotations

import builtins
import dataclasses
import glob
import json
import os
import pickle
import shutil
import signal
import stat
import struct
import subprocess
import sys
import tracemalloc
import warnings
from pathlib import Path
from typing import Any, Literal

import pytest
import torch
from safetensors.torch import save_file

import ucp
from ucp.conversion.importers import ForeignCheckpointError, UnsafePickleError, convert, read
from ucp.conversion.importers.pickles import load_torch
from ucp.errors import CorruptCheckpointError, ManifestError
from ucp.format.manifest import parse_manifest, seal

RANK0 = "rank-00000.safetensors"


def _save(path: Path, state: dict[str, Any] | None = None) -> Path:
    ucp.save(state if state is not None else {"model": {"w": torch.arange(16.0)}}, path)
    return path


def _manifest(path: Path) -> dict[str, Any]:
    return json.loads((path / "manifest.json").read_text())


def _write_manifest(path: Path, m: dict[str, Any]) -> None:
    """Write an edited manifest sealed with its fresh checksum, as a forger would."""
    (path / "manifest.json").write_bytes(seal(m))


class Evil:
    """Pickles as ``fn(*args)``: what a hostile checkpoint would carry."""

    def __init__(self, fn: Any, args: tuple) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple:
        return self.fn, self.args


def _payloads(marker: Path) -> dict[str, Evil]:
    return {
        "os.system": Evil(os.system, (f"touch {marker}",)),
        "builtins.eval": Evil(builtins.eval, (f"open({str(marker)!r}, 'w')",)),
        "subprocess.Popen": Evil(subprocess.Popen, (["touch", str(marker)],)),
    }


# -- untrusted UCP checkpoints: sizes the manifest claims ----------------------------------------------


def _absurd(path: Path) -> Path:
    """A checkpoint whose manifest is self-consistent but claims a 2^61-byte tensor in a 2^61-byte
    data file; the file on disk is 4 KiB. Every check on the manifest alone passes (MAX_BYTES is 2^62)."""
    _save(path)
    m = _manifest(path)
    n = 1 << 59  # F32 elements: 2^61 bytes
    entry = m["tensors"]["model.w"]
    entry["shape"] = [n]
    entry["pieces"][0].update(length=n * 4, box={"offsets": [0], "shape": [n]})
    m["files"][RANK0]["size"] = 4096 + n * 4
    _write_manifest(path, m)
    return path


def _absurd_sharded(path: Path) -> Path:
    """Like ``_absurd`` but the tensor is in two flat pieces (a whole load assembles it)."""
    _save(path)
    m = _manifest(path)
    n = 1 << 59
    half = n // 2
    m["tensors"]["model.w"]["shape"] = [n]
    m["tensors"]["model.w"]["pieces"] = [
        {"file": RANK0, "offset": 4096, "length": half * 4, "flat": {"start": 0, "stop": half}, "crc32c": 0},
        {
            "file": RANK0,
            "offset": 4096 + half * 4,
            "length": half * 4,
            "flat": {"start": half, "stop": n},
            "crc32c": 0,
            "entry": "model.w#1",
        },
    ]
    m["files"][RANK0]["size"] = 4096 + n * 4
    _write_manifest(path, m)
    return path


def test_absurd_claimed_size_is_caught_by_verify_without_reading(tmp_path: Path) -> None:
    report = ucp.verify(_absurd_sharded(tmp_path / "ck"))
    assert not report.ok and report.bytes_checked == 0
    assert report.problems[0].kind == "CorruptCheckpointError" and report.problems[0].file == RANK0
    assert "truncated" in report.problems[0].message


def _load(src: Path, out: Path) -> None:
    ucp.load(src)


def _load_into(src: Path, out: Path) -> None:
    ucp.load(src, into={"model": {"w": None}})  # a plain value to replace: the stored tensor is loaded in full


def _export_hf(src: Path, out: Path) -> None:
    from ucp.conversion.exporters import export

    export(src, out, format="hf")


def _export_zarr(src: Path, out: Path) -> None:
    from ucp.conversion.exporters import export

    export(src, out, format="zarr")


def _reshape(src: Path, out: Path) -> None:
    from ucp.conversion.reshape import reshape

    reshape(src, out)


@pytest.mark.parametrize(
    "op",
    [_load, _load_into, _export_hf, _export_zarr, _reshape],
    ids=["load", "load-into", "export-hf", "export-zarr", "reshape"],
)
def test_absurd_claimed_size_fails_on_the_data_file_before_any_allocation(tmp_path: Path, op: Any) -> None:
    src = (_absurd_sharded if op is _load else _absurd)(tmp_path / "ck")
    try:
        with pytest.raises(CorruptCheckpointError, match=RANK0) as info:
            op(src, tmp_path / "out")
        assert "truncated" in str(info.value)
    finally:
        assert sorted(os.listdir(tmp_path)) == ["ck"]  # no temporary output left either way


def test_safetensors_header_length_2_pow_63_is_refused(tmp_path: Path) -> None:
    ck = _save(tmp_path / "ck")
    with open(ck / RANK0, "r+b") as f:
        f.write(struct.pack("<Q", 1 << 63))
    with pytest.raises(CorruptCheckpointError, match=RANK0):
        ucp.load(ck)
    with pytest.raises(CorruptCheckpointError, match=RANK0):
        ucp.load(ck, into={"model": {"w": torch.empty(16)}})
    report = ucp.verify(ck)
    assert not report.ok and report.problems[0].file == RANK0


# -- untrusted UCP checkpoints: JSON shapes ------------------------------------------------------------


def _deep(n: int) -> str:
    return "[" * n + "1" + "]" * n


@pytest.mark.parametrize("where,depth", [("state", 140), ("state", 3000), ("metadata", 250), ("metadata", 100_000)])
def test_deeply_nested_manifest_is_a_manifest_error(tmp_path: Path, where: str, depth: int) -> None:
    m = _manifest(_save(tmp_path / "ck"))
    text = json.dumps(m)
    if where == "state":
        text = text.replace('"state": {"dict": {', f'"state": {{"dict": {{"x": {_deep(depth)}, ', 1)
    else:
        text = text.replace('"metadata": {}', f'"metadata": {{"x": {_deep(depth)}}}', 1)
    with pytest.raises(ManifestError):
        parse_manifest(text)


@pytest.mark.parametrize(
    "edit",
    [
        lambda m: m["tensors"]["model.w"]["pieces"][0].update(offset=10**30),
        lambda m: m["tensors"]["model.w"].update(shape=[10**400]),
        lambda m: m["tensors"]["model.w"]["pieces"][0].update(length=-(10**40)),
        lambda m: m["files"][RANK0].update(size=10**100),
        lambda m: m["topology"].update(world_size=10**50),
        lambda m: m.update(step=10**3000),
    ],
    ids=["offset", "shape", "length", "file-size", "world-size", "step"],
)
def test_huge_json_numbers_are_manifest_errors(tmp_path: Path, edit: Any) -> None:
    m = _manifest(_save(tmp_path / "ck"))
    edit(m)
    with pytest.raises(ManifestError):
        parse_manifest(json.dumps(m))


def test_huge_json_integer_beyond_the_digit_limit_is_a_manifest_error() -> None:
    with pytest.raises(ManifestError, match="not valid JSON"):
        parse_manifest(b'{"format_version": 1, "step": ' + b"9" * 10_000 + b"}")


def test_checking_the_state_tree_takes_memory_linear_in_the_manifest(tmp_path: Path) -> None:
    m = _manifest(_save(tmp_path / "ck"))
    node: Any = 1
    for i in range(95):  # within pydantic's JSON depth limit and the tree's own depth limit
        node = {"dict": {chr(97 + i % 26) * 20_000: node}}
    m["state"]["dict"]["x"] = node
    text = seal(m).decode()  # valid content, sealed: the whole parse runs
    tracemalloc.start()
    try:
        parse_manifest(text)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 10 * len(text), f"peak {peak / 1e6:.0f} MB parsing a {len(text) / 1e6:.1f} MB manifest"


def test_state_tree_error_under_long_keys_names_the_path_cut_short(tmp_path: Path) -> None:
    m = _manifest(_save(tmp_path / "ck"))
    m["state"]["dict"]["k" * 100_000] = {"dict": {"b": [1, {"float": "x" * 100_000}]}}
    with pytest.raises(ManifestError) as info:
        parse_manifest(json.dumps(m))
    message = str(info.value)
    assert "state['kkkk" in message and "(100000 chars)]['b'][1]: 'float' must be" in message
    assert len(message) < 1000


# -- untrusted UCP checkpoints: symlinked data files ---------------------------------------------------


def test_symlinked_data_file_outside_the_checkpoint_is_refused_and_shows_no_bytes(tmp_path: Path) -> None:
    """A data file that resolves outside the checkpoint directory is refused, even a link to an identical
    copy; the message names the file and shows none of the foreign bytes. A link inside the directory loads."""
    ck = _save(tmp_path / "ck")
    inside = ck / "kept-copy"
    shutil.copy(ck / RANK0, inside)
    (ck / RANK0).unlink()
    (ck / RANK0).symlink_to(inside)
    assert torch.equal(ucp.load(ck)["model"]["w"], torch.arange(16.0))

    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(inside, outside / "copy")
    secret = outside / "secret"
    size = _manifest(ck)["files"][RANK0]["size"]
    secret.write_bytes((b"TOP-SECRET " * size)[:size])  # exactly the data file's size
    for target in (outside / "copy", secret):
        (ck / RANK0).unlink()
        (ck / RANK0).symlink_to(target)
        for attempt in (
            lambda: ucp.load(ck),
            lambda: ucp.load(ck, verify=False),
            lambda: ucp.load(ck, into={"model": {"w": torch.empty(16)}}, verify=False),
        ):
            with pytest.raises(CorruptCheckpointError, match=f"{RANK0}.*outside the checkpoint") as info:
                attempt()
            assert "SECRET" not in str(info.value)


def test_symlinked_data_file_to_a_device_or_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    ck = _save(tmp_path / "ck")
    outside_fifo = tmp_path / "fifo"
    os.mkfifo(outside_fifo)
    for target in ("/dev/zero", str(outside_fifo)):
        (ck / RANK0).unlink()
        (ck / RANK0).symlink_to(target)
        with pytest.raises(CorruptCheckpointError, match="outside the checkpoint"):
            ucp.load(ck)
        assert not ucp.verify(ck).ok
    (ck / RANK0).unlink()
    os.mkfifo(ck / RANK0)  # a fifo inside the directory itself: refused as not a regular file, no blocking
    with pytest.raises(CorruptCheckpointError, match="not a regular file"):
        ucp.load(ck)
    assert not ucp.verify(ck).ok


# -- exports: tensor names never escape the output directory ------------------------------------------

HOSTILE_NAMES = ["../../evil", "/abs/evil", "..", ".", "a/../../b", "../zarr.json", "c/0", "..%2Fz"]


@pytest.mark.parametrize("fmt", ["hf", "zarr"])
def test_export_of_hostile_tensor_names_stays_inside_the_output(tmp_path: Path, fmt: Literal["hf", "zarr"]) -> None:
    from ucp.conversion.exporters import export

    work = tmp_path / "work"
    work.mkdir()
    state = {"model": {n: torch.full((2,), float(i)) for i, n in enumerate(HOSTILE_NAMES)}}
    _save(work / "ck", state)
    before = set(os.listdir(tmp_path)), set(os.listdir(work))
    report = export(work / "ck", work / "out", format=fmt)
    assert report.tensors == len(HOSTILE_NAMES)
    assert set(os.listdir(tmp_path)) == before[0] and set(os.listdir(work)) == before[1] | {"out"}
    out = (work / "out").resolve()
    for dirpath, dirs, files in os.walk(out):
        for f in dirs + files:
            assert (Path(dirpath) / f).resolve().is_relative_to(out)
    if fmt == "zarr":
        import zarr
        from zarr_checks import ucp_attrs

        from ucp.conversion.exporters.zarr_export import read_tensor

        group = zarr.open_group(str(out), mode="r")
        mapping = ucp_attrs(group)["tensors"]
        for i, n in enumerate(HOSTILE_NAMES):
            assert torch.equal(read_tensor(group[mapping[n]]), torch.full((2,), float(i)))


def test_zarr_export_of_names_with_backslashes(tmp_path: Path) -> None:
    import zarr
    from zarr_checks import ucp_attrs

    from ucp.conversion.exporters import export
    from ucp.conversion.exporters.zarr_export import read_tensor

    state = {"p": torch.zeros(2), "p\\q": torch.ones(2), "x\\..\\y": torch.full((3,), 2.0)}
    _save(tmp_path / "ck", {"model": state})
    report = export(tmp_path / "ck", tmp_path / "out", format="zarr")
    assert report.tensors == 3
    assert sorted(os.listdir(tmp_path / "out")) == ["p", "p%5Cq", "x%5C..%5Cy", "zarr.json"]
    group = zarr.open_group(str(tmp_path / "out"), mode="r")
    mapping = ucp_attrs(group)["tensors"]
    for n, value in state.items():
        assert torch.equal(read_tensor(group[mapping[n]]), value)


# -- foreign checkpoints: pickles ----------------------------------------------------------------------


def _deepspeed_root(root: Path, *, model_extra: Any = None, optim_extra: Any = None, scheduler: Any = None) -> Path:
    """The smallest DeepSpeed ZeRO-2 checkpoint the importer reads (one rank, one 4-element param)."""
    tag = root / "global_step1"
    tag.mkdir(parents=True)
    (root / "latest").write_text("global_step1")
    w = torch.arange(4.0)
    model: dict[str, Any] = {
        "module": {"w": w.clone()},
        "param_shapes": [{"w": torch.Size([4])}],
        "global_steps": 1,
        "dp_world_size": 1,
    }
    if scheduler is not None:
        model["lr_scheduler"] = scheduler
    if model_extra is not None:
        model["extra"] = model_extra
    optim: dict[str, Any] = {
        "optimizer_state_dict": {
            "zero_stage": 2,
            "single_partition_of_fp32_groups": [w.clone()],
            "base_optimizer_state": {
                "state": {0: {"exp_avg": torch.zeros(4), "exp_avg_sq": torch.zeros(4), "step": 1}},
                "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.0}],
            },
            "param_alignment_paddings": [[0]],
            "group_paddings": [0],
        }
    }
    if optim_extra is not None:
        optim["extra"] = optim_extra
    torch.save(model, tag / "mp_rank_00_model_states.pt")
    torch.save(optim, tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    return root


def test_minimal_deepspeed_fixture_converts(tmp_path: Path) -> None:
    report = convert(_deepspeed_root(tmp_path / "ds"), tmp_path / "out")
    assert report.format == "deepspeed" and report.step == 1
    assert torch.equal(ucp.load(tmp_path / "out")["optimizer"]["fp32_master"]["w"], torch.arange(4.0))


@pytest.mark.parametrize("which", ["model", "optim"])
@pytest.mark.parametrize("payload", ["os.system", "builtins.eval", "subprocess.Popen"])
def test_deepspeed_pt_with_code_is_refused_and_never_run(tmp_path: Path, which: str, payload: str) -> None:
    marker = tmp_path / "PWNED"
    evil = _payloads(marker)[payload]
    root = _deepspeed_root(tmp_path / "ds", **{f"{which}_extra": evil})
    with pytest.raises(UnsafePickleError) as info:
        convert(root, tmp_path / "out")
    assert "_states.pt" in str(info.value) and "--trust-pickle" in str(info.value)
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_legacy_torch_archive_with_code_is_refused_and_never_run(tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    torch.save({"x": _payloads(marker)["os.system"]}, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    with pytest.raises(UnsafePickleError, match="legacy.pt"):
        load_torch(tmp_path / "legacy.pt")
    assert not marker.exists()


def test_torch_archive_entry_claiming_a_huge_size_is_a_clean_error(tmp_path: Path) -> None:
    path = tmp_path / "bomb.pt"
    torch.save({"a": torch.zeros(4)}, path)
    data = bytearray(path.read_bytes())
    patched, i = 0, 0
    while (i := data.find(b"PK\x01\x02", i)) >= 0:  # central directory entries
        name_len = struct.unpack_from("<H", data, i + 28)[0]
        if bytes(data[i + 46 : i + 46 + name_len]).endswith((b"data.pkl", b"data/0")):
            local = struct.unpack_from("<I", data, i + 42)[0]
            for at in (i + 20, i + 24, local + 18, local + 22):  # compressed / uncompressed sizes
                struct.pack_into("<I", data, at, 0xFFFFFFF0)
            patched += 1
        i += 4
    assert patched == 2
    path.write_bytes(data)
    with pytest.raises(ForeignCheckpointError, match="bomb.pt"):
        load_torch(path)


def _dcp(path: Path) -> Any:
    import torch.distributed.checkpoint as dcp

    from ucp.conversion.importers.dcp import read_metadata

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # single-process save, no process group
        dcp.save({"model": {"w": torch.arange(6.0)}, "lst": [1, 2], "step": 3}, checkpoint_id=str(path))
    return read_metadata(path)


def _write_metadata(path: Path, meta: Any) -> None:
    with open(path / ".metadata", "wb") as fh:
        pickle.dump(meta, fh)


@pytest.mark.parametrize("payload", ["os.system", "builtins.eval", "subprocess.Popen"])
def test_dcp_metadata_with_code_is_refused_and_never_run(tmp_path: Path, payload: str) -> None:
    marker = tmp_path / "PWNED"
    meta = _dcp(tmp_path / "dcp")
    meta.planner_data = {**meta.planner_data, "x": _payloads(marker)[payload]}
    _write_metadata(tmp_path / "dcp", meta)
    with pytest.raises(UnsafePickleError, match=r"\.metadata"):
        convert(tmp_path / "dcp", tmp_path / "out")
    assert not marker.exists() and not (tmp_path / "out").exists()


def _planner_index(meta: Any) -> None:
    meta.planner_data = {**meta.planner_data, "lst": ("lst", 1 << 40)}  # a list position 2^40


def _storage(field: str, value: Any) -> Any:
    def edit(meta: Any) -> None:
        data = dict(meta.storage_data)
        key = next(k for k in data if k.fqn == "lst")
        data[key] = dataclasses.replace(data[key], **{field: value})
        meta.storage_data = data

    return edit


@pytest.mark.parametrize(
    "edit",
    [_planner_index, _storage("length", 1 << 40), _storage("offset", -5), _storage("relative_path", ".")],
    ids=["planner-list-position", "storage-length", "storage-offset", "relative-path-dot"],
)
def test_dcp_metadata_absurd_values_are_foreign_checkpoint_errors(tmp_path: Path, edit: Any) -> None:
    meta = _dcp(tmp_path / "dcp")
    edit(meta)
    _write_metadata(tmp_path / "dcp", meta)
    with pytest.raises(ForeignCheckpointError, match="dcp"):
        convert(tmp_path / "dcp", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_dcp_metadata_pointing_outside_is_refused(tmp_path: Path) -> None:
    meta = _dcp(tmp_path / "dcp")
    _storage("relative_path", "/etc/passwd")(meta)
    _write_metadata(tmp_path / "dcp", meta)
    with pytest.raises(ForeignCheckpointError, match="outside the folder"):
        convert(tmp_path / "dcp", tmp_path / "out")


def test_deeply_nested_deepspeed_value_is_a_clean_error(tmp_path: Path) -> None:
    deep: Any = 1
    for _ in range(3000):
        deep = [deep]
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20_000)  # torch.save's pickler recurses
    try:
        root = _deepspeed_root(tmp_path / "ds", scheduler={"x": deep})
    finally:
        sys.setrecursionlimit(limit)
    with pytest.raises(ForeignCheckpointError, match="mp_rank_00_model_states.pt.*nested deeper"):
        convert(root, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# -- foreign checkpoints: paths ------------------------------------------------------------------------


def _hf(folder: Path, weight_map: dict[str, Any]) -> Path:
    folder.mkdir()
    save_file({"a": torch.zeros(2)}, str(folder / "model-00001-of-00001.safetensors"))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder


@pytest.mark.parametrize("shard", ["../../etc/passwd", "/etc/passwd", "..", "sub/../../x"])
def test_hf_index_naming_a_shard_outside_its_folder_is_refused(tmp_path: Path, shard: str) -> None:
    folder = _hf(tmp_path / "hf", {"a": shard})
    with pytest.raises(ForeignCheckpointError, match="outside its folder"):
        read(folder)
    with pytest.raises(ForeignCheckpointError, match="index.json"):
        convert(folder / "model.safetensors.index.json", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_hf_index_with_a_non_string_shard_name_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ForeignCheckpointError, match="index.json.*shard names must be strings, not 5"):
        read(_hf(tmp_path / "hf", {"a": 5}))


def _outside_tag(tmp_path: Path) -> Path:
    """A folder next to the DeepSpeed root (another run's checkpoint, say)."""
    other = tmp_path / "other-run"
    (other / "zero").mkdir(parents=True)
    return other


@pytest.mark.parametrize("kind", ["dotdot", "absolute"])
def test_deepspeed_latest_naming_a_folder_outside_the_root_is_refused(tmp_path: Path, kind: str) -> None:
    from ucp.conversion.importers.deepspeed import tag_dir

    other = _outside_tag(tmp_path)
    root = tmp_path / "ds"
    root.mkdir()
    (root / "latest").write_text("../other-run" if kind == "dotdot" else str(other))
    with pytest.raises(ForeignCheckpointError, match="latest"):
        tag_dir(root)


@pytest.mark.parametrize("text", ["", "\n", ".", "a/b", "global_step1\0x"])
def test_deepspeed_latest_must_name_a_plain_tag_folder(tmp_path: Path, text: str) -> None:
    from ucp.conversion.importers.deepspeed import tag_dir

    root = tmp_path / "ds"
    (root / "a" / "b").mkdir(parents=True)
    (root / "global_step1").mkdir()
    (root / "latest").write_text(text)
    with pytest.raises(ForeignCheckpointError, match="latest.*plain folder name"):
        tag_dir(root)


def test_deepspeed_latest_universal_naming_a_folder_outside_the_root_is_refused(tmp_path: Path) -> None:
    from ucp.conversion.importers.universal import universal_dir

    _outside_tag(tmp_path)
    root = tmp_path / "ds"
    root.mkdir()
    (root / "latest_universal").write_text("../other-run")
    with pytest.raises(ForeignCheckpointError, match="latest_universal"):
        universal_dir(root)


# -- shared memory staging (AsyncSaver mode="process") -------------------------------------------------


def test_process_staging_is_private_and_removed_after_the_writer_is_killed(tmp_path: Path) -> None:
    from ucp.saving.async_save import AsyncSaver

    saver = AsyncSaver(mode="process")
    try:
        saver.save({"w": torch.arange(1024.0)}, tmp_path / "ck", step=1).result(timeout=60)
        prefix = saver.pool.prefix
        staged = glob.glob(glob.escape(prefix) + "-*")
        assert staged and all(p.startswith("/dev/shm/") for p in staged)
        for p in staged:  # kept for reuse between saves: readable by this user only
            st = os.stat(p)
            assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.getuid(), p
        assert saver.writer_pid is not None  # mode="process": a writer process runs once a save started
        os.kill(saver.writer_pid, signal.SIGKILL)
    finally:
        saver.close()
    assert glob.glob(glob.escape(prefix) + "-*") == []
    assert torch.equal(ucp.load(tmp_path / "ck")["w"], torch.arange(1024.0))
    assert sorted(os.listdir(tmp_path)) == ["ck"]


# -- fixed file names in a user's directory --------------------------------------------------------------


@pytest.mark.parametrize("kind", ["file", "symlink"])
def test_tune_in_a_given_directory_never_touches_files_it_did_not_make(
    tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import aio.tune as tune

    monkeypatch.setattr(tune, "drop_page_cache", lambda: (False, "not in tests"))  # shared machine: keep its cache
    work, precious = tmp_path / "shared", tmp_path / "precious"
    work.mkdir()
    precious.write_bytes(b"keep me")
    if kind == "file":
        shutil.copy(precious, work / "ucp-tune.bin")
    else:
        (work / "ucp-tune.bin").symlink_to(precious)
    tune.run_tune(
        work,
        size=64 << 10,
        repeats=1,
        grid=tune.TuneGrid(engines=["threads"], block_sizes=[1 << 20], queue_depths=[8], thread_counts=[4]),
    )
    assert precious.read_bytes() == b"keep me"
    assert (work / "ucp-tune.bin").is_symlink() or (work / "ucp-tune.bin").read_bytes() == b"keep me"
