"""Tiered checkpoints without a shared file system: node-local saves and per-rank replication.

``CheckpointManager(local, remote=URL, node_local=True)`` (docs/object-stores.md, "Multi-node"):

* **local save** (:func:`save_node_local`): ``ucp.save``'s collective save, except that every rank
  writes its data file into *its own* ``local`` directory. Rank 0 commits as usual (manifest, rename);
  every other rank that finds its file in a temporary directory of its own disk then writes the
  committed manifest (every rank receives it from the commit's broadcast) beside it and renames that
  directory into place. A node's ``step-NNNNNNNN`` thus holds the manifest and only the data files of
  the ranks it runs: locally it lists as ``corrupt`` (files of other nodes missing) unless one
  node holds every rank. With ``async_save=True`` the save returns after the snapshot and the ranks,
  sharing no directory, commit their local copies through the store in the background
  (:mod:`ucp.saving.background.store_handshake`, through :func:`settle` on the other ranks);
* **replication** (:func:`replicate_rank`): every rank uploads the data files the manifest assigns
  to it (replicated tensors were written once, by one rank, so every piece reaches the store
  once), then writes a marker object ``<step>/.ucp-replicated-rank-NNNNN`` holding the save's id
  (:func:`save_id`). Rank 0 waits until the store holds this save's marker of every rank owning a file (a listing every ``POLL`` seconds, up to
  ``timeout``), checks the data objects' sizes against the manifest, writes the manifest (the
  commit), deletes the markers (every ``.ucp-`` object of the step), and then moves ``latest`` (``ucp.manager_remote.after_commit``).
  Markers on the store, not a collective: the uploads run on background threads, which must not
  issue collectives on the training's process group, and a marker survives the process that wrote
  it, so rank 0 needs nothing from the other ranks but the store.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import time
from typing import Any

from aio import AioConfig
from ucp.errors import CheckpointError
from ucp.format.manifest import MANIFEST_NAME, Manifest, parse_manifest
from ucp.store.storage import ByteWriter, LocalStorage, as_aio_config, remove_path

log = logging.getLogger(__name__)

MARKER_RE = re.compile(r"^\.ucp-replicated-rank-(\d+)$")
FAILED_RE = re.compile(r"^\.ucp-failed-rank-(\d+)$")
POLL = 0.05  # seconds between rank 0's listings of the markers


def save_id(manifest: Manifest) -> bytes:
    """What a rank's marker (and failure object) holds: the CRC-32C of the step's manifest, so rank 0
    never counts a marker an earlier attempt at the same step left behind (a resumed run saving that
    step again) as this save's, and never commits next to that attempt's data."""
    import crc32c

    return f"{crc32c.crc32c(manifest.to_json()):08x}".encode()


def marker_name(rank: int) -> str:
    return f".ucp-replicated-rank-{rank:05d}"


def failed_name(rank: int) -> str:
    """The object a rank whose upload failed leaves (its error inside), so rank 0 stops waiting at once."""
    return f".ucp-failed-rank-{rank:05d}"


class NodeLocalStorage(LocalStorage):
    """A node's local directory in a save whose ranks do not share one: a rank creates the temporary
    directory it writes into (rank 0 made it on its own disk only)."""

    def open_writer(self, rel: str, size_hint: int) -> ByteWriter:
        os.makedirs(os.path.dirname(self.path(rel)), exist_ok=True)
        return super().open_writer(rel, size_hint)


def save_node_local(
    state_dict: dict[str, Any],
    root: str,
    name: str,
    *,
    group: Any,
    step: int,
    metadata: dict[str, Any] | None,
    mesh: dict[str, int] | None,
    aio_config: AioConfig | dict[str, Any] | None = None,
    check_replicas: bool = False,
) -> Manifest:
    """Save ``root/name`` with every rank's data file on its own disk (see the module docstring); the manifest."""
    from ucp.saving.sync_save import save_with

    config = as_aio_config(aio_config)  # an AioConfig or a DeepSpeed-style dict, as every other save reads it
    os.makedirs(root, exist_ok=True)
    with NodeLocalStorage(root, config) as storage:
        manifest = save_with(
            storage,
            name,
            state_dict,
            group,
            step=step,
            metadata=metadata or {},
            mesh=mesh,
            check_replicas=check_replicas,
        )
    if group.rank != 0:
        settle(root, name, manifest, group.rank)
    return manifest


def settle(root: str, name: str, manifest: Manifest, rank: int, *, temp: str | None = None) -> None:
    """A non-zero rank after the commit: make the temporary directory holding its file ``root/name``,
    with the manifest. Nothing to do where rank 0 renamed it already (the ranks share a disk).
    ``temp``: the save's temporary directory (an asynchronous save knows it), else the one holding the file."""
    mine = [f for f, info in manifest.files.items() if info.rank == rank]
    final = os.path.join(root, name)
    if mine and os.path.exists(os.path.join(final, mine[0])):
        return
    temps = [
        os.path.join(root, d)
        for d in os.listdir(root)
        if d.startswith(f".{name}.tmp-") and (not mine or os.path.exists(os.path.join(root, d, mine[0])))
    ]
    if temp is not None:
        temps = [t for t in temps if os.path.abspath(t) == os.path.abspath(temp)]
    if not temps:
        if mine:
            raise CheckpointError(f"rank {rank}'s file {mine[0]} of {final} is neither there nor in a temporary dir")
        os.makedirs(final, exist_ok=True)  # a rank without data: the manifest alone
        temps = [final]
    temp = temps[0]
    data = manifest.to_json()
    with open(os.path.join(temp, MANIFEST_NAME), "wb") as f:
        f.write(data)
        os.fsync(f.fileno())
    if temp == final:
        return
    if os.path.exists(final):  # an older copy of this step on this node: replaced
        aside = os.path.join(root, f".{name}.old-{secrets.token_hex(6)}")
        try:
            os.rename(final, aside)
            remove_path(aside)
        except FileNotFoundError:
            pass
    try:
        os.rename(temp, final)
    except OSError:
        if not (mine and os.path.exists(os.path.join(final, mine[0]))):  # another rank of this node moved it
            raise


def replicate_rank(
    local_dir: str,
    remote_root: str,
    name: str,
    rank: int,
    storage_options: dict[str, Any] | None = None,
    *,
    timeout: float = 600.0,
) -> int:
    """Upload this rank's data files of the checkpoint at ``local_dir`` to ``<remote_root>/<name>`` and
    write its marker; rank 0 then commits once every rank's marker is there. Returns the bytes sent.
    A step whose remote manifest exists already is complete there: nothing is sent."""
    from ucp.manager_remote import open_root
    from ucp.replicate import upload_file

    manifest_path = os.path.join(local_dir, MANIFEST_NAME)
    with open(manifest_path, "rb") as f:
        manifest_bytes = f.read()
    manifest = parse_manifest(manifest_bytes, source=manifest_path)
    mine = {f: info for f, info in manifest.files.items() if info.rank == rank}
    ident = save_id(manifest)
    total = 0
    with open_root(remote_root, storage_options) as storage:
        if storage.exists(f"{name}/{MANIFEST_NAME}"):
            return 0
        try:
            for file, info in mine.items():
                total += upload_file(storage, os.path.join(local_dir, file), f"{name}/{file}", info.size)
        except Exception as exc:
            if rank != 0:
                try:
                    error = f"{type(exc).__name__}: {exc}".encode()
                    storage.write_small(f"{name}/{failed_name(rank)}", ident + b"\n" + error)
                except Exception as again:  # noqa: BLE001 - the store is unreachable: rank 0 times out instead
                    log.warning("could not report the failure to rank 0: %s", again)
            raise
        storage.write_small(f"{name}/{marker_name(rank)}", ident)
        if rank != 0:
            return total
        owners = {info.rank for info in manifest.files.values()} | {0}
        deadline = time.monotonic() + timeout
        seen: set[int] = set()
        while True:
            objects = {o["rel"].split("/", 1)[1]: int(o["size"]) for o in _objects(storage, name)}
            for n in objects:  # a marker counts once it holds this save's id (an old one may be overwritten yet)
                m = MARKER_RE.match(n)
                if m is not None and int(m.group(1)) not in seen and _read(storage, f"{name}/{n}") == ident:
                    seen.add(int(m.group(1)))
            for n in sorted(objects):
                m = FAILED_RE.match(n)
                text = _read(storage, f"{name}/{n}") if m is not None else None
                if m is not None and text is not None and text.startswith(ident + b"\n"):
                    why = text[len(ident) + 1 :].decode(errors="replace")
                    raise CheckpointError(
                        f"replicating {storage.describe(name)}: rank {int(m.group(1))} failed to upload its files "
                        f"({why}); not committed"
                    )
            if owners <= seen:
                break
            if time.monotonic() > deadline:
                raise CheckpointError(
                    f"replicating {storage.describe(name)}: ranks {sorted(owners - seen)} did not report their "
                    f"uploads within {timeout:.0f} s; not committed"
                )
            time.sleep(POLL)
        for file, info in manifest.files.items():
            if objects.get(file) != info.size:
                raise CheckpointError(
                    f"replicating {storage.describe(name)}: {file} has {objects.get(file)} bytes on the store, "
                    f"the manifest says {info.size}; not committed",
                    file=file,
                )
        storage.write_small(f"{name}/{MANIFEST_NAME}", manifest_bytes)  # the commit
        for n in objects:  # markers, failures and handshake objects (ucp.saving.background.store_handshake)
            if n.startswith(".ucp-"):
                try:
                    storage.remove_file(f"{name}/{n}")
                except (OSError, CheckpointError) as exc:  # harmless: readers go by the manifest
                    log.warning("could not remove %s: %s", storage.describe(f"{name}/{n}"), exc)
    return total + len(manifest_bytes)


def _read(storage: Any, rel: str) -> bytes | None:
    """A small object's bytes; None when it is gone (removed by a commit meanwhile)."""
    try:
        data: bytes = storage.read_small(rel)
    except FileNotFoundError:
        return None
    return data


def _objects(storage: Any, name: str) -> list[dict[str, Any]]:
    list_objects = getattr(storage, "list_objects", None)
    if list_objects is not None:
        return list(list_objects(name))
    try:
        return [{"rel": f"{name}/{n}", "size": storage.size(f"{name}/{n}")} for n in storage.listdir(name)]
    except FileNotFoundError:
        return []


def retire_local(root: str, keep_last: int, *, protect: set[str]) -> list[str]:
    """A node-local tier's retention (every rank, on its own disk): keep the ``keep_last`` highest step
    directories holding a manifest, and ``protect`` (steps not yet replicated); delete older ones."""
    from ucp.manager import STEP_RE

    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    steps = sorted(
        (n for n in names if STEP_RE.match(n) and os.path.exists(os.path.join(root, n, MANIFEST_NAME))),
        key=lambda n: -int(STEP_RE.match(n).group(1)),  # type: ignore[union-attr]
    )
    removed = []
    for n in steps[keep_last:]:
        if n in protect:
            continue
        aside = os.path.join(root, f".{n}.old-{secrets.token_hex(6)}")
        try:
            os.rename(os.path.join(root, n), aside)  # another rank of this node may have taken it first
        except OSError:
            continue
        remove_path(aside)
        removed.append(n)
    return removed
