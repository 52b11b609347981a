"""Where a measuring run (``ucp tune``, ``ucp bench``) writes: a private directory, removed with
everything in it when the run ends.

A run never writes beside the user's files, only inside a fresh directory it makes under the
directory it was given, so cleaning up cannot touch a file the run did not make, whatever its name.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path


class WorkDir:
    """A fresh directory made inside ``base`` (the user's ``--dir``; default: the current directory).

    Directories on the way to ``base`` that did not exist are made, and removed again by
    :meth:`remove` when they are left empty (a failed run leaves no trace of them).
    """

    def __init__(self, base: Path | None, prefix: str) -> None:
        self.given = base is not None
        self.base = Path(base) if base is not None else Path.cwd()
        self._made = _make_missing(self.base)  # deepest first
        try:
            self.path = Path(tempfile.mkdtemp(prefix=prefix, dir=self.base))
        except BaseException:
            self._remove_made()
            raise

    @property
    def shown(self) -> Path:
        """The directory a report names: the user's ``--dir``, or the temporary one when none was given."""
        return self.base if self.given else self.path

    def remove(self) -> None:
        """Delete the run's directory with all in it, then the directories made for it if left empty."""
        shutil.rmtree(self.path, ignore_errors=True)
        self._remove_made()

    def _remove_made(self) -> None:
        for d in self._made:
            try:
                d.rmdir()  # only if empty: something else may have put files there meanwhile
            except OSError:
                return  # not empty (or gone): its parents are not empty either


def _make_missing(path: Path) -> list[Path]:
    """Make ``path`` and any missing parents; return the directories made, deepest first."""
    missing: list[Path] = []
    p = path.absolute()
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    made: list[Path] = []
    try:
        for d in reversed(missing):
            try:
                d.mkdir()
            except FileExistsError:
                continue  # made by someone else meanwhile: not ours to remove
            made.insert(0, d)
    except BaseException:
        for d in made:
            with contextlib.suppress(OSError):
                d.rmdir()
        raise
    return made
