"""Whole loads onto a CUDA device: which tensors KvikIO (``gds``) reads straight into device memory.

``ucp.load(path, map_location="cuda")`` fills device tensors through host staging (the ``into=``
planner), where every piece's CRC-32C is checked. KvikIO can instead read a tensor's bytes from the
safetensors file straight into the device tensor (GPUDirect Storage where cuFile works), but those
bytes never pass through host memory, so they cannot be checked there without a second copy. Hence:

* ``gds="off"``: always the staged, checked path.
* ``gds="auto"`` (default): direct reads only with ``verify=False``, KvikIO usable
  (``gds.capabilities().kvikio_usable``) and the checkpoint on local files; otherwise staged.
* ``gds="on"``: direct reads required; a CheckpointError when KvikIO is not usable (naming the
  missing pieces from ``gds.capabilities()``), the storage is not local, or ``verify=True``.

Only a tensor stored as one piece covering it whole qualifies (its bytes are one contiguous run in
one file, in the tensor's own order); pieces of sharded tensors keep the staged path. The chosen
path, its reason and the tensors read directly are returned as a :class:`DevicePlan` (on
``LoadReport.device_plan`` for ``strict=False`` loads, and logged at DEBUG on ``ucp.load``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Literal

import torch

from gds import CapabilityReport
from ucp.errors import CheckpointError
from ucp.format.manifest import Manifest, TensorEntry
from ucp.store.storage import Storage

GdsOption = Literal["auto", "on", "off"]
GDS_OPTIONS: tuple[str, ...] = ("auto", "on", "off")

log = logging.getLogger("ucp.load")


@dataclass(frozen=True)
class DevicePlan:
    """How a whole load onto a device moves its bytes: ``path`` is ``"gds"`` when some tensors are read by
    KvikIO straight into device memory (``direct``, not CRC-checked), else ``"staged"`` (every piece
    through host staging, CRC-checked when ``verify``); ``reason`` says why."""

    path: Literal["gds", "staged"]
    reason: str
    direct: list[str] = field(default_factory=list)


def check_gds_option(gds: object) -> GdsOption:
    """``gds`` as one of "auto", "on", "off", or a CheckpointError naming the bad value."""
    if gds not in GDS_OPTIONS:
        raise CheckpointError(f"gds={gds!r}: expected 'auto', 'on' or 'off'")
    return gds  # type: ignore[return-value]


def covers_whole(entry: TensorEntry) -> bool:
    """The tensor is stored as one non-empty piece holding all of it (not a FlatShard/Box part), so its bytes
    are one contiguous run of the file in the tensor's row-major order."""
    if len(entry.pieces) != 1 or entry.nbytes == 0:
        return False
    p = entry.pieces[0]
    if p.length != entry.nbytes:
        return False
    if p.box is not None:
        return all(o == 0 for o in p.box.offsets) and list(p.box.shape) == list(entry.shape)
    return p.flat is not None and p.flat.start == 0 and p.flat.stop == entry.numel


def direct_tensors(manifest: Manifest) -> list[str]:
    """The tensors whose stored piece covers them whole: those KvikIO may read straight into the device."""
    return [n for n, e in manifest.tensors.items() if covers_whole(e)]


def _missing(caps: CapabilityReport) -> str:
    return "; ".join(r for r in caps.reasons if not r.startswith("auto uses")) or "KvikIO is not usable"


def choose_path(gds: GdsOption, *, verify: bool, caps: CapabilityReport, local: bool) -> tuple[bool, str]:
    """``(direct, reason)``: whether qualifying tensors are read by KvikIO, and why (see the module doc).
    A CheckpointError for ``gds="on"`` where direct reads cannot happen."""
    if gds == "off":
        return False, "gds='off': every piece through host staging"
    if gds == "on":
        if not caps.kvikio_usable:
            raise CheckpointError(
                f"gds='on' needs KvikIO reading into a GPU, which is not usable here: {_missing(caps)}"
            )
        if not local:
            raise CheckpointError("gds='on' needs the checkpoint on local files (KvikIO reads file paths)")
        if verify:
            raise CheckpointError(
                "gds='on' reads tensors straight into device memory, where their CRC-32C cannot be checked; "
                "pass verify=False with it (or gds='auto'/'off' to keep checked, staged reads)"
            )
        return True, "gds='on'"
    if verify:
        return False, "verify=True: pieces are CRC-checked in host staging (pass verify=False to allow KvikIO)"
    if not caps.kvikio_usable:
        return False, f"KvikIO not usable: {_missing(caps)}"
    if not local:
        return False, "the checkpoint is not on local files (KvikIO reads file paths)"
    how = "GPUDirect Storage via cuFile" if caps.cufile_usable else "KvikIO's POSIX compatibility mode"
    return True, f"gds='auto', verify=False and KvikIO usable ({how})"


def plan_device_load(
    storage: Storage, name: str, manifest: Manifest, *, gds: GdsOption, verify: bool, caps: CapabilityReport
) -> DevicePlan:
    """Choose the path for a whole load onto a CUDA device, and the tensors KvikIO reads directly."""
    local = storage.local_path(name) is not None
    direct, reason = choose_path(gds, verify=verify, caps=caps, local=local)
    names = direct_tensors(manifest) if direct else []
    if direct and not names:
        reason += ", but no tensor is stored as one whole piece"
    plan = DevicePlan("gds" if names else "staged", reason, names)
    log.debug("load %s onto device: path=%s (%s), %d tensor(s) direct", name, plan.path, plan.reason, len(names))
    return plan


def read_direct(
    storage: Storage, name: str, manifest: Manifest, tensors: dict[str, torch.Tensor], plan: DevicePlan
) -> None:
    """Read each of ``plan.direct`` from its safetensors file at its data offset into its device tensor
    (``gds.GdsHandle`` in kvikio mode; a short read or a KvikIO failure is an ``aio.AioError`` naming the file)."""
    if not plan.direct:
        return
    from gds import GdsHandle

    with GdsHandle(mode="kvikio") as handle:
        for tname in plan.direct:
            piece = manifest.tensors[tname].pieces[0]
            rel = f"{name}/{piece.file}"
            storage.check_contained(rel)
            path = storage.local_path(rel)
            assert path is not None  # plan_device_load chose direct reads only for local storage
            handle.read_into_tensor(path, tensors[tname], offset=piece.offset)
