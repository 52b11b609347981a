"""One error story: every exception class UCP defines is a ``ucp.CheckpointError`` (or an ``OSError``),
reachable as ``ucp.<Name>``; a failed multi-rank commit names the failing rank in ``CommitError.ranks``."""

from __future__ import annotations

import errno
import importlib
import pkgutil

import pytest
import torch
from ucp_helpers import run_ranks

import ucp
from aio import AioError, FileWriter

# Internal signals, caught where they are raised and never seen by a caller (so not in ``ucp``).
INTERNAL = {
    "ucp.conversion.importers.stored.NeedsTorch": "the importers catch it and read the checkpoint with torch",
    "ucp.saving.cow.userfaultfd.ReadError": "an OSError of the copy-on-write helper process, reported as a message",
    "ucp.store.s3._Abort": "raised into obstore's upload input to abort the multipart upload, caught by the writer",
}


def _exception_classes() -> dict[str, type[BaseException]]:
    """Every exception class defined in a ``ucp`` module (warnings aside), by its qualified name."""
    found: dict[str, type[BaseException]] = {}
    for info in pkgutil.walk_packages(ucp.__path__, "ucp."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            if (
                isinstance(value, type)
                and issubclass(value, BaseException)
                and not issubclass(value, Warning)
                and value.__module__.split(".")[0] == "ucp"
            ):
                found[f"{value.__module__}.{value.__qualname__}"] = value
    return found


def test_every_ucp_exception_is_a_checkpoint_error_or_os_error_and_public() -> None:
    classes = _exception_classes()
    assert "ucp.errors.CommitError" in classes and "ucp.errors.CowUnavailable" in classes  # the walk saw them
    wrong = [name for name, cls in classes.items() if not issubclass(cls, (ucp.CheckpointError, OSError))]
    assert wrong == [], f"not a ucp.CheckpointError nor an OSError: {wrong}"
    hidden = [
        name for name, cls in classes.items() if name not in INTERNAL and getattr(ucp, cls.__name__, None) is not cls
    ]
    assert hidden == [], f"not reachable as ucp.<Name>: {hidden}"
    assert set(INTERNAL) <= set(classes), "an INTERNAL entry names a class that no longer exists"
    for name in ("CowUnavailable", "ExportError", "UnknownFormatError", "UnsafePickleError", "SnapshotAborted"):
        assert name in ucp.__all__ and name in dir(ucp)


def test_raisers_use_the_public_classes() -> None:
    """The modules that raise them hand out the same class objects as ``ucp``."""
    from ucp.bench.common import BenchError
    from ucp.bench.raw import RawToolError
    from ucp.conversion.exporters import ExportError
    from ucp.conversion.importers.errors import UnknownFormatError, UnsafePickleError
    from ucp.saving.cow.snapshot import CowUnavailable

    assert (BenchError, RawToolError, ExportError, CowUnavailable) == (
        ucp.BenchError,
        ucp.RawToolError,
        ucp.ExportError,
        ucp.CowUnavailable,
    )
    assert issubclass(UnknownFormatError, ucp.NotACheckpointError)  # "not a checkpoint" of any known format
    assert issubclass(UnsafePickleError, ucp.ForeignCheckpointError) and issubclass(ucp.RawToolError, ucp.BenchError)


def test_snapshot_changed_is_not_an_unsupported_state() -> None:
    """The state was storable; the training loop changed it under a deferred snapshot."""
    assert issubclass(ucp.SnapshotChangedError, ucp.CheckpointError)
    assert not issubclass(ucp.SnapshotChangedError, ucp.UnsupportedStateError)


def test_commit_error_fields() -> None:
    exc = ucp.CommitError("save failed on 2 rank(s): ...", ranks=[3, 1, 3], reason="disk full")
    assert exc.ranks == (1, 3) and exc.reason == "disk full" and str(exc) == "save failed on 2 rank(s): ..."
    plain = ucp.CommitError("no rank to blame")
    assert plain.ranks == () and plain.reason == "no rank to blame"


def test_a_failed_multi_rank_save_names_the_failing_rank(tmp_path, monkeypatch) -> None:
    """Rank 1's data file cannot be written: rank 0's CommitError says ranks == (1,)."""
    from ucp.saving.sync_save import save_with
    from ucp.store.storage import open_storage

    orig = FileWriter.write

    def write(self, data):
        if "rank-00001" in self.path and self.size > 0:
            raise AioError(errno.ENOSPC, self.path, self.size, "simulated")
        return orig(self, data)

    monkeypatch.setattr(FileWriter, "write", write)

    def fn(group):
        piece = ucp.ShardedTensor(torch.ones(2, 2), (4, 2), (2 * group.rank, 0))
        storage, name = open_storage(tmp_path / "ck")
        try:
            with storage:
                save_with(storage, name, {"w": piece}, group, step=None, metadata={}, mesh=None)
        except Exception as exc:  # noqa: BLE001 - each rank's error is what the test looks at
            return exc
        return None

    errors = run_ranks(2, fn)
    assert isinstance(errors[1], AioError)  # the failing rank raises its own error
    assert isinstance(errors[0], ucp.CommitError), errors[0]
    assert errors[0].ranks == (1,) and "simulated" in errors[0].reason and "rank 1" in str(errors[0])


def test_a_failed_async_multi_rank_save_names_the_failing_rank(tmp_path, monkeypatch) -> None:
    from ucp.saving.background import execute

    real = execute.write_image

    def failing(storage, rel, plan, arena, progress):
        if plan.file == "rank-00001.safetensors":
            raise OSError(errno.EIO, "injected failure", rel)
        return real(storage, rel, plan, arena, progress)

    monkeypatch.setattr(execute, "write_image", failing)

    def fn(group):
        piece = ucp.ShardedTensor(torch.ones(2, 2), (4, 2), (2 * group.rank, 0))
        with ucp.AsyncSaver() as saver:
            return saver.save({"w": piece}, tmp_path / "ck", process_group=group).exception(timeout=60)

    errors = run_ranks(2, fn)
    assert isinstance(errors[0], ucp.CommitError), errors[0]
    assert errors[0].ranks == (1,) and "injected" in errors[0].reason


@pytest.mark.parametrize("name", ["CommitError", "CowUnavailable", "ExportError", "BenchError"])
def test_one_except_clause_catches_them(name: str) -> None:
    with pytest.raises(ucp.CheckpointError):
        raise getattr(ucp, name)("x")
