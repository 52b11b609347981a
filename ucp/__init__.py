"""UCP: checkpoints for large-model training — safetensors data files plus a JSON manifest.

::

    import ucp
    ucp.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": 100}, "ckpt/step-100")
    state = ucp.load("ckpt/step-100")                       # everything, sharded tensors assembled
    ucp.load("ckpt/step-100", into={"model": model.state_dict()})   # in place, only the bytes needed

The format is specified in docs/format.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aio.lazy import lazy_exports

# Public name -> the submodule defining it. Resolved on first use (PEP 562), so that importing
# ``ucp`` (or any of its submodules, e.g. the command line) does not import torch: commands that
# read a whole checkpoint start prefetching it before they pay for that import.
_EXPORTS: dict[str, tuple[str, str]] = {
    "AsyncSaver": ("async_saving", "AsyncSaver"),
    "SaveHandle": ("async_saving", "SaveHandle"),
    "aload": ("async_saving", "aload"),
    "asave": ("async_saving", "asave"),
    "async_save": ("async_saving", "async_save"),
    "CheckpointError": ("errors", "CheckpointError"),
    "CommitError": ("errors", "CommitError"),
    "CorruptCheckpointError": ("errors", "CorruptCheckpointError"),
    "LayoutMismatchError": ("errors", "LayoutMismatchError"),
    "ManifestError": ("errors", "ManifestError"),
    "MissingDataError": ("errors", "MissingDataError"),
    "NotACheckpointError": ("errors", "NotACheckpointError"),
    "UnsupportedFormatError": ("errors", "UnsupportedFormatError"),
    "UnsupportedStateError": ("errors", "UnsupportedStateError"),
    "SnapshotChangedError": ("errors", "SnapshotChangedError"),
    "load": ("loading", "load"),
    "read_manifest": ("reader", "read_checkpoint_manifest"),
    "CheckpointInfo": ("manager", "CheckpointInfo"),
    "CheckpointManager": ("manager", "CheckpointManager"),
    "FORMAT_VERSION": ("manifest", "FORMAT_VERSION"),
    "Manifest": ("manifest", "Manifest"),
    "parse_manifest": ("manifest", "parse_manifest"),
    "save": ("saving", "save"),
    "FlatShard": ("sharding", "FlatShard"),
    "ShardedTensor": ("sharding", "ShardedTensor"),
    "Shards": ("sharding", "Shards"),
    "Problem": ("verification", "Problem"),
    "VerifyReport": ("verification", "VerifyReport"),
    "verify": ("verification", "verify"),
}

if TYPE_CHECKING:  # what static tools and IDEs see
    from .async_saving import AsyncSaver, SaveHandle, aload, asave, async_save
    from .errors import (
        CheckpointError,
        CommitError,
        CorruptCheckpointError,
        LayoutMismatchError,
        ManifestError,
        MissingDataError,
        NotACheckpointError,
        SnapshotChangedError,
        UnsupportedFormatError,
        UnsupportedStateError,
    )
    from .loading import load
    from .reader import read_checkpoint_manifest as read_manifest
    from .manager import CheckpointInfo, CheckpointManager
    from .manifest import FORMAT_VERSION, Manifest, parse_manifest
    from .saving import save
    from .sharding import FlatShard, ShardedTensor, Shards
    from .verification import Problem, VerifyReport, verify

__all__ = [
    "AsyncSaver",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointManager",
    "CommitError",
    "CorruptCheckpointError",
    "FORMAT_VERSION",
    "FlatShard",
    "LayoutMismatchError",
    "Manifest",
    "ManifestError",
    "MissingDataError",
    "NotACheckpointError",
    "Problem",
    "SaveHandle",
    "ShardedTensor",
    "Shards",
    "SnapshotChangedError",
    "UnsupportedFormatError",
    "UnsupportedStateError",
    "VerifyReport",
    "aload",
    "asave",
    "async_save",
    "load",
    "parse_manifest",
    "read_manifest",
    "save",
    "verify",
]


if not TYPE_CHECKING:  # static tools see the imports above; at run time names resolve on first use
    __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
