"""The capability report: import never fails, and the report says what is missing and why."""

from __future__ import annotations

import importlib.abc
import json
import subprocess
import sys

import pytest
import torch
from gds_helpers import fresh_capability_probe  # noqa: F401 - an autouse fixture

import gds
from gds.capability import KvikioProbe, TorchProbe, decide, probe_kvikio

NO_CUDA = not torch.cuda.is_available()


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA; the CPU-only report does not apply")
def test_cpu_only_report_says_staged_and_why() -> None:
    caps = gds.capabilities()
    assert isinstance(caps, gds.CapabilityReport)
    assert not caps.cuda_available and caps.device_count == 0 and caps.device_names == []
    assert caps.auto_mode == "staged"
    assert not caps.cufile_usable and not caps.kvikio_usable
    why = " ".join(caps.reasons)
    assert "is_available() is False" in why or "CPU-only build" in why
    if not caps.kvikio_importable:
        assert "kvikio is not importable" in why and "ucp[gds]" in why
    assert caps.reasons[-1].startswith("auto uses staged")


def test_report_prints_text_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    text = gds.report()
    assert "auto mode:" in text and text in capsys.readouterr().out
    js = gds.report(as_json=True)
    again = gds.CapabilityReport.model_validate_json(js)
    assert again == gds.capabilities()


def test_python_m_gds_runs() -> None:
    out = subprocess.run([sys.executable, "-m", "gds", "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["auto_mode"] in ("kvikio", "staged") and data["reasons"]


class _BrokenKvikio(importlib.abc.MetaPathFinder):
    """Imitates a half-installed KvikIO whose native library fails to load."""

    def find_spec(self, name, path=None, target=None):  # noqa: ANN001 - importlib protocol
        if name == "kvikio":
            raise OSError("libkvikio.so: cannot open shared object file")
        return None


def test_kvikio_failing_with_oserror_is_reported_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "kvikio", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_BrokenKvikio(), *sys.meta_path])
    probe = probe_kvikio()
    assert not probe.importable and "OSError" in (probe.error or "")
    caps = gds.capabilities(refresh=True)
    assert not caps.kvikio_importable and caps.auto_mode == "staged"
    assert any("libkvikio.so" in r for r in caps.reasons)


GPU = TorchProbe("2.x", "12.4", True, ["NVIDIA H100"])
CPU_WHEEL = TorchProbe("2.x+cpu", None, False)
NO_DRIVER = TorchProbe("2.x", "12.4", False)
HIDDEN = TorchProbe("2.x", "12.4", False, visible_devices="")
KV_GDS = KvikioProbe(True, version="25.06", compat_setting="AUTO", compat_preferred=False)
KV_COMPAT = KvikioProbe(True, version="25.06", compat_setting="ON", compat_preferred=True)
KV_MISSING = KvikioProbe(False, error="ModuleNotFoundError: No module named 'kvikio'")


def test_decide_gpu_and_cufile_picks_kvikio() -> None:
    mode, cufile, reasons = decide(GPU, KV_GDS)
    assert (mode, cufile) == ("kvikio", True)
    assert "GPUDirect" in reasons[-1]


def test_decide_compat_mode_still_kvikio_but_says_no_gds() -> None:
    mode, cufile, reasons = decide(GPU, KV_COMPAT)
    assert (mode, cufile) == ("kvikio", False)
    assert any("compatibility mode" in r and "compat_mode=ON" in r for r in reasons)


def test_decide_kvikio_without_gpu_stays_staged() -> None:
    # KvikIO imports on CPU-only machines, but every read/write would fail for lack of libcuda.
    mode, cufile, reasons = decide(CPU_WHEEL, KV_GDS)
    assert (mode, cufile) == ("staged", False)
    assert any("CPU-only build" in r for r in reasons)


@pytest.mark.parametrize(
    ("probe", "phrase"),
    [(NO_DRIVER, "is_available() is False"), (HIDDEN, "CUDA_VISIBLE_DEVICES")],
)
def test_decide_names_the_missing_gpu_piece(probe: TorchProbe, phrase: str) -> None:
    mode, _, reasons = decide(probe, KV_MISSING)
    assert mode == "staged"
    assert any(phrase in r for r in reasons)
    assert any("kvikio is not importable" in r for r in reasons)
