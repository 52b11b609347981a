"""The export's output directory: built under a temporary sibling name, moved to its final name at the end.

A killed or failed export thus never leaves a partial file under the destination
name: either the destination is untouched, or it holds the complete export. An
existing destination is replaced only when it is empty or ``overwrite`` is given
(it is renamed aside, the new one renamed in, then the old one deleted), and never
when it is, or holds, the checkpoint being exported.

A destination that is a symlink to a directory is replaced as a link: the export
takes the link's name and the link is removed; the directory it pointed to is left
untouched (like a checkpoint commit, see ``ucp.store.storage.remove_path``).
"""

from __future__ import annotations

import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from aio import fsync_dir
from ucp.conversion.exporters.options import ExportError
from ucp.store.storage import remove_path


def check_destination(
    dst: str | os.PathLike[str], *, overwrite: bool, src: str | os.PathLike[str] | None = None
) -> Path:
    """The destination as an absolute path; ExportError if it is a file, a non-empty directory without
    ``overwrite``, or overlaps the local checkpoint ``src`` (replacing it would delete the source)."""
    text = os.fspath(dst)
    if "://" in text:
        raise ExportError(f"destination {text!r}: exports are written to local paths only")
    path = Path(text).absolute()
    if src is not None:
        check_no_overlap(src, path)
    if path.exists() or path.is_symlink():
        if not path.is_dir():
            raise ExportError(f"destination {str(path)!r} exists and is not a directory")
        if any(path.iterdir()) and not overwrite:
            raise ExportError(
                f"destination {str(path)!r} exists and is not empty (pass overwrite=True, or --overwrite, to replace it)"
            )
    if not path.parent.is_dir():
        raise ExportError(f"destination {str(path)!r}: parent directory {str(path.parent)!r} does not exist")
    return path


def check_no_overlap(src: str | os.PathLike[str], dst: Path) -> None:
    """ExportError when ``dst`` is the local checkpoint ``src``, a folder holding it, or a folder inside it
    (symlinks resolved). URL sources cannot overlap a local destination."""
    text = os.fspath(src)
    if "://" in text:
        return
    source, target = Path(text).resolve(), dst.resolve()
    if target == source:
        raise ExportError(f"destination {str(dst)!r} is the source checkpoint {text!r}; export elsewhere")
    if target in source.parents:
        raise ExportError(
            f"destination {str(dst)!r} contains the source checkpoint {text!r}; replacing it would delete the source"
        )
    if source in target.parents:
        raise ExportError(f"destination {str(dst)!r} is inside the source checkpoint {text!r}; export elsewhere")


@contextmanager
def staged_dir(dst: Path, *, overwrite: bool) -> Iterator[Path]:
    """Yield a temporary sibling directory of ``dst``; on success move it to ``dst``, on failure delete it."""
    dst = check_destination(dst, overwrite=overwrite)
    tmp = dst.parent / f".{dst.name}.export-tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    old = None
    try:
        yield tmp
        sync_tree(tmp)
        if os.path.lexists(dst):
            old = dst.parent / f".{dst.name}.export-old-{uuid.uuid4().hex[:8]}"
            os.rename(dst, old)  # a symlink is moved as the link itself
        os.rename(tmp, dst)
        fsync_dir(str(dst.parent))
    except BaseException:
        if old is not None and not os.path.lexists(dst):
            os.rename(old, dst)  # the new export did not make it in: the old one goes back
            old = None
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        remove_path(old)


def sync_tree(root: Path) -> None:
    """fsync every file and directory under ``root`` (zarr writes many small files through plain I/O), so
    that after the rename a crash cannot leave the final name holding empty chunks."""
    for dirpath, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(dirpath)
