"""UCP: checkpoints for large-model training — safetensors data files plus a JSON manifest.

::

    import ucp
    ucp.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": 100}, "ckpt/step-100")
    state = ucp.load("ckpt/step-100")                       # everything, sharded tensors assembled
    ucp.load("ckpt/step-100", into={"model": model.state_dict()})   # in place, only the bytes needed

The format is specified in docs/format.md.
"""

# ruff: noqa: F401 - the TYPE_CHECKING imports are for static tools; __all__ is derived from _EXPORTS

from __future__ import annotations

from typing import TYPE_CHECKING

from aio.lazy import lazy_exports

# Public name -> the submodule defining it. Resolved on first use (PEP 562), so that importing
# ``ucp`` (or any of its submodules, e.g. the command line) does not import torch: commands that
# read a whole checkpoint start prefetching it before they pay for that import.
_EXPORTS: dict[str, tuple[str, str]] = {
    "AsyncSaver": ("saving.async_save", "AsyncSaver"),
    "SaveHandle": ("saving.async_save", "SaveHandle"),
    "aload": ("saving.async_save", "aload"),
    "asave": ("saving.async_save", "asave"),
    "async_save": ("saving.async_save", "async_save"),
    "CheckpointError": ("errors", "CheckpointError"),
    "CommitError": ("errors", "CommitError"),
    "CorruptCheckpointError": ("errors", "CorruptCheckpointError"),
    "LayoutMismatchError": ("errors", "LayoutMismatchError"),
    "ManifestError": ("errors", "ManifestError"),
    "MissingDataError": ("errors", "MissingDataError"),
    "NotACheckpointError": ("errors", "NotACheckpointError"),
    "UnsupportedFormatError": ("errors", "UnsupportedFormatError"),
    "UnsupportedStateError": ("errors", "UnsupportedStateError"),
    "StorageError": ("errors", "StorageError"),
    "SnapshotChangedError": ("errors", "SnapshotChangedError"),
    "SnapshotAborted": ("errors", "SnapshotAborted"),
    "CowUnavailable": ("errors", "CowUnavailable"),
    "DestinationError": ("errors", "DestinationError"),
    "ForeignCheckpointError": ("errors", "ForeignCheckpointError"),
    "UnknownFormatError": ("errors", "UnknownFormatError"),
    "UnsafePickleError": ("errors", "UnsafePickleError"),
    "ExportError": ("errors", "ExportError"),
    "BenchError": ("errors", "BenchError"),
    "BenchOptionError": ("errors", "BenchOptionError"),
    "RawToolError": ("errors", "RawToolError"),
    "load": ("loading.loader", "load"),
    "LoadReport": ("loading.loader", "LoadReport"),
    "open": ("loading.lazy", "open"),
    "CheckpointReader": ("loading.lazy", "CheckpointReader"),
    "TensorSlice": ("loading.lazy", "TensorSlice"),
    "reshape": ("conversion.api", "reshape"),
    "export": ("conversion.api", "export"),
    "convert": ("conversion.api", "convert"),
    "read_manifest": ("store.reader", "read_checkpoint_manifest"),
    "CheckpointInfo": ("manager", "CheckpointInfo"),
    "CheckpointManager": ("manager", "CheckpointManager"),
    "FORMAT_VERSION": ("format.manifest", "FORMAT_VERSION"),
    "Manifest": ("format.manifest", "Manifest"),
    "parse_manifest": ("format.manifest", "parse_manifest"),
    "save": ("saving.sync_save", "save"),
    "save_state": ("distributed_state", "save_state"),
    "load_state": ("distributed_state", "load_state"),
    "get_state": ("distributed_state", "get_state"),
    "set_state": ("distributed_state", "set_state"),
    "FlatShard": ("format.sharding", "FlatShard"),
    "ShardedTensor": ("format.sharding", "ShardedTensor"),
    "Shards": ("format.sharding", "Shards"),
    "Problem": ("loading.verify", "Problem"),
    "VerifyReport": ("loading.verify", "VerifyReport"),
    "verify": ("loading.verify", "verify"),
}

if TYPE_CHECKING:  # what static tools and IDEs see: the names of _EXPORTS, from the same places
    from ucp.conversion.api import convert, export, reshape
    from ucp.distributed_state import get_state, load_state, save_state, set_state
    from ucp.errors import (
        BenchError,
        BenchOptionError,
        CheckpointError,
        CommitError,
        CorruptCheckpointError,
        CowUnavailable,
        DestinationError,
        ExportError,
        ForeignCheckpointError,
        LayoutMismatchError,
        ManifestError,
        MissingDataError,
        NotACheckpointError,
        RawToolError,
        SnapshotAborted,
        SnapshotChangedError,
        StorageError,
        UnknownFormatError,
        UnsafePickleError,
        UnsupportedFormatError,
        UnsupportedStateError,
    )
    from ucp.format.manifest import FORMAT_VERSION, Manifest, parse_manifest
    from ucp.format.sharding import FlatShard, ShardedTensor, Shards
    from ucp.loading.lazy import CheckpointReader, TensorSlice, open
    from ucp.loading.loader import LoadReport, load
    from ucp.loading.verify import Problem, VerifyReport, verify
    from ucp.manager import CheckpointInfo, CheckpointManager
    from ucp.saving.async_save import AsyncSaver, SaveHandle, aload, asave, async_save
    from ucp.saving.sync_save import save
    from ucp.store.reader import read_checkpoint_manifest as read_manifest

# The public face is listed once, in _EXPORTS; the TYPE_CHECKING imports above mirror it for static
# tools (tests/ucp/test_public_exports.py keeps the two equal). ``from ucp import *`` leaves out the
# names that would shadow a builtin (``ucp.open``).
NOT_STARRED = frozenset({"open"})
__all__ = sorted(set(_EXPORTS) - NOT_STARRED)


if not TYPE_CHECKING:  # static tools see the imports above; at run time names resolve on first use
    __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
