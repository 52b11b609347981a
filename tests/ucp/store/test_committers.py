"""The commit as one interface: the collective commit (ucp.save) and the file handshake (background writers)
take the same report and give the same outcome."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import pytest

import ucp
from ucp.dist import Group
from ucp.errors import CommitError
from ucp.format.tree import encode_state
from ucp.saving.background.handshake import HandshakeCommit
from ucp.saving.background.job import WriteJob
from ucp.store.commit import CollectiveCommit, Committer, RankReport, make_temp_dir
from ucp.store.storage import Storage, open_storage


def collective(storage: Storage, temp: str, name: str, path: Path) -> Committer:
    return CollectiveCommit(storage, temp, name, Group(0, 1), step=7, metadata={"run": "a"}, mesh=None)


def handshake(storage: Storage, temp: str, name: str, path: Path) -> Committer:
    job = WriteJob(id=1, path=str(path), name=name, temp=temp, step=7, metadata={"run": "a"})
    return HandshakeCommit(storage, job)


COMMITTERS = pytest.mark.parametrize("make", [collective, handshake], ids=["collective", "handshake"])


@COMMITTERS
def test_a_report_is_committed_as_the_checkpoint(
    tmp_path: Path, make: Callable[[Storage, str, str, Path], Committer]
) -> None:
    path = tmp_path / "ck"
    storage, name = open_storage(path)
    with storage:
        temp = make_temp_dir(storage, name)
        committer = make(storage, temp, name, path)
        assert isinstance(committer, Committer)
        manifest = committer.commit(RankReport(rank=0, state=encode_state({"epoch": 3, "lr": 0.5}).tree))
    assert manifest.step == 7 and manifest.metadata == {"run": "a"}
    assert os.listdir(tmp_path) == ["ck"]  # the temporary directory became the checkpoint
    assert ucp.read_manifest(path).step == 7
    assert ucp.load(path) == {"epoch": 3, "lr": 0.5}


@COMMITTERS
def test_an_error_report_commits_nothing_and_names_the_rank(
    tmp_path: Path, make: Callable[[Storage, str, str, Path], Committer]
) -> None:
    path = tmp_path / "ck"
    storage, name = open_storage(path)
    with storage:
        temp = make_temp_dir(storage, name)
        with pytest.raises(CommitError, match=r"rank 0.*OSError: disk full") as info:
            make(storage, temp, name, path).commit(RankReport(rank=0, error="OSError: disk full"))
    assert info.value.ranks == (0,)
    assert os.listdir(tmp_path) == []  # no checkpoint, no temporary directory left
