"""What this machine can do for tensor I/O, and why ``auto`` picks the path it picks.

GPUDirect Storage needs four things at once: a CUDA build of torch, a visible
GPU with its driver, the KvikIO package, and cuFile actually usable (otherwise
KvikIO silently runs in its POSIX "compatibility mode"). When any piece is
missing the user deserves a sentence saying which one, not a stack trace, so
every probe here catches everything and turns it into a reason.

Nothing is probed at import time: ``import gds`` must work on any machine.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

PathName = Literal["kvikio", "staged"]

INSTALL_HINT = "pip install 'ucp[gds]' (installs kvikio-cu12)"


class CapabilityReport(BaseModel):
    """A snapshot of the GPU/GDS stack as seen from this process."""

    model_config = ConfigDict(frozen=True)

    torch_version: str
    torch_cuda_build: str | None = Field(description="CUDA version torch was built with; None for CPU-only wheels")
    cuda_available: bool = Field(description="torch.cuda.is_available()")
    device_count: int
    device_names: list[str]
    kvikio_importable: bool
    kvikio_version: str | None = None
    kvikio_error: str | None = Field(None, description="why `import kvikio` failed")
    kvikio_compat_mode: str | None = Field(None, description="KvikIO's compat_mode setting (ON/OFF/AUTO)")
    cufile_usable: bool = Field(description="KvikIO would use cuFile (GPUDirect), not its POSIX fallback")
    pinned_staging: bool = Field(description="staging buffers get pinned (cudaHostRegister) for async copies")
    aio_engine: str = Field(description="the engine aio's `auto` picks for host I/O")
    auto_mode: PathName = Field(description="the path GdsHandle(mode='auto') uses for CUDA tensors")
    reasons: list[str] = Field(description="why auto_mode was chosen; one line per missing piece")

    @property
    def kvikio_usable(self) -> bool:
        """KvikIO can move bytes to a GPU here (with or without cuFile underneath)."""
        return self.cuda_available and self.kvikio_importable

    def summary(self) -> str:
        """A human-readable multi-line report."""
        yes = {True: "yes", False: "no"}
        gpus = ", ".join(self.device_names) if self.device_names else "none"
        if self.kvikio_importable:
            kv = f"{self.kvikio_version} (compat_mode={self.kvikio_compat_mode})"
        else:
            kv = f"not importable ({self.kvikio_error})"
        lines = [
            "gds capability report",
            f"  torch:            {self.torch_version} (CUDA build: {self.torch_cuda_build or 'none, CPU-only wheel'})",
            f"  CUDA available:   {yes[self.cuda_available]}",
            f"  GPUs:             {self.device_count} ({gpus})",
            f"  kvikio:           {kv}",
            f"  cuFile/GDS:       {'usable' if self.cufile_usable else 'not usable'}",
            f"  pinned staging:   {yes[self.pinned_staging]}",
            f"  aio engine:       {self.aio_engine}",
            f"  auto mode:        {self.auto_mode}",
            "  why:",
        ]
        lines += [f"    - {r}" for r in self.reasons]
        return "\n".join(lines)


@dataclass
class TorchProbe:
    version: str
    cuda_build: str | None
    available: bool
    names: list[str] = field(default_factory=list)
    visible_devices: str | None = None


@dataclass
class KvikioProbe:
    importable: bool
    version: str | None = None
    error: str | None = None
    compat_setting: str | None = None
    compat_preferred: bool | None = None  # None: could not be determined


def probe_torch() -> TorchProbe:
    import torch

    cuda_build = getattr(torch.version, "cuda", None)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        available = bool(torch.cuda.is_available())
    except Exception:  # a broken driver may raise instead of answering False
        available = False
    names: list[str] = []
    if available:
        for i in range(torch.cuda.device_count()):
            try:
                names.append(torch.cuda.get_device_name(i))
            except Exception as exc:  # pragma: no cover - GPU only
                names.append(f"<device {i}: {exc}>")
    return TorchProbe(torch.__version__, cuda_build, available, names, visible)


def probe_kvikio() -> KvikioProbe:
    """Import KvikIO and ask it whether it would run cuFile or its POSIX fallback.

    Any exception counts as "not importable": a half-installed KvikIO raises
    OSError (missing libkvikio/libcuda) rather than ImportError.
    """
    try:
        import kvikio
    except Exception as exc:
        return KvikioProbe(False, error=f"{type(exc).__name__}: {exc}")
    probe = KvikioProbe(True, version=str(getattr(kvikio, "__version__", "unknown")))
    defaults: Any = getattr(kvikio, "defaults", None)
    try:
        if hasattr(defaults, "is_compat_mode_preferred"):  # KvikIO >= 25.04
            probe.compat_setting = _enum_name(defaults.get("compat_mode"))
            probe.compat_preferred = bool(defaults.is_compat_mode_preferred())
        elif hasattr(defaults, "compat_mode"):  # older releases return a bool
            probe.compat_preferred = bool(defaults.compat_mode())
            probe.compat_setting = "ON" if probe.compat_preferred else "OFF"
    except Exception as exc:  # pragma: no cover - depends on the KvikIO build
        probe.error = f"could not read kvikio.defaults: {exc}"
    return probe


def _enum_name(value: object) -> str:
    name = getattr(value, "name", None)
    return str(name if name is not None else value)


def decide(torch_probe: TorchProbe, kv: KvikioProbe) -> tuple[PathName, bool, list[str]]:
    """Choose the path for CUDA tensors: ``(auto_mode, cufile_usable, reasons)``.

    KvikIO is chosen only when torch sees a GPU *and* KvikIO imports: KvikIO
    imports fine on a CPU-only machine but every read/write then fails for lack
    of libcuda, so importability alone proves nothing.
    """
    reasons: list[str] = []
    if not torch_probe.available:
        if torch_probe.cuda_build is None:
            reasons.append(f"torch {torch_probe.version} is a CPU-only build (torch.version.cuda is None)")
        elif torch_probe.visible_devices is not None and not torch_probe.visible_devices.strip():
            reasons.append("CUDA_VISIBLE_DEVICES is set to an empty string, hiding every GPU")
        else:
            reasons.append(
                f"torch is built for CUDA {torch_probe.cuda_build} but torch.cuda.is_available() is False "
                "(no GPU, or the NVIDIA driver is missing or too old)"
            )
    if not kv.importable:
        reasons.append(f"kvikio is not importable ({kv.error}); {INSTALL_HINT}")
    cufile = torch_probe.available and kv.importable and kv.compat_preferred is False
    if torch_probe.available and kv.importable and not cufile:
        if kv.compat_preferred is None:
            reasons.append("could not tell whether KvikIO would use cuFile; assuming its POSIX compatibility mode")
        else:
            reasons.append(
                f"KvikIO runs in compatibility mode (compat_mode={kv.compat_setting}): libcufile.so missing, "
                "/run/udev unreadable, or KVIKIO_COMPAT_MODE=ON; it still reads into GPU memory, through "
                "POSIX I/O and bounce buffers instead of GPUDirect"
            )
    if torch_probe.available and kv.importable:
        how = "GPUDirect Storage via cuFile" if cufile else "KvikIO's POSIX path"
        reasons.append(f"auto uses kvikio: a GPU is visible and kvikio {kv.version} imports ({how})")
        return "kvikio", cufile, reasons
    reasons.append(
        "auto uses staged: aio moves the bytes through pinned host staging buffers, "
        "copied to/from the GPU asynchronously on a side CUDA stream"
    )
    return "staged", False, reasons


@functools.lru_cache(maxsize=1)
def _cached() -> CapabilityReport:
    from aio import libaio_status

    tp = probe_torch()
    kv = probe_kvikio()
    mode, cufile, reasons = decide(tp, kv)
    libaio_ok, libaio_why = libaio_status()
    return CapabilityReport(
        torch_version=tp.version,
        torch_cuda_build=tp.cuda_build,
        cuda_available=tp.available,
        device_count=len(tp.names),
        device_names=tp.names,
        kvikio_importable=kv.importable,
        kvikio_version=kv.version,
        kvikio_error=kv.error,
        kvikio_compat_mode=kv.compat_setting,
        cufile_usable=cufile,
        pinned_staging=tp.available,
        aio_engine="libaio" if libaio_ok else f"threads ({libaio_why})",
        auto_mode=mode,
        reasons=reasons,
    )


def capabilities(*, refresh: bool = False) -> CapabilityReport:
    """The capability report, probed once per process (``refresh=True`` probes again)."""
    if refresh:
        _cached.cache_clear()
    return _cached()


def report(*, as_json: bool = False, refresh: bool = False) -> str:
    """Print the capability report (text, or JSON with ``as_json``) and return what was printed."""
    caps = capabilities(refresh=refresh)
    text = caps.model_dump_json(indent=2) if as_json else caps.summary()
    print(text)
    return text
