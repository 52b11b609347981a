"""gds on a machine without CUDA: bad arguments, odd tensors and half-built handles.

Refused inputs (quantized tensors, non-integer sizes and offsets, a config of the
wrong type, a GPU this process cannot use) fail with an error naming the argument
or file at fault, and a handle whose construction fails leaves no aio engine
running. Everything here runs on the CPU (the CUDA cases check what a CPU-only
user gets).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from gds_helpers import fresh_capability_probe  # noqa: F401 - an autouse fixture

import gds
from aio import AioConfig, AioError
from gds import handle as gds_handle

NO_CUDA = not torch.cuda.is_available()


class _TrackedAioHandle(gds_handle.AioHandle):
    """Records every AioHandle a GdsHandle opens, so a test can see whether it was released."""

    made: list["_TrackedAioHandle"] = []

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003 - passes through
        super().__init__(*args, **kwargs)
        _TrackedAioHandle.made.append(self)


@pytest.fixture
def tracked(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[_TrackedAioHandle]]:
    _TrackedAioHandle.made = []
    monkeypatch.setattr(gds_handle, "AioHandle", _TrackedAioHandle)
    yield _TrackedAioHandle.made
    for h in _TrackedAioHandle.made:  # do not leave engines (libaio reaper threads) behind
        h.close()


def _fake_gpu_report() -> gds.CapabilityReport:
    """What capabilities() says on a GPU machine whose KvikIO import then fails at first use."""
    return gds.CapabilityReport(
        torch_version=torch.__version__,
        torch_cuda_build="12.4",
        cuda_available=True,
        device_count=1,
        device_names=["fake GPU"],
        kvikio_importable=True,
        kvikio_version="25.06",
        cufile_usable=False,
        pinned_staging=True,
        aio_engine="threads",
        auto_mode="kvikio",
        reasons=["auto uses kvikio: faked"],
    )


# -- refused inputs and failed constructions -------------------------------------------------------


def test_quantized_tensor_is_refused_not_a_segfault(tmp_path: Path) -> None:
    # In a child process: were the tensor let through, copying its bytes would crash the interpreter.
    target, source = tmp_path / "q.bin", tmp_path / "src.bin"
    source.write_bytes(bytes(8))
    probe = (
        "import warnings, torch, gds\n"
        "from aio import AioConfig\n"
        "warnings.simplefilter('ignore')\n"
        "q = torch.quantize_per_tensor(torch.ones(8), 0.1, 0, torch.quint8)\n"
        "with gds.GdsHandle(AioConfig(fsync=False), mode='staged') as h:\n"
        f"    write = lambda: h.write_tensor({str(target)!r}, q)\n"
        f"    read = lambda: h.read_into_tensor({str(source)!r}, q)\n"
        "    for call in (write, read):\n"
        "        try:\n"
        "            call()\n"
        "        except ValueError as exc:\n"
        "            print('refused:', exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"process died with {done.returncode}: {done.stderr[-500:]}"
    refusals = [line for line in done.stdout.splitlines() if line.startswith("refused:")]
    assert len(refusals) == 2, done.stdout
    assert "quantized" in refusals[0] and "quint8[8]" in refusals[0] and str(target) in refusals[0]
    assert "quantized" in refusals[1] and str(source) in refusals[1]
    assert not target.exists()


def _no_engine_left_open(tracked: list[_TrackedAioHandle]) -> bool:
    """True when every AioHandle a failed construction opened (possibly none) is closed again."""
    return all(h.closed for h in tracked)


def test_tracker_sees_the_engine_of_a_good_handle(tracked: list) -> None:
    with gds.GdsHandle(AioConfig(engine="threads", fsync=False), mode="staged") as h:
        assert tracked == [h.io] and not h.io.closed
    assert tracked[0].closed


def test_bad_staging_bytes_releases_the_aio_engine(tracked: list) -> None:
    with pytest.raises(ValueError, match="staging_bytes"):
        gds.GdsHandle(AioConfig(), mode="staged", staging_bytes=0)
    assert _no_engine_left_open(tracked)


def test_kvikio_failure_at_construction_releases_the_aio_engine(tracked: list, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gds_handle, "capabilities", _fake_gpu_report)
    monkeypatch.setitem(sys.modules, "kvikio", None)  # `import kvikio` now raises ImportError
    with pytest.raises(ImportError):
        gds.GdsHandle(AioConfig(engine="threads"), mode="kvikio")
    assert _no_engine_left_open(tracked)


def test_failure_after_the_engine_opened_closes_it(tracked: list, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_staging(*args: object, **kwargs: object) -> None:
        raise MemoryError("no staging memory")

    monkeypatch.setattr(gds_handle, "StagedPath", broken_staging)
    with pytest.raises(MemoryError):
        gds.GdsHandle(AioConfig(engine="threads"), mode="staged")
    assert len(tracked) == 1 and _no_engine_left_open(tracked)


@pytest.mark.skipif(not NO_CUDA, reason="CUDA is available here")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda")])
@pytest.mark.parametrize("exists", [True, False])
def test_read_tensor_to_cuda_without_cuda_is_a_clear_error(
    tmp_path: Path, device: str | torch.device, exists: bool
) -> None:
    path = tmp_path / "w.bin"
    if exists:
        path.write_bytes(bytes(16))
    with gds.GdsHandle(AioConfig(fsync=False)) as h:
        with pytest.raises(RuntimeError) as info:
            h.read_tensor(path, torch.float32, (4,), device=device)
    msg = str(info.value)
    assert not isinstance(info.value, AssertionError)
    assert str(path) in msg and f"tensor on {torch.device(device)}" in msg
    assert gds.capabilities().reasons[0] in msg  # why CUDA is missing, as `python -m gds` says it


def test_read_tensor_to_a_gpu_this_process_does_not_see(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gds_handle, "capabilities", _fake_gpu_report)  # one GPU
    path = tmp_path / "w.bin"
    path.write_bytes(bytes(16))
    with gds.GdsHandle(AioConfig(engine="threads", fsync=False), mode="staged") as h:
        with pytest.raises(RuntimeError, match=r"tensor on cuda:1: this process sees 1 GPU") as info:
            h.read_tensor(path, torch.float32, (4,), device="cuda:1")
    assert str(path) in str(info.value)


def test_config_as_dict_is_read_like_ucp_aio_config(tmp_path: Path) -> None:
    with gds.GdsHandle({"fsync": False, "engine": "threads"}, mode="staged") as h:
        h.write_tensor(tmp_path / "a.bin", torch.arange(4.0))
        assert h.config.fsync is False and h.io.engine_name == "threads"
    assert (tmp_path / "a.bin").read_bytes() == torch.arange(4.0).numpy().tobytes()
    deepspeed = {"aio": {"block_size": 1 << 20, "intra_op_parallelism": 2, "use_gds": False}}
    with gds.GdsHandle(deepspeed, mode="staged") as h:
        assert h.config == AioConfig.from_deepspeed(deepspeed)


def test_bad_config_names_config(tracked: list) -> None:
    with pytest.raises(ValueError, match="(?s)config is not a valid aio configuration.*no_such_key"):
        gds.GdsHandle({"no_such_key": 1}, mode="staged")
    with pytest.raises(TypeError, match="config must be an AioConfig.*got str"):
        gds.GdsHandle("threads", mode="staged")  # type: ignore[arg-type]
    assert tracked == []


@pytest.mark.parametrize("case", ["staging-float", "staging-none", "offset-float", "offset-str"])
def test_bad_numeric_arguments_name_themselves(tmp_path: Path, case: str) -> None:
    path = tmp_path / "a.bin"
    path.write_bytes(bytes(64))
    name = "offset" if case.startswith("offset") else "staging_bytes"
    with pytest.raises(TypeError, match=f"{name} must be an integer") as info:
        if case == "staging-float":
            gds.GdsHandle(AioConfig(engine="threads", fsync=False), mode="staged", staging_bytes=65536.5)  # type: ignore[arg-type]
        elif case == "staging-none":
            gds.GdsHandle(AioConfig(engine="threads", fsync=False), mode="staged", staging_bytes=None)  # type: ignore[arg-type]
        else:
            with gds.GdsHandle(AioConfig(engine="threads", fsync=False), mode="staged") as h:
                offset = 4.0 if case == "offset-float" else "4"
                h.read_into_tensor(path, torch.empty(4), offset=offset)  # type: ignore[arg-type]
    if name == "offset":
        assert str(path) in str(info.value)


def test_integer_like_staging_bytes_are_rounded_to_the_alignment(tmp_path: Path) -> None:
    import numpy as np

    with gds.GdsHandle(AioConfig(engine="threads", fsync=False), mode="staged", staging_bytes=np.int64(5000)) as h:
        assert h._staged.staging_bytes == 8192 and type(h._staged.staging_bytes) is int
        t = torch.arange(5000, dtype=torch.int32)  # 20000 bytes: three chunks
        h.write_tensor(tmp_path / "t.bin", t)
        assert torch.equal(h.read_tensor(tmp_path / "t.bin", t.dtype, t.shape), t)


# -- what works ------------------------------------------------------------------------------------


@pytest.mark.skipif(not NO_CUDA, reason="CUDA is available here")
def test_cpu_machine_auto_mode_is_staged_and_kvikio_refused_with_reason() -> None:
    with gds.GdsHandle(AioConfig(engine="threads", fsync=False)) as h:
        assert h.mode == "staged" and h._kvikio is None
    with pytest.raises(RuntimeError, match="mode='kvikio' is not available on this machine: .*CPU-only|is_available"):
        gds.GdsHandle(AioConfig(engine="threads"), mode="kvikio")


def test_errors_name_the_file(tmp_path: Path) -> None:
    with gds.GdsHandle(AioConfig(engine="threads", fsync=False), mode="staged") as h:
        with pytest.raises(AioError) as missing_parent:
            h.write_tensor(tmp_path / "no" / "such" / "dir" / "t.bin", torch.ones(3))
        assert missing_parent.value.filename == str(tmp_path / "no" / "such" / "dir" / "t.bin")
        with pytest.raises(AioError) as is_dir:
            h.write_tensor(tmp_path, torch.ones(3))
        assert is_dir.value.filename == str(tmp_path)
        with pytest.raises(ValueError, match="meta tensor"):
            h.write_tensor(tmp_path / "m.bin", torch.empty(3, device="meta"))
        with pytest.raises(ValueError, match="layout"):
            h.write_tensor(tmp_path / "s.bin", torch.eye(3).to_sparse())
        assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_read_into_accepts_integer_like_offsets(tmp_path: Path) -> None:
    import numpy as np

    path = tmp_path / "r.bin"
    path.write_bytes(bytes(range(64)))
    with gds.GdsHandle(AioConfig(engine="threads", fsync=False), mode="staged") as h:
        out = torch.empty(4, dtype=torch.uint8)
        h.read_into_tensor(path, out, offset=np.int64(8))
        assert out.tolist() == [8, 9, 10, 11]
        # bytes paths work too, though the annotation does not promise them
        assert h.read_tensor(str(path).encode(), torch.uint8, (2,)).tolist() == [0, 1]  # type: ignore[arg-type]


def test_python_m_gds_json_on_this_machine_says_why() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "gds", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**__import__("os").environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert done.returncode == 0, done.stderr
    report = gds.CapabilityReport.model_validate_json(done.stdout)
    assert report.auto_mode == "staged" and not report.cuda_available
    assert report.reasons[-1].startswith("auto uses staged")
