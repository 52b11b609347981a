"""gds: aio's API for tensors on any device, GPUDirect Storage where the machine allows.

Typical use::

    import gds
    with gds.GdsHandle() as h:                 # mode="auto": kvikio or staged
        h.write_tensor("w.bin", t)             # the file holds t's raw bytes
        u = h.read_tensor("w.bin", t.dtype, t.shape, device="cuda")
    print(gds.capabilities().auto_mode)        # and why: gds.report() / python -m gds

Importing this package never touches the GPU or KvikIO; probing happens on
the first ``capabilities()`` call or handle construction.
"""

from .capability import CapabilityReport, capabilities, report
from .handle import GdsHandle
from .staged import DEFAULT_STAGING_BYTES

__all__ = ["DEFAULT_STAGING_BYTES", "CapabilityReport", "GdsHandle", "capabilities", "report"]
