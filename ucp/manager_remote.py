"""A :class:`ucp.CheckpointManager` root on an object store (``s3://bucket/run``): no rename, no locks.

The same layout as a local root — ``step-NNNNNNNN/`` checkpoints and a ``latest`` pointer — with
the semantics an object store allows (docs/object-stores.md):

* a checkpoint is committed by its ``manifest.json``, written last (``ucp.store.commit``): a
  step prefix without one is a save in flight or an interrupted one (``incomplete``), never loaded;
* ``latest`` is one small object (``{"step", "name"}``) written in one PUT *after* the commit, and
  only forward: it is left alone when it names a complete higher step;
* retention deletes whole prefixes, oldest first, each one's manifest first (so a kill mid-delete
  leaves an incomplete prefix, never a "complete" one missing data), and never the checkpoint
  ``latest`` names, the one just saved, or the newest complete one;
* leftovers of interrupted saves (incomplete step prefixes) older than the newest complete
  checkpoint are deleted by the next save; newer ones may be saves still in flight and are kept.

There are no locks on an object store: two managers writing one root at once may race on
``latest`` (each write is whole; the later PUT wins), which a local root's ``flock`` prevents.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from ucp.errors import CheckpointError
from ucp.format.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, parse_manifest
from ucp.store.commit import SAVING_MARKER
from ucp.store.storage import Storage, open_storage

log = logging.getLogger(__name__)

LATEST = "latest"


def open_root(root: str, storage_options: dict[str, Any] | None = None) -> Storage:
    """The storage rooted at manager root ``root`` (a URL)."""
    storage, _ = open_storage(f"{root.rstrip('/')}/{LATEST}", storage_options=storage_options)
    return storage


def read_latest(storage: Storage) -> tuple[int, str] | None:
    """(step, name) from the ``latest`` object; None when it is missing, unreadable or inconsistent."""
    from ucp.manager import STEP_RE

    try:
        data = json.loads(storage.read_small(LATEST))
        step, name = data["step"], data["name"]
    except (OSError, CheckpointError, ValueError, KeyError, TypeError):
        return None
    match = STEP_RE.match(name) if isinstance(name, str) else None
    if isinstance(step, int) and not isinstance(step, bool) and match and int(match.group(1)) == step:
        return step, name
    return None


def write_latest(storage: Storage, step: int, name: str) -> bool:
    """Point ``latest`` at ``name`` (one PUT, after the commit), never backwards; False when left as it was."""
    current = read_latest(storage)
    if current is not None and current[0] > step and check_complete(storage, current[1])[0] == "complete":
        return False
    storage.write_small(LATEST, (json.dumps({"step": step, "name": name}) + "\n").encode())
    return True


def _tree(storage: Storage) -> dict[str, dict[str, int]]:
    """Entry name -> {file name: size} of every object one level below the root's entries, in one listing."""
    list_objects = getattr(storage, "list_objects", None)
    out: dict[str, dict[str, int]] = {}
    if list_objects is None:  # a generic backend: one request per entry
        try:
            names = storage.listdir("")
        except FileNotFoundError:
            return {}
        for name in names:
            try:
                out[name] = {n: storage.size(f"{name}/{n}") for n in storage.listdir(name)}
            except OSError:
                out[name] = {}
        return out
    for o in list_objects(""):
        name, _, rest = o["rel"].partition("/")
        if rest and "/" not in rest:
            out.setdefault(name, {})[rest] = int(o["size"])
    return out


# A committed manifest never changes: (checkpoint URL, manifest size, data files' sizes) -> the parsed manifest
_MANIFESTS: dict[tuple[str, int], Any] = {}


def check_complete(
    storage: Storage, name: str, objects: dict[str, int] | None = None
) -> tuple[str, Any, str | None, int]:
    """(status, manifest or None, detail, bytes under the prefix) of step prefix ``name``; ``objects``
    (file name -> size) when the caller listed them already."""
    if objects is None:
        objects = _tree(storage).get(name, {})
    size = sum(objects.values())
    if MANIFEST_NAME not in objects:
        why = "a save in flight, or an interrupted one" if SAVING_MARKER in objects else "not a checkpoint"
        return "incomplete", None, f"no {MANIFEST_NAME} ({why})", size
    if objects[MANIFEST_NAME] > MAX_MANIFEST_BYTES:
        return "corrupt", None, f"{MANIFEST_NAME} is larger than {MAX_MANIFEST_BYTES} bytes", size
    key = (storage.describe(name), objects[MANIFEST_NAME])
    manifest = _MANIFESTS.get(key)
    if manifest is None:
        try:
            manifest = parse_manifest(
                storage.read_small(f"{name}/{MANIFEST_NAME}"), source=storage.describe(f"{name}/{MANIFEST_NAME}")
            )
        except FileNotFoundError:
            return "incomplete", None, f"no {MANIFEST_NAME}", size
        except (OSError, CheckpointError) as exc:
            return "corrupt", None, str(exc), size
        if len(_MANIFESTS) > 256:
            _MANIFESTS.clear()
        _MANIFESTS[key] = manifest
    for file, info in manifest.files.items():
        if file not in objects:
            return "corrupt", manifest, f"data file {file!r} is missing", size
        if objects[file] != info.size:
            return (
                "corrupt",
                manifest,
                f"data file {file!r} has {objects[file]} bytes, the manifest says {info.size}",
                size,
            )
    return "complete", manifest, None, size


def list_checkpoints(storage: Storage) -> list[Any]:
    """Every step prefix under the root, by step, as :class:`ucp.manager.CheckpointInfo` (one listing of
    the root, and a manifest read only for checkpoints not seen before)."""
    from ucp.manager import STEP_RE, CheckpointInfo

    try:
        tree = _tree(storage)
    except FileNotFoundError:
        return []
    pointer = read_latest(storage)
    out = []
    for name, objects in tree.items():
        m = STEP_RE.match(name)
        if m is None:
            continue
        status, manifest, detail, size = check_complete(storage, name, objects)
        out.append(
            CheckpointInfo(
                step=int(m.group(1)),
                name=name,
                path=storage.describe(name),
                size=size,
                status=status,
                latest=pointer is not None and pointer[1] == name and status == "complete",
                created=manifest.created if manifest is not None else None,
                detail=detail,
            )
        )
    out.sort(key=lambda i: (i.step, i.name))
    return out


def clean_leftovers(storage: Storage, *, keep: set[str] = frozenset()) -> list[str]:  # type: ignore[assignment]
    """Delete incomplete step prefixes older than the newest complete checkpoint (interrupted saves; newer
    ones may still be in flight), except those in ``keep`` (names). Returns what was removed."""
    infos = list_checkpoints(storage)
    complete = [i.step for i in infos if i.status == "complete"]
    if not complete:
        return []
    newest = max(complete)
    removed = []
    for i in infos:
        if i.status == "incomplete" and i.step < newest and i.name not in keep:
            storage.remove_tree(i.name)
            removed.append(i.name)
    return removed


def apply_retention(storage: Storage, keep_last: int, *, protect: set[str] = frozenset()) -> list[str]:  # type: ignore[assignment]
    """Keep ``keep_last`` complete checkpoints — ``latest``'s, ``protect`` and the newest first, then the
    highest steps — and delete the others' whole prefixes, oldest first."""
    pointer = read_latest(storage)
    complete = sorted((i for i in list_checkpoints(storage) if i.status == "complete"), key=lambda i: -i.step)
    if not complete:
        return []
    keep = {complete[0].name} | {i.name for i in complete if i.name in protect}
    if pointer is not None:
        keep.add(pointer[1])
    for info in complete:
        if len(keep) >= keep_last:
            break
        keep.add(info.name)
    removed = []
    for info in sorted((i for i in complete if i.name not in keep), key=lambda i: i.step):
        try:
            storage.remove_tree(info.name)  # its manifest first: it stops being a checkpoint at once
        except (OSError, CheckpointError) as exc:
            log.warning("could not retire %s: %s", info.path, exc)
            continue
        removed.append(info.name)
    return removed


def discard_failed(root: str, name: str, storage_options: dict[str, Any] | None = None) -> bool:
    """Delete every object a failed save or replication left under step prefix ``name`` of ``root``, unless
    the prefix holds a complete checkpoint (the failure came after its commit: it stays). When ``latest``
    names the discarded step (a step saved again in place, which failed), it is pointed back at the newest
    complete checkpoint, or deleted when there is none, so it never names a partial one. True when
    something was deleted; errors (the store unreachable) propagate, for the caller to retry later.

    Multipart uploads are not listed here: ``obstore`` cannot list them. It aborts its own upload when an
    upload fails; where that abort fails too (the store unreachable), only a bucket lifecycle rule
    (``AbortIncompleteMultipartUpload``) removes the parts (docs/object-stores.md)."""
    with open_root(root, storage_options) as storage:
        list_objects = getattr(storage, "list_objects", None)
        objects = None
        if list_objects is not None:  # this prefix only, not the whole root
            objects = {}
            for o in list_objects(name):
                rest = o["rel"].partition("/")[2]
                if rest and "/" not in rest:
                    objects[rest] = int(o["size"])
        status, _, _, _ = check_complete(storage, name, objects)
        if status == "complete":
            return False
        storage.remove_tree(name)
        pointer = read_latest(storage)
        if pointer is not None and pointer[1] == name:
            complete = [i for i in list_checkpoints(storage) if i.status == "complete"]
            if complete:
                newest = max(complete, key=lambda i: i.step)
                storage.write_small(LATEST, (json.dumps({"step": newest.step, "name": newest.name}) + "\n").encode())
            else:
                storage.remove_file(LATEST)
        return True


def after_commit(
    root: str, step: int, name: str, keep_last: int | None, storage_options: dict[str, Any] | None = None
) -> None:
    """After a committed save under an object-store root: move ``latest``, then apply retention."""
    with open_root(root, storage_options) as storage:
        try:
            write_latest(storage, step, name)
        except (OSError, CheckpointError) as exc:
            log.warning("%s is saved, but %s could not be updated: %s", storage.describe(name), LATEST, exc)
        if keep_last is not None:
            apply_retention(storage, keep_last, protect={name})
