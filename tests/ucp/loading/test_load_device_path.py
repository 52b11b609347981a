"""Whole loads onto CUDA: which tensors KvikIO may read straight into device memory (``ucp.loading.device``),
which path each ``gds=`` option takes under each capability report, and the errors for impossible requests.
The choice runs on CPU; the GPU reads themselves are checked by ``tools/gpu_check_gds.py``."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

import ucp
from gds import CapabilityReport, capabilities
from ucp.format.manifest import BoxModel, FlatModel, Piece, TensorEntry
from ucp.loading.device import DevicePlan, choose_path, covers_whole, direct_tensors, plan_device_load
from ucp.loading.loader import _load_to_device
from ucp.store.reader import read_manifest
from ucp.store.storage import open_storage

NO_KVIKIO = "kvikio is not importable (ModuleNotFoundError: No module named 'kvikio'); pip install 'ucp[gds]'"


def caps(*, cuda: bool, kvikio: bool, cufile: bool = False) -> CapabilityReport:
    """A capability report as gds.capabilities() builds it, for a machine with/without a GPU and KvikIO."""
    reasons = [] if cuda else ["torch 2.x is a CPU-only build (torch.version.cuda is None)"]
    if not kvikio:
        reasons.append(NO_KVIKIO)
    usable = cuda and kvikio
    reasons.append("auto uses kvikio: ..." if usable else "auto uses staged: ...")
    return CapabilityReport(
        torch_version="2.x",
        torch_cuda_build="12.4" if cuda else None,
        cuda_available=cuda,
        device_count=1 if cuda else 0,
        device_names=["GPU"] if cuda else [],
        kvikio_importable=kvikio,
        kvikio_version="25.04" if kvikio else None,
        kvikio_error=None if kvikio else "ModuleNotFoundError: No module named 'kvikio'",
        kvikio_compat_mode=("OFF" if cufile else "ON") if kvikio else None,
        cufile_usable=usable and cufile,
        pinned_staging=cuda,
        aio_engine="threads",
        auto_mode="kvikio" if usable else "staged",
        reasons=reasons,
    )


def entry(shape: list[int], *pieces: tuple[str, list[int], list[int]] | tuple[str, int, int]) -> TensorEntry:
    """A float32 TensorEntry with ("box", offsets, shape) / ("flat", start, stop) pieces, laid end to end."""
    out, at = [], 0
    for kind, a, b in pieces:
        if kind == "box":
            assert isinstance(a, list) and isinstance(b, list)
            n = 1
            for s in b:
                n *= s
            out.append(Piece(file="d.safetensors", offset=at, length=4 * n, box=BoxModel(offsets=a, shape=b), crc32c=0))
        else:
            assert isinstance(a, int) and isinstance(b, int)
            n = b - a
            out.append(Piece(file="d.safetensors", offset=at, length=4 * n, flat=FlatModel(start=a, stop=b), crc32c=0))
        at += 4 * n
    return TensorEntry(dtype="F32", shape=shape, pieces=out)


def test_only_a_single_piece_covering_the_whole_tensor_qualifies() -> None:
    assert covers_whole(entry([4, 3], ("box", [0, 0], [4, 3])))
    assert covers_whole(entry([4, 3], ("flat", 0, 12)))  # a FlatShard holding all of it: same bytes, same order
    assert not covers_whole(entry([4, 3], ("box", [0, 0], [2, 3]), ("box", [2, 0], [2, 3])))  # TP/ZeRO-3 parts
    assert not covers_whole(entry([4, 3], ("flat", 0, 5), ("flat", 5, 12)))
    assert not covers_whole(entry([4, 3], ("box", [2, 0], [2, 3])))  # one piece, not all of the tensor
    assert not covers_whole(entry([4, 3], ("flat", 3, 12)))
    assert not covers_whole(entry([0, 3], ("box", [0, 0], [0, 3])))  # empty: nothing to read
    assert not covers_whole(TensorEntry(dtype="F32", shape=[0], pieces=[]))


def test_direct_tensors_of_a_real_checkpoint(tmp_path: Path) -> None:
    state = {
        "w": torch.randn(4, 3),
        "b": torch.arange(5, dtype=torch.int32),
        "f": ucp.FlatShard(torch.arange(6.0), (2, 3), 0),
        "e": torch.empty(0),
        "step": 3,
    }
    ucp.save(state, tmp_path / "c")
    storage, name = open_storage(tmp_path / "c")
    with storage:
        assert sorted(direct_tensors(read_manifest(storage, name))) == ["b", "f", "w"]


@pytest.mark.parametrize(
    ("gds", "verify", "report", "local", "direct", "why"),
    [
        ("off", False, caps(cuda=True, kvikio=True, cufile=True), True, False, "gds='off'"),
        ("auto", True, caps(cuda=True, kvikio=True, cufile=True), True, False, "verify=True: pieces are CRC-checked"),
        ("auto", False, caps(cuda=True, kvikio=True, cufile=True), True, True, "GPUDirect Storage via cuFile"),
        ("auto", False, caps(cuda=True, kvikio=True), True, True, "POSIX compatibility mode"),
        ("auto", False, caps(cuda=True, kvikio=False), True, False, "KvikIO not usable: kvikio is not importable"),
        ("auto", False, caps(cuda=False, kvikio=True), True, False, "KvikIO not usable: torch 2.x is a CPU-only"),
        ("auto", False, caps(cuda=True, kvikio=True), False, False, "not on local files"),
        ("on", False, caps(cuda=True, kvikio=True), True, True, "gds='on'"),
    ],
)
def test_the_path_chosen_for_each_option_and_machine(
    gds: str, verify: bool, report: CapabilityReport, local: bool, direct: bool, why: str
) -> None:
    chosen, reason = choose_path(gds, verify=verify, caps=report, local=local)  # type: ignore[arg-type]
    assert chosen is direct and why in reason


@pytest.mark.parametrize(
    ("report", "verify", "local", "message"),
    [
        (caps(cuda=True, kvikio=False), False, True, "gds='on' needs KvikIO.*" + "kvikio is not importable"),
        (caps(cuda=False, kvikio=True), False, True, "gds='on' needs KvikIO.*torch 2.x is a CPU-only build"),
        (caps(cuda=True, kvikio=True), False, False, "gds='on' needs the checkpoint on local files"),
        (caps(cuda=True, kvikio=True), True, True, "CRC-32C cannot be checked; pass verify=False"),
    ],
)
def test_gds_on_where_it_cannot_happen_is_a_clear_error(
    report: CapabilityReport, verify: bool, local: bool, message: str
) -> None:
    with pytest.raises(ucp.CheckpointError, match=message):
        choose_path("on", verify=verify, caps=report, local=local)


def test_the_plan_lists_the_direct_tensors_and_falls_back_when_none_qualify(tmp_path: Path) -> None:
    ucp.save({"w": torch.randn(4, 3), "e": torch.empty(0)}, tmp_path / "c")
    storage, name = open_storage(tmp_path / "c")
    with storage:
        m = read_manifest(storage, name)
        gpu = caps(cuda=True, kvikio=True, cufile=True)
        assert plan_device_load(storage, name, m, gds="auto", verify=False, caps=gpu) == DevicePlan(
            "gds", "gds='auto', verify=False and KvikIO usable (GPUDirect Storage via cuFile)", ["w"]
        )
        staged = plan_device_load(storage, name, m, gds="auto", verify=True, caps=gpu)
        assert staged.path == "staged" and staged.direct == []
        del m.tensors["w"]
        none = plan_device_load(storage, name, m, gds="on", verify=False, caps=gpu)
        assert none.path == "staged" and "no tensor is stored as one whole piece" in none.reason


def test_the_device_load_on_this_machine_stages_and_reports_why(tmp_path: Path) -> None:
    """The real capability report of this (GPU-less, KvikIO-less in CI) process: the staged path, bit-exact;
    gds='on' refused with gds's own reasons. (A CPU device stands in for CUDA to run the fill.)"""
    if capabilities().kvikio_usable:
        pytest.skip("KvikIO is usable here: the GPU check covers this machine")
    state = {"w": torch.randn(4, 3), "i": torch.arange(7, dtype=torch.int64)}
    ucp.save(state, tmp_path / "c")
    storage, name = open_storage(tmp_path / "c")
    with storage:
        m = read_manifest(storage, name)
        tensors, plan = _load_to_device(storage, name, m, torch.device("cpu"), verify=False, gds="auto")
        assert plan.path == "staged" and plan.reason.startswith("KvikIO not usable: ") and plan.direct == []
        assert all(torch.equal(tensors[k], v) for k, v in state.items())
        with pytest.raises(ucp.CheckpointError, match="gds='on' needs KvikIO") as info:
            _load_to_device(storage, name, m, torch.device("cpu"), verify=False, gds="on")
        missing = [r for r in capabilities().reasons if not r.startswith("auto uses")]
        assert all(r in str(info.value) for r in missing)


def test_bad_gds_requests_through_ucp_load(tmp_path: Path) -> None:
    ucp.save({"w": torch.ones(2)}, tmp_path / "c")
    with pytest.raises(ucp.CheckpointError, match="gds='yes': expected 'auto', 'on' or 'off'"):
        ucp.load(tmp_path / "c", gds="yes")  # type: ignore[call-overload]
    with pytest.raises(ucp.CheckpointError, match="gds='on' applies to whole loads with map_location='cuda'"):
        ucp.load(tmp_path / "c", gds="on")
    report = ucp.load(tmp_path / "c", strict=False)
    assert report.device_plan is None  # CPU loads: no device path to report
    if not torch.cuda.is_available():  # the CUDA refusal comes first, whatever gds asks for
        for gds in ("auto", "on", "off"):
            with pytest.raises(ucp.CheckpointError, match=r"map_location='cuda': CUDA is not available"):
                ucp.load(tmp_path / "c", map_location="cuda", gds=gds)


def test_aload_passes_gds_through(tmp_path: Path) -> None:
    ucp.save({"w": torch.ones(2)}, tmp_path / "c")
    with pytest.raises(ucp.CheckpointError, match="gds='on' applies to whole loads with map_location='cuda'"):
        asyncio.run(ucp.aload(tmp_path / "c", gds="on"))
    assert torch.equal(asyncio.run(ucp.aload(tmp_path / "c", gds="off"))["w"], torch.ones(2))
