"""``ucp.CheckpointManager``: a directory of step checkpoints with a ``latest`` pointer and retention.

Layout of a manager root (a local or mounted shared directory)::

    root/
      step-00000100/            # complete checkpoints (ucp.save's atomic directories)
      step-00000200/
      latest                    # {"step": 200, "name": "step-00000200"}
      .step-00000300.tmp-1a2b3c # a save in flight, or the leftover of a killed one

Order of a save (rank 0 does the file-system work):

1. remove leftovers of earlier, interrupted saves (``.tmp-``/``.old-`` directories
   that no save in flight holds: see :func:`ucp.store.commit.dir_in_use`);
2. save ``root/step-{step:08d}`` with :func:`ucp.save` or an asynchronous save (atomic);
3. after the commit, replace ``latest`` atomically (temp file, fsync, rename, fsync of root), only
   forward: under a ``flock`` of the root it is left alone when it names a complete higher step
   (two managers, or a late async writer, committing out of order). The checkpoint is complete by
   then, so a pointer that cannot be written is a warning, not a failed save;
4. keep ``keep_last`` complete checkpoints — always the one ``latest`` names and the one just
   saved, then the highest steps — and delete the other complete ones.

A kill at any point leaves ``latest`` naming a complete checkpoint (the previous
one, or the new one if the kill came after step 3); leftovers are never listed as
complete nor loaded, and the next save removes them. "The latest checkpoint"
(:meth:`CheckpointManager.latest`, :meth:`CheckpointManager.load`) is the newest complete
one: the one ``latest`` names unless that pointer is missing, stale or older; load falls back
to older complete checkpoints when one no longer loads.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import secrets
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from pydantic import BaseModel

from aio import AioConfig, fsync_dir
from ucp.errors import CheckpointError, NotACheckpointError
from ucp.format.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, READABLE_VERSIONS, Manifest, parse_manifest
from ucp.store.commit import dir_in_use
from ucp.store.reader import read_regular_file
from ucp.store.storage import remove_path

if TYPE_CHECKING:  # saving and loading import torch: only CheckpointManager's methods need them, so that
    # listing checkpoints (``ucp ls``, resolving ``latest``) starts without torch
    from ucp.replicate import Replicator
    from ucp.saving.async_save import AsyncSaver, Mode, SaveHandle, Snapshot
    from ucp.saving.background.job import PostCommit, StoreHandshake

log = logging.getLogger(__name__)

LATEST = "latest"
STEP_RE = re.compile(r"^step-(\d+)$")
LEFTOVER_RE = re.compile(r"^\.(step-(\d+))\.(tmp|old)-[0-9a-f]+$")
LATEST_TMP_RE = re.compile(r"^\.latest\.tmp-[0-9a-f]+$")

Status = Literal["complete", "incomplete", "corrupt", "saving", "temp", "old"]


def step_name(step: int) -> str:
    return f"step-{step:08d}"


class CheckpointInfo(BaseModel):
    """One entry of a manager root.

    ``status``: ``complete`` (loadable manifest, data files of the right sizes),
    ``incomplete`` (a step directory without manifest.json), ``corrupt`` (its
    manifest or data files are bad), ``saving`` (the temporary directory of a save
    in flight), ``temp`` (the leftover of an interrupted save), ``old`` (a replaced
    or retired checkpoint not yet deleted).
    """

    step: int
    name: str
    path: str
    size: int
    status: Status
    latest: bool = False
    created: datetime | None = None
    detail: str | None = None


# -- the latest pointer ---------------------------------------------------------------------------


def read_latest(root: str | os.PathLike[str]) -> tuple[int, str] | None:
    """(step, name) from ``root/latest``; None when it is missing, unreadable, or its step and name disagree."""
    try:
        with open(os.path.join(root, LATEST), "rb") as f:
            data = json.loads(f.read())
        step, name = data["step"], data["name"]
        match = STEP_RE.match(name) if isinstance(name, str) else None
        # the step must be the one the name says: latest() checks the name, load() goes by the step
        if isinstance(step, int) and not isinstance(step, bool) and match and int(match.group(1)) == step:
            return step, name
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def write_latest(root: str | os.PathLike[str], step: int, name: str) -> bool:
    """Point ``root/latest`` at ``name`` atomically and durably, never backwards; False when left as it was.

    Under an exclusive ``flock`` of ``root`` (held by every writer of the pointer), the pointer is
    left alone when it names a complete checkpoint of a higher step: two managers (or an async
    writer finishing late) committing steps out of order must not move ``latest`` back from 30 to 29.
    On failure the temporary file is removed before the error propagates.
    """
    root = os.fspath(root)
    data = (json.dumps({"step": step, "name": name}) + "\n").encode()
    lock = os.open(root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        current = read_latest(root)
        if current is not None and current[0] > step and looks_complete(os.path.join(root, current[1])):
            return False
        for attempt in range(3):
            tmp = os.path.join(root, f".latest.tmp-{secrets.token_hex(6)}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)  # clean_leftovers leaves a pointer being written alone
                os.write(fd, data)
                os.fsync(fd)
                try:
                    os.replace(tmp, os.path.join(root, LATEST))
                except FileNotFoundError:  # a cleaner removed it between its creation and our lock: again
                    if attempt == 2:
                        raise
                    continue
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise
            finally:
                os.close(fd)
            fsync_dir(root)
            return True
        return False  # unreachable: the last attempt returns or raises
    finally:
        os.close(lock)


# -- looking at a root ---------------------------------------------------------------------------


def _dir_size(path: str) -> int:
    total = 0
    try:
        with os.scandir(path) as it:
            for e in it:
                try:
                    if e.is_file(follow_symlinks=False):
                        total += e.stat(follow_symlinks=False).st_size
                except OSError:
                    pass
    except OSError:
        pass
    return total


def check_complete(path: str) -> tuple[Status, Manifest | None, str | None]:
    """Cheap completeness check of one checkpoint directory: manifest parses, data files have their sizes."""
    try:  # a FIFO named manifest.json must not hang a listing
        data = read_regular_file(os.path.join(path, MANIFEST_NAME), os.path.join(path, MANIFEST_NAME))
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return "incomplete", None, f"no {MANIFEST_NAME}"
    except (OSError, CheckpointError) as exc:
        return "corrupt", None, str(exc)
    try:
        manifest = parse_manifest(data, source=os.path.join(path, MANIFEST_NAME))
    except CheckpointError as exc:
        return "corrupt", None, str(exc)
    status, detail = _files_present(path, {f: info.size for f, info in manifest.files.items()})
    return status, manifest, detail


def _files_present(path: str, sizes: dict[str, int]) -> tuple[Status, str | None]:
    for file, expected in sizes.items():
        try:
            size = os.stat(os.path.join(path, file)).st_size
        except OSError:
            return "corrupt", f"data file {file!r} is missing"
        if size != expected:
            return "corrupt", f"data file {file!r} has {size} bytes, the manifest says {expected}"
    return "complete", None


def looks_complete(path: str) -> bool:
    """The quick check retention uses after every save: a manifest of this format version whose data
    files have their sizes. It skips the full manifest validation of :func:`check_complete` (tens
    of ms of Python per checkpoint, taken from training by an asynchronous writer)."""
    try:
        with open(os.path.join(path, MANIFEST_NAME), "rb") as f:
            st = os.fstat(f.fileno())
            if st.st_size > MAX_MANIFEST_BYTES:  # not one UCP wrote: never read it whole
                return False
            key = (path, st.st_ino, st.st_size, st.st_mtime_ns)
            sizes = _MANIFEST_FILES.get(key)
            if sizes is None:
                sizes = _manifest_files(f.read())
                if len(_MANIFEST_FILES) > 256:
                    _MANIFEST_FILES.clear()
                _MANIFEST_FILES[key] = sizes
    except OSError:
        return False
    return sizes is not False and _files_present(path, sizes)[0] == "complete"


# A committed manifest never changes: (path, inode, size, mtime) -> its data files' sizes (False: unusable).
_MANIFEST_FILES: dict[tuple[str, int, int, int], dict[str, int] | Literal[False]] = {}


def _manifest_files(data: bytes) -> dict[str, int] | Literal[False]:
    try:
        doc = json.loads(data)
        files = doc["files"]
        sizes = {str(name): int(info["size"]) for name, info in files.items()}
        if doc["format_version"] not in READABLE_VERSIONS or any("/" in n or n.startswith(".") for n in sizes):
            return False
    except (ValueError, KeyError, TypeError, AttributeError):
        return False
    return sizes


def list_checkpoints(root: str | os.PathLike[str]) -> list[CheckpointInfo]:
    """Every checkpoint, save in flight and leftover under ``root``, by step (leftovers after their step)."""
    root = os.fspath(root)
    try:
        names = sorted(os.listdir(root))
    except FileNotFoundError:
        return []
    pointer = read_latest(root)
    out: list[CheckpointInfo] = []
    for name in names:
        path = os.path.join(root, name)
        m = STEP_RE.match(name)
        if m is not None and os.path.isdir(path):
            status, manifest, detail = check_complete(path)
            out.append(
                CheckpointInfo(
                    step=int(m.group(1)),
                    name=name,
                    path=path,
                    size=_dir_size(path),
                    status=status,
                    latest=pointer is not None and pointer[1] == name and status == "complete",
                    created=manifest.created if manifest is not None else None,
                    detail=detail,
                )
            )
            continue
        m = LEFTOVER_RE.match(name)
        if m is not None and os.path.isdir(path):
            status = "old" if m.group(3) == "old" else ("saving" if dir_in_use(path) else "temp")
            out.append(CheckpointInfo(step=int(m.group(2)), name=name, path=path, size=_dir_size(path), status=status))
    order = {"complete": 0, "corrupt": 0, "incomplete": 0, "saving": 1, "temp": 2, "old": 3}
    out.sort(key=lambda i: (i.step, order[i.status], i.name))
    return out


def resume_choice(infos: list[CheckpointInfo]) -> CheckpointInfo | None:
    """What a resume loads among ``list_checkpoints``' entries: the newest complete one, which is the one
    ``latest`` names unless the pointer is missing, stale or older (a pointer write that failed after a
    commit, or an old writer); None when nothing is complete."""
    complete = [i for i in infos if i.status == "complete"]
    if not complete:
        return None
    newest = max(complete, key=lambda i: i.step)
    named = next((i for i in complete if i.latest), None)
    return named if named is not None and named.step >= newest.step else newest


def _remove_unlocked(path: str) -> bool:
    """Remove a pointer temp file unless :func:`write_latest` holds it (a save committing right now)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.unlink(path)
        return True
    except OSError:  # locked (being written) or already gone
        return False
    finally:
        os.close(fd)


def clean_leftovers(root: str | os.PathLike[str], *, keep: set[str] = frozenset()) -> list[str]:  # type: ignore[assignment]
    """Delete ``.tmp-``/``.old-`` directories of interrupted saves and stray pointer temp files.

    Skips the temporary directories of saves in flight: those in ``keep`` (absolute
    paths) and those some process holds a lock on. Returns what was removed.
    """
    root = os.fspath(root)
    removed = []
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    for name in names:
        path = os.path.join(root, name)
        if LEFTOVER_RE.match(name) and os.path.isdir(path):
            if path in keep or dir_in_use(path):
                continue
            remove_path(path)  # a symlinked entry: the link goes, its target stays
            removed.append(name)
    temps = [name for name in names if LATEST_TMP_RE.match(name)]
    if temps:
        # Only while no write_latest holds root's lock: one that does may be between creating its temp file and
        # locking it, where the file's own lock does not yet say it is being written.
        idle = os.open(root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
        try:
            fcntl.flock(idle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            removed += [name for name in temps if _remove_unlocked(os.path.join(root, name))]
        except BlockingIOError:
            pass  # a pointer is being written: its leftovers go at a later cleaning
        finally:
            os.close(idle)
    return removed


class _Entry(NamedTuple):
    step: int
    name: str
    path: str


def apply_retention(root: str | os.PathLike[str], keep_last: int, *, protect: set[str] = frozenset()) -> list[str]:  # type: ignore[assignment]
    """Keep ``keep_last`` complete checkpoints — ``latest``'s (and ``protect``) first, then the highest steps —
    and delete the other complete ones. Incomplete, corrupt and in-flight entries are left alone."""
    root = os.fspath(root)
    pointer = read_latest(root)
    complete = sorted(
        (
            _Entry(int(m.group(1)), name, os.path.join(root, name))
            for name in os.listdir(root)
            if (m := STEP_RE.match(name)) is not None and looks_complete(os.path.join(root, name))
        ),
        key=lambda i: -i.step,
    )
    keep = {i.name for i in complete if i.name in protect or (pointer is not None and i.name == pointer[1])}
    for info in complete:
        if len(keep) >= keep_last:
            break
        keep.add(info.name)
    doomed = [i for i in complete if i.name not in keep]
    removed = []
    for info in doomed:
        aside = os.path.join(root, f".{info.name}.old-{secrets.token_hex(6)}")
        try:
            os.rename(info.path, aside)  # atomic: a kill mid-delete leaves an ``old`` leftover, not a broken step
        except OSError as exc:
            log.warning("could not retire %s: %s", info.path, exc)
            continue
        remove_path(aside)
        removed.append(info.name)
    if removed:
        fsync_dir(root)
    return removed


def after_commit(
    root: str, step: int, name: str, keep_last: int | None, storage_options: dict[str, Any] | None = None
) -> None:
    """What follows a committed save: move ``latest``, apply retention (rank 0; the async writer calls it too).

    The checkpoint is complete already, so a pointer that cannot be written is a warning, not a
    failed save: readers resolve "latest" from the complete checkpoints when the pointer is missing
    or older (:func:`resume_choice`, :meth:`CheckpointManager.latest`). A URL root (an object store)
    goes to :func:`ucp.manager_remote.after_commit`.
    """
    if "://" in root:
        from ucp import manager_remote

        manager_remote.after_commit(root, step, name, keep_last, storage_options)
        return
    try:
        write_latest(root, step, name)
    except OSError as exc:
        log.warning("%s is saved, but %s could not be updated: %s", os.path.join(root, name), LATEST, exc)
    if keep_last is not None:
        apply_retention(root, keep_last, protect={name})


# -- the manager ---------------------------------------------------------------------------------


class CheckpointManager:
    """Saves ``root/step-{step:08d}`` checkpoints, keeps a ``latest`` pointer, retires old ones.

    ``async_save=True`` saves through an :class:`~ucp.AsyncSaver` (``mode``,
    ``max_in_flight``): :meth:`save` returns a :class:`~ucp.SaveHandle` and the
    pointer moves once the save has committed (on rank 0's background writer —
    in ``mode="process"`` even when the training process died meanwhile).
    ``saver`` shares an existing AsyncSaver (its staging and writer) instead of
    making one; it implies asynchronous saves and is not closed by :meth:`close`.
    ``process_group`` is used for saves and loads; rank 0 does all file-system
    housekeeping. The root is a local or mounted shared directory, or an object-store URL
    (``s3://bucket/run``, with ``storage_options``; :mod:`ucp.manager_remote` says how ``latest``,
    retention and leftovers work there without rename or locks). ``commit_timeout``
    bounds how long an asynchronous save's ranks wait for each other (a rank that dies is
    noticed at once on local storage; this is for ranks that hang). ``snapshot`` is the
    :class:`~ucp.AsyncSaver`'s (default "auto": copy-on-write where Linux allows it). ``"background"`` or
    ``"none"`` (asynchronous saves, see :class:`~ucp.AsyncSaver`): :meth:`save` returns before the
    state is copied (or, with "none", written straight from the tensors), and the caller must call
    ``handle.wait_snapshot()`` before changing it (``training.Engine`` does, before its optimizer step).
    ``mode``, ``max_in_flight``, ``commit_timeout`` and ``snapshot`` left out (None) take the defaults of
    :class:`~ucp.saving.options.AsyncSaveOptions`.
    ``remote`` (a URL) makes ``root`` the local tier of tiered checkpoints (:mod:`ucp.replicate`), with
    ``remote_keep_last`` and ``remote_storage_options``; ``node_local=True`` says ``root`` is each node's
    own disk, not shared: every rank replicates its own files and rank 0 commits on the store once every
    rank's marker is there, waiting up to ``replicate_timeout`` seconds (:mod:`ucp.tiered`); with
    ``async_save=True`` the ranks commit their local copies through the remote store
    (:mod:`ucp.saving.background.store_handshake`), each in the background, before uploading.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        keep_last: int | None = None,
        async_save: bool = False,
        mode: Mode | None = None,
        max_in_flight: int | None = None,
        process_group: Any = None,
        aio_config: AioConfig | dict[str, Any] | None = None,
        saver: AsyncSaver | None = None,
        commit_timeout: float | None = None,
        snapshot: Snapshot | None = None,
        storage_options: dict[str, Any] | None = None,
        remote: str | None = None,
        remote_keep_last: int | None = None,
        remote_storage_options: dict[str, Any] | None = None,
        node_local: bool = False,
        replicate_timeout: float = 600.0,
    ) -> None:
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 (or None to keep everything), got {keep_last}")
        text = os.fspath(root)
        self.remote = "://" in text
        self.storage_options = storage_options
        self.root = text.rstrip("/") if self.remote else os.path.abspath(text)
        self.keep_last = keep_last
        self.process_group = process_group
        self.aio_config = aio_config
        self._own_saver = saver is None and async_save
        if saver is None and async_save:
            from ucp.saving.async_save import AsyncSaver

            saver = AsyncSaver(max_in_flight, mode, aio_config, commit_timeout=commit_timeout, snapshot=snapshot)
        self.saver = saver
        self._handles: list[SaveHandle] = []
        self.loaded_step: int | None = None  # the step the last load() actually read
        self.loaded_from: str | None = None  # the root it was read from (the local or the remote tier)
        self.replicator: Replicator | None = None
        if remote is not None:
            if self.remote:
                raise ValueError("a tiered manager's root is its local tier: a directory, not a URL")
            if remote_keep_last is not None and remote_keep_last < 1:
                raise ValueError(f"remote_keep_last must be >= 1 (or None), got {remote_keep_last}")
            from ucp.dist import resolve_group
            from ucp.replicate import Replicator

            self.replicator = Replicator(
                self.root,
                remote.rstrip("/"),
                remote_keep_last=remote_keep_last,
                storage_options=remote_storage_options,
                after_local=self._retire_local,
                rank=resolve_group(process_group).rank if node_local else None,
                timeout=replicate_timeout,
            )
        elif node_local:
            raise ValueError("node_local=True is for a tiered manager (remote=URL): without one nothing is shared")
        self.node_local = node_local

    def _retire_local(self, replicated: str, pending: set[str]) -> None:
        """A tiered manager's local retention, once ``replicated`` is safe remotely: never a step still
        waiting for its replication."""
        if self.keep_last is None:
            return
        # and never a newer step: one committed locally but not yet submitted (its save is returning) is in
        # neither ``pending`` nor ``latest`` yet, and replications run in step order
        done = int(STEP_RE.match(replicated).group(1))  # type: ignore[union-attr]
        newer = {n for n in os.listdir(self.root) if (m := STEP_RE.match(n)) is not None and int(m.group(1)) > done}
        protect = {replicated} | pending | newer
        if self.node_local:
            from ucp.tiered import retire_local

            retire_local(self.root, self.keep_last, protect=protect)
        else:
            apply_retention(self.root, self.keep_last, protect=protect)

    @property
    def _local_keep_last(self) -> int | None:
        """Retention right after a local commit: none while a remote tier waits for the checkpoint."""
        return None if self.replicator is not None else self.keep_last

    def path(self, step: int) -> str:
        if self.remote:
            return f"{self.root}/{step_name(step)}"
        return os.path.join(self.root, step_name(step))

    def _remote_root(self) -> Any:
        from ucp.manager_remote import open_root

        return open_root(self.root, self.storage_options)

    def prepare(self, state_dict: dict[str, Any], *, process_group: Any = None) -> int:
        """Allocate the asynchronous saver's staging for ``state_dict`` ahead of the first save
        (:meth:`ucp.AsyncSaver.prepare`); 0 and nothing done for synchronous managers."""
        if self.saver is None:
            return 0
        return self.saver.prepare(
            state_dict, process_group=self.process_group if process_group is None else process_group
        )

    def save(
        self,
        state_dict: dict[str, Any],
        step: int,
        *,
        metadata: dict[str, Any] | None = None,
        mesh: dict[str, int] | None = None,
        check_replicas: bool = False,
    ) -> Manifest | SaveHandle:
        """Save step ``step``: a Manifest (synchronous manager) or a SaveHandle (``async_save=True``).
        ``check_replicas``: see :func:`ucp.save`."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        from ucp.dist import resolve_group
        from ucp.saving.sync_save import save as _save

        group = resolve_group(self.process_group)
        name = step_name(step)
        if group.rank == 0 and self.remote:
            from ucp.manager_remote import clean_leftovers as clean_remote

            keep = {t.rstrip("/").rsplit("/", 1)[-1] for t in self.saver.in_flight_temps()} if self.saver else set()
            with self._remote_root() as storage:
                removed = clean_remote(storage, keep=keep | {name})
            if removed:
                log.info("removed leftovers of interrupted saves under %s: %s", self.root, removed)
        elif group.rank == 0 or self.node_local:  # a node-local tier: every rank cleans its own disk
            os.makedirs(self.root, exist_ok=True)
            keep = self.saver.in_flight_temps() if self.saver is not None else set()
            if group.rank != 0:  # rank 0 may be creating this step's temporary directory here right now
                keep |= {os.path.join(self.root, n) for n in os.listdir(self.root) if n.startswith(f".{name}.")}
            removed = clean_leftovers(self.root, keep=keep)
            if removed:
                log.info("removed leftovers of interrupted saves under %s: %s", self.root, removed)
        if self.node_local and self.saver is not None:
            return self._save_node_local_async(state_dict, step, group, metadata, mesh, check_replicas)
        if self.node_local:
            from ucp.tiered import save_node_local

            manifest = save_node_local(
                state_dict,
                self.root,
                name,
                group=group,
                step=step,
                metadata=metadata,
                mesh=mesh,
                aio_config=self.aio_config,
                check_replicas=check_replicas,
            )
            if group.rank == 0:
                after_commit(self.root, step, name, None, None)
            assert self.replicator is not None
            self.replicator.submit(step, name)  # every rank uploads its own files
            return manifest
        if self.saver is None:
            manifest = _save(
                state_dict,
                self.path(step),
                step=step,
                metadata=metadata,
                process_group=self.process_group,
                aio_config=self.aio_config,
                mesh=mesh,
                check_replicas=check_replicas,
                storage_options=self.storage_options,
            )
            if group.rank == 0:
                after_commit(self.root, step, name, self._local_keep_last, self.storage_options)
                if self.replicator is not None:
                    self.replicator.submit(step, name)
            return manifest
        from ucp.saving.background.job import PostCommit

        hook = PostCommit(
            call="ucp.manager:after_commit",
            kwargs={
                "root": self.root,
                "step": step,
                "name": name,
                "keep_last": self._local_keep_last,
                "storage_options": self.storage_options,
            },
        )
        return self._start_async(
            state_dict,
            step,
            metadata,
            mesh,
            check_replicas,
            post_commit=hook,
            upload=group.rank == 0,
            storage_options=self.storage_options,
        )

    def _start_async(
        self,
        state_dict: dict[str, Any],
        step: int,
        metadata: dict[str, Any] | None,
        mesh: dict[str, int] | None,
        check_replicas: bool,
        *,
        post_commit: PostCommit | None,
        upload: bool,
        storage_options: dict[str, Any] | None = None,
        handshake: StoreHandshake | None = None,
    ) -> SaveHandle:
        """Start one background save of ``step`` and keep its handle; with ``upload`` the replicator (if any)
        uploads the step once the save succeeded."""
        assert self.saver is not None
        handle = self.saver.save(
            state_dict,
            self.path(step),
            step=step,
            metadata=metadata,
            process_group=self.process_group,
            aio_config=self.aio_config,
            mesh=mesh,
            post_commit=post_commit,
            check_replicas=check_replicas,
            storage_options=storage_options,
            handshake=handshake,
        )
        if upload and self.replicator is not None:
            replicator, name = self.replicator, step_name(step)
            handle.add_done_callback(lambda h: None if _failed(h) else replicator.submit(step, name))
        # finished saves are forgotten only when they succeeded: a failure waits for wait()/close() to raise it
        self._handles = [h for h in self._handles if not h.done() or _failed(h)] + [handle]
        return handle

    def _save_node_local_async(
        self,
        state_dict: dict[str, Any],
        step: int,
        group: Any,
        metadata: dict[str, Any] | None,
        mesh: dict[str, int] | None,
        check_replicas: bool,
    ) -> SaveHandle:
        """An asynchronous save to a node-local tier: every rank writes its file to its own disk in the
        background, the ranks commit their local copies through the remote store
        (:mod:`ucp.saving.background.store_handshake`), and then every rank's :class:`Replicator` uploads its
        files (rank 0 commits the remote copy once every rank's marker is there, :func:`ucp.tiered.replicate_rank`)."""
        from ucp.saving.background.job import PostCommit, StoreHandshake

        assert self.saver is not None and self.replicator is not None
        name = step_name(step)
        hook = None
        if group.rank == 0:  # the local ``latest`` on rank 0's disk, as a synchronous node-local save moves it
            kwargs = {"root": self.root, "step": step, "name": name, "keep_last": None, "storage_options": None}
            hook = PostCommit(call="ucp.manager:after_commit", kwargs=kwargs)
        return self._start_async(  # every rank uploads its own files once its local copy is committed
            state_dict,
            step,
            metadata,
            mesh,
            check_replicas,
            post_commit=hook,
            upload=True,
            handshake=StoreHandshake(url=self.replicator.remote_root, storage_options=self.replicator.storage_options),
        )

    def wait(self) -> None:
        """Wait for this manager's saves in flight; raises the first failure."""
        from ucp.saving.async_save import wait_all

        handles, self._handles = self._handles, []
        wait_all(handles)
        if self.replicator is not None:
            self.replicator.wait()

    def list(self) -> list[CheckpointInfo]:
        if self.remote:
            from ucp.manager_remote import list_checkpoints as list_remote

            with self._remote_root() as storage:
                return list_remote(storage)
        return list_checkpoints(self.root)

    def _read_latest(self) -> tuple[int, str] | None:
        if self.remote:
            from ucp.manager_remote import read_latest as read_remote

            with self._remote_root() as storage:
                return read_remote(storage)
        return read_latest(self.root)

    def latest(self) -> int | None:
        """The newest complete checkpoint's step (the one ``latest`` names unless that pointer is missing,
        stale or older), else None."""
        info = resume_choice(self.list())
        return info.step if info is not None else None

    def load(
        self, step: int | None = None, *, into: dict[str, Any] | None = None, strict: bool = True, verify: bool = True
    ) -> Any:
        """Load ``step``, or by default the latest: ``latest``'s checkpoint, else the newest complete one that loads.

        ``into``/``strict`` as for :func:`ucp.load` (the state dict, or with ``strict=False`` a LoadReport).
        :attr:`loaded_step` tells which step was read.
        """
        if self.replicator is not None:
            state = self._load_tiered(step, into=into, strict=strict, verify=verify)
            if state is not _NONE:
                return state
        self.loaded_from = self.root
        if step is not None:
            candidates = [step]
        else:
            candidates = []
            pointer = self._read_latest()
            complete = sorted((i.step for i in self.list() if i.status == "complete"), reverse=True)
            if pointer is not None and pointer[0] >= (complete[0] if complete else -1):
                candidates.append(pointer[0])  # an older pointer is not "the latest" (see resume_choice)
            candidates += [s for s in complete if s not in candidates]
        if not candidates:
            raise NotACheckpointError(f"no checkpoint under {self.root}")
        from ucp.loading.loader import load as _load

        problems = []
        for s in candidates:
            try:
                state = _load(
                    self.path(s),
                    into=into,
                    strict=strict,  # type: ignore[call-overload]  # bool: either overload's result
                    verify=verify,
                    process_group=self.process_group,
                    aio_config=self.aio_config,
                    storage_options=self.storage_options,
                )
            except (CheckpointError, OSError) as exc:
                if step is not None:
                    raise
                log.warning("cannot load %s (%s); trying an older checkpoint", self.path(s), exc)
                problems.append(f"{step_name(s)}: {exc}")
                continue
            self.loaded_step = s
            return state
        raise NotACheckpointError(f"no loadable checkpoint under {self.root}: " + "; ".join(problems))

    def loaded_location(self) -> tuple[str, dict[str, Any] | None]:
        """(path or URL, its storage options) of the checkpoint the last :meth:`load` read: the local or
        the remote tier's copy of :attr:`loaded_step`."""
        if self.loaded_step is None:
            raise ValueError("nothing was loaded yet")
        if self.replicator is not None and self.loaded_from == self.replicator.remote_root:
            return f"{self.loaded_from}/{step_name(self.loaded_step)}", self.replicator.storage_options
        return self.path(self.loaded_step), self.storage_options

    def remote_manager(self) -> "CheckpointManager":
        """The remote tier as a manager of its own (listing, loading); ValueError when there is none."""
        if self.replicator is None:
            raise ValueError("this manager has no remote tier")
        return CheckpointManager(
            self.replicator.remote_root,
            storage_options=self.replicator.storage_options,
            process_group=self.process_group,
            aio_config=self.aio_config,
        )

    def _load_tiered(self, step: int | None, **kw: Any) -> Any:
        """Local copy when it is complete and loads (CRCs checked), else the remote one: the newest step either
        tier holds. ``_NONE`` when neither has it (the caller then tries older local checkpoints)."""
        remote = self.remote_manager()
        if self.node_local:
            return self._load_node_local(remote, step, **kw)
        local_step = self.latest() if step is None else step
        remote_step = remote.latest() if step is None else step
        want = max(s for s in (local_step, remote_step, -1) if s is not None)
        if want < 0:
            return _NONE
        if local_step == want and os.path.isdir(self.path(want)):
            try:
                state = self._load_one(want, self.root, **kw)
                return state
            except (CheckpointError, OSError) as exc:
                log.warning("cannot load %s (%s); trying the remote copy", self.path(want), exc)
        try:
            state = remote.load(want, **kw)
        except (CheckpointError, OSError) as exc:
            if step is not None:
                raise
            log.warning("cannot load %s (%s); trying older local checkpoints", remote.path(want), exc)
            return _NONE
        self.loaded_step, self.loaded_from = want, remote.root
        return state

    def _load_node_local(self, remote: "CheckpointManager", step: int | None, **kw: Any) -> Any:
        """A node-local tier: the ranks agree (through rank 0) on the step and on the tier — local only where
        every rank's disk holds the whole checkpoint (one node), else the remote copy; a local copy that
        fails to load on any rank sends every rank to the remote one."""
        from ucp.dist import resolve_group

        group = resolve_group(self.process_group)
        if step is None:
            local_step = self.latest()
        else:
            local_step = step if check_complete(self.path(step))[0] == "complete" else None
        remote_step = remote.latest() if step is None and group.rank == 0 else step
        views = group.gather((local_step, remote_step))
        choice: tuple[int, bool] | None = None
        if group.rank == 0:
            assert views is not None
            steps = [s for v in views for s in v if s is not None]
            if steps:
                want = max(steps)
                choice = (want, all(v[0] == want for v in views))
        choice = group.broadcast(choice)
        if choice is None:
            return _NONE
        want, use_local = choice
        error: str | None = None
        state: Any = None
        if use_local:
            try:
                state = self._load_one(want, self.root, **kw)
            except (CheckpointError, OSError) as exc:
                log.warning("cannot load %s (%s); trying the remote copy", self.path(want), exc)
                error = str(exc)
            errors = group.gather(error)
            failed = group.broadcast(errors is not None and any(e is not None for e in errors))
            if not failed:
                return state
        state = remote.load(want, **kw)
        self.loaded_step, self.loaded_from = want, remote.root
        return state

    def _load_one(self, step: int, root: str, **kw: Any) -> Any:
        from ucp.loading.loader import load as _load

        state = _load(self.path(step), process_group=self.process_group, aio_config=self.aio_config, **kw)
        self.loaded_step, self.loaded_from = step, root
        return state

    def close(self) -> None:
        """Wait for saves in flight and replications (errors are logged) and stop the background writers."""
        try:
            self.wait()
        except BaseException as exc:  # noqa: BLE001 - closing must not lose the others
            log.error("a checkpoint save failed: %s", exc)
        if self.saver is not None and self._own_saver:
            self.saver.close()
        if self.replicator is not None:
            self.replicator.close()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_NONE = object()  # _load_tiered: no tier had the step


def _failed(handle: SaveHandle) -> bool:
    """A finished save that raised (a cancelled one was stopped on purpose: nothing to report)."""
    return not handle.future.cancelled() and handle.exception() is not None
