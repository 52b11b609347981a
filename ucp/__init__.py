"""UCP: checkpoints for large-model training — safetensors data files plus a JSON manifest.

::

    import ucp
    ucp.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": 100}, "ckpt/step-100")
    state = ucp.load("ckpt/step-100")                       # everything, sharded tensors assembled
    ucp.load("ckpt/step-100", into={"model": model.state_dict()})   # in place, only the bytes needed

The format is specified in docs/format.md.
"""

from .async_saving import AsyncSaver, SaveHandle, aload, asave, async_save
from .errors import (
    CheckpointError,
    CommitError,
    CorruptCheckpointError,
    LayoutMismatchError,
    ManifestError,
    MissingDataError,
    NotACheckpointError,
    UnsupportedFormatError,
    UnsupportedStateError,
)
from .loading import load, read_checkpoint_manifest as read_manifest
from .manager import CheckpointInfo, CheckpointManager
from .manifest import FORMAT_VERSION, Manifest, parse_manifest
from .saving import save
from .sharding import FlatShard, ShardedTensor, Shards
from .verification import Problem, VerifyReport, verify

__all__ = [
    "AsyncSaver",
    "CheckpointInfo",
    "CheckpointManager",
    "SaveHandle",
    "aload",
    "asave",
    "async_save",
    "FORMAT_VERSION",
    "CheckpointError",
    "CommitError",
    "CorruptCheckpointError",
    "FlatShard",
    "LayoutMismatchError",
    "Manifest",
    "ManifestError",
    "MissingDataError",
    "NotACheckpointError",
    "Problem",
    "ShardedTensor",
    "Shards",
    "UnsupportedFormatError",
    "UnsupportedStateError",
    "VerifyReport",
    "load",
    "parse_manifest",
    "read_manifest",
    "save",
    "verify",
]
