"""The commit of a background save whose ranks share no directory: the reports meet on an object store.

A node-local tier (``CheckpointManager(local, remote=URL, node_local=True, async_save=True)``,
:mod:`ucp.tiered`) has every rank write its data file into a temporary directory of *its own* disk,
so the file handshake (:mod:`ucp.saving.background.handshake`) has nowhere to meet. Its ranks meet
under the checkpoint's prefix on the remote store instead, with names carrying the save's token
(the hex suffix of the temporary directory every rank agreed on), so objects of an earlier attempt at
the same step are never taken for this one's:

1. each rank writes its data file (durable), then its :class:`~ucp.store.commit.RankReport` as
   ``<remote>/<step>/.ucp-report-<token>-rank-NNNNN.json`` (one PUT: whole or absent);
2. rank 0 collects the reports (a listing with backoff, up to ``commit_timeout``; an error report
   fails the save at once), builds the manifest, commits its *local* copy (manifest, rename), then
   publishes the manifest as ``<remote>/<step>/.ucp-manifest-<token>.json`` — not ``manifest.json``:
   the remote checkpoint is committed only after every rank uploaded its files (:func:`ucp.tiered.replicate_rank`);
3. the other ranks wait for that object (or for ``.ucp-abandoned-<token>.json``, rank 0's reason for
   giving up), check it holds their pieces, and commit their local copy (:func:`ucp.tiered.settle`).

A failure anywhere fails the save on every rank with nothing committed: each rank removes its own
temporary directory. No collectives (background threads must not use the training's process group).
"""

from __future__ import annotations

import json
import logging
import os
import time

from ucp.errors import CommitError
from ucp.format.manifest import Manifest, parse_manifest
from ucp.saving.background.handshake import commit_reports, drop_alive_files, manifest_holds, rank_failed
from ucp.saving.background.job import WriteJob, describe
from ucp.store import commit as _commit
from ucp.store.storage import Storage

log = logging.getLogger(__name__)

POLL_MIN, POLL_MAX = 0.01, 0.2  # seconds between listings of the remote prefix (each one a request)


def token(job: WriteJob) -> str:
    """The save's token: the random suffix of the temporary directory name every rank agreed on."""
    return job.temp.rsplit("-", 1)[-1]


def report_name(job: WriteJob, rank: int) -> str:
    return f".ucp-report-{token(job)}-rank-{rank:05d}.json"


def manifest_name(job: WriteJob) -> str:
    return f".ucp-manifest-{token(job)}.json"


def abandoned_name(job: WriteJob) -> str:
    return f".ucp-abandoned-{token(job)}.json"


def open_remote(job: WriteJob) -> Storage:
    from ucp.manager_remote import open_root

    assert job.handshake is not None
    return open_root(job.handshake.url, job.handshake.storage_options)


def _names(remote: Storage, name: str) -> set[str]:
    """The object names directly under ``<remote>/<name>/`` (empty when there are none)."""
    try:
        return set(remote.listdir(name))
    except FileNotFoundError:
        return set()


class StoreHandshakeCommit(_commit.Committer):
    """The commit of one background job of a node-local tier (see the module docstring)."""

    def __init__(self, storage: Storage, job: WriteJob) -> None:
        self.storage, self.job = storage, job  # the rank's local storage, where its temporary directory is

    def commit(self, report: _commit.RankReport) -> Manifest:
        job = self.job
        try:
            with open_remote(job) as remote:
                if job.rank == 0:
                    return self._lead(remote, report)
                return self._follow(remote, report)
        except BaseException:
            _commit.abort(self.storage, job.temp)  # nothing left of it once committed (renamed) here
            raise

    def _lead(self, remote: Storage, report: _commit.RankReport) -> Manifest:
        job = self.job
        try:
            if report.error is not None:
                raise rank_failed(self.storage, job, 0, report.error)
            manifest, data = commit_reports(self.storage, job, [report] + self._collect(remote))  # the local commit
            if job.world_size > 1:
                remote.write_small(f"{job.name}/{manifest_name(job)}", data)  # the other ranks' go-ahead
        except BaseException as exc:
            self._give_up(remote, describe(exc))
            raise
        for rank in range(1, job.world_size):
            try:
                remote.remove_file(f"{job.name}/{report_name(job, rank)}")
            except Exception as exc:  # noqa: BLE001 - harmless: the remote commit removes what is left
                log.debug("could not remove a report: %s", exc)
        return manifest

    def _collect(self, remote: Storage) -> list[_commit.RankReport]:
        """Every other rank's report, waiting up to ``commit_timeout``; CommitError on an error report."""
        job = self.job
        want = {report_name(job, r): r for r in range(1, job.world_size)}
        got: dict[int, _commit.RankReport] = {}
        deadline = time.monotonic() + job.commit_timeout
        delay = POLL_MIN
        while len(got) < len(want):
            for n in sorted(_names(remote, job.name) & want.keys()):
                if want[n] in got:
                    continue
                r = _commit.RankReport.model_validate_json(remote.read_small(f"{job.name}/{n}"))
                if r.error is not None:
                    raise rank_failed(self.storage, job, r.rank, r.error)
                got[want[n]] = r
            if len(got) == len(want):
                break
            if time.monotonic() > deadline:
                missing = sorted(set(want.values()) - set(got))
                raise CommitError(
                    f"save of {self.storage.describe(job.name)}: rank(s) {missing[:8]} did not report to "
                    f"{remote.describe(job.name)} within {job.commit_timeout:.0f}s (crashed, much slower, or "
                    "unable to reach the store?)",
                    ranks=missing,
                    reason=f"did not report within {job.commit_timeout:.0f}s",
                )
            time.sleep(delay)
            delay = min(delay * 2, POLL_MAX)
        return [got[r] for r in sorted(got)]

    def _give_up(self, remote: Storage, why: str) -> None:
        """Rank 0: leave the reason for the ranks waiting on the go-ahead (best effort)."""
        if self.job.world_size > 1:
            try:
                remote.write_small(f"{self.job.name}/{abandoned_name(self.job)}", json.dumps({"error": why}).encode())
            except Exception as exc:  # noqa: BLE001 - they fail at their timeout instead
                log.warning("could not tell the other ranks why the save was abandoned: %s", exc)

    def _follow(self, remote: Storage, report: _commit.RankReport) -> Manifest:
        job, where = self.job, self.storage.describe(self.job.name)
        remote.write_small(f"{job.name}/{report_name(job, job.rank)}", report.model_dump_json().encode())
        if report.error is not None:
            raise rank_failed(self.storage, job, job.rank, report.error)
        deadline = time.monotonic() + job.commit_timeout
        delay = POLL_MIN
        while True:
            names = _names(remote, job.name)
            if manifest_name(job) in names:
                manifest = parse_manifest(remote.read_small(f"{job.name}/{manifest_name(job)}"), source=where)
                break
            if abandoned_name(job) in names:
                try:
                    reason = str(json.loads(remote.read_small(f"{job.name}/{abandoned_name(job)}"))["error"])
                except (OSError, ValueError, KeyError, TypeError):
                    reason = "no reason left"
                raise CommitError(
                    f"rank 0 did not commit {where}: {reason}; rank {job.rank}'s data was written",
                    ranks=(0,),
                    reason=reason,
                )
            if time.monotonic() > deadline:
                raise CommitError(
                    f"rank 0 did not commit {where} within {job.commit_timeout:.0f}s (no go-ahead under "
                    f"{remote.describe(job.name)})",
                    ranks=(0,),
                    reason=f"no commit within {job.commit_timeout:.0f}s",
                )
            time.sleep(delay)
            delay = min(delay * 2, POLL_MAX)
        if not manifest_holds(manifest, job, report):
            raise CommitError(
                f"rank 0's manifest for {where} does not hold rank {job.rank}'s pieces", ranks=(0,), reason="mismatch"
            )
        from ucp.tiered import settle

        drop_alive_files(self.storage, job)  # every rank of this node reported: none is needed any more
        local = self.storage.local_path(job.name)
        assert local is not None  # a node-local tier is a local directory
        settle(os.path.dirname(local), job.name, manifest, job.rank, temp=self.storage.local_path(job.temp))
        return manifest


def abandon(job: WriteJob, why: str) -> None:
    """A job that never ran: remove its local temporary directory and tell rank 0 (an error report), or,
    on rank 0, leave the reason for the others."""
    storage, _ = job.open_storage()
    with storage:
        _commit.abort(storage, job.temp)
    publish_error(job, why)


def publish_error(job: WriteJob, why: str) -> None:
    """Put this rank's failure where the other ranks look (best effort)."""
    try:
        with open_remote(job) as remote:
            if job.rank == 0:
                remote.write_small(f"{job.name}/{abandoned_name(job)}", json.dumps({"error": why}).encode())
            else:
                data = _commit.RankReport(rank=job.rank, error=why).model_dump_json().encode()
                remote.write_small(f"{job.name}/{report_name(job, job.rank)}", data)
    except Exception as exc:  # noqa: BLE001 - the others fail at their timeout instead
        log.warning("could not report rank %d's failure to the store: %s", job.rank, exc)
