"""A storage backend for torch.distributed.checkpoint (DCP) that reads and writes UCP checkpoints::

    import torch.distributed.checkpoint as dcp
    import ucp.dcp

    dcp.save(state, storage_writer=ucp.dcp.Writer("ckpt/step-100"))
    dcp.load(state, storage_reader=ucp.dcp.Reader("ckpt/step-100"))

What is written is an ordinary UCP checkpoint (safetensors data files and manifest.json, no pickle,
CRC-32C checksums, O_DIRECT writes, atomic commit): ``ucp.load``, ``ucp verify``, ``ucp reshape``
and ``ucp export`` take it, and :class:`Reader` also reads checkpoints ``ucp.save`` wrote. See
:mod:`ucp.dcp.mapping` for how DCP's keys, chunks and plain values map to the manifest.
"""

from ucp.dcp.reader import Reader
from ucp.dcp.writer import Writer

__all__ = ["Reader", "Writer"]
