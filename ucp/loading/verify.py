"""``ucp.verify``: check a checkpoint end to end without loading it (the CLI's ``ucp verify``).

Reads the manifest with all reader checks, then streams every data file through
a small rotating set of buffers, checking its size, its safetensors header and
the CRC-32C of every piece. Problems are collected, not raised, so one run lists
everything wrong (one problem per bad file: checking a file stops at its first).
"""

from __future__ import annotations

import os
from typing import Any, Callable

from pydantic import BaseModel

from aio import AioConfig
from ucp.errors import CheckpointError, CorruptCheckpointError
from ucp.store.reader import (
    CrcTracker,
    check_file_size,
    check_header,
    header_length,
    parse_header,
    pieces_by_file,
    read_manifest,
    stream_file,
)
from ucp.store.storage import as_aio_config, open_storage


class Problem(BaseModel):
    """One thing wrong: the error class name, its message, and where (when known)."""

    kind: str  # the CheckpointError subclass name, or the OSError's
    message: str
    file: str | None = None
    tensor: str | None = None
    offset: int | None = None


class VerifyReport(BaseModel):
    """What ``verify`` found. ``ok`` when there are no problems."""

    path: str
    ok: bool
    format_version: int | None = None
    step: int | None = None
    files_checked: int = 0
    tensors: int = 0
    pieces_checked: int = 0
    bytes_checked: int = 0
    bytes_total: int = 0
    problems: list[Problem] = []


def _problem(exc: BaseException, file: str | None = None) -> Problem:
    return Problem(
        kind=type(exc).__name__,
        message=str(exc),
        file=getattr(exc, "file", None) or file,
        tensor=getattr(exc, "tensor", None),
        offset=getattr(exc, "offset", None),
    )


def verify(
    path: str | os.PathLike[str],
    *,
    aio_config: AioConfig | dict[str, Any] | None = None,
    storage_options: dict[str, Any] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> VerifyReport:
    """Check the manifest, every data file's size and header, and every piece's CRC-32C.

    ``progress(bytes_done, bytes_total)`` is called as data is checked.
    """
    storage, name = open_storage(path, storage_options=storage_options, aio_config=as_aio_config(aio_config))
    report = VerifyReport(path=os.fspath(path), ok=False)
    with storage:
        try:
            manifest = read_manifest(storage, name)
        except CheckpointError as exc:
            report.problems.append(_problem(exc))
            return report
        report.format_version = manifest.format_version
        report.step = manifest.step
        report.tensors = len(manifest.tensors)
        report.bytes_total = sum(f.size for f in manifest.files.values())
        done = 0
        for file, fps in pieces_by_file(manifest).items():
            size = manifest.files[file].size
            try:
                check_file_size(storage, name, file, size)
                tracker = CrcTracker(file, fps)
                if size == 0:
                    parse_header(file, b"", size)  # raises: too short
                for off, view in stream_file(storage, f"{name}/{file}", size):
                    if off == 0:
                        if header_length(file, view) > view.nbytes:
                            raise CorruptCheckpointError(f"file {file!r}: header larger than a read segment", file=file)
                        data_start, header = parse_header(file, view, size)
                        check_header(file, data_start, header, fps)
                    tracker.feed(off, view)
                    if progress is not None:
                        progress(done + off + view.nbytes, report.bytes_total)
                tracker.finish()
            except (CheckpointError, OSError) as exc:
                report.problems.append(_problem(exc, file))
                continue
            finally:
                done += size
            report.files_checked += 1
            report.pieces_checked += len(fps)
            report.bytes_checked += size
    report.ok = not report.problems
    return report
