"""pytest fixtures for a real S3 endpoint on loopback (moto's server, started by ``tools/s3_server.py``).

``s3_server`` is one authenticating server per test session (moto's auth switch is process-wide);
``s3_bucket`` makes a fresh bucket for a test and points the usual AWS variables at the server,
so the code under test finds it exactly as it would find AWS S3 or MinIO. Tests using them skip
when ``moto[server]`` or ``obstore`` (the ``test`` / ``s3`` extras) is not installed.
"""

from __future__ import annotations

import atexit
import itertools
import os
from typing import Any

import pytest

_ids = itertools.count()


_server: Any = None


@pytest.fixture(scope="session")
def s3_server() -> Any:
    """The process's one server: started on first use, stopped at exit. (Test modules import this
    fixture, and pytest counts each import as a fixture of its own, so a session scope alone would
    start one per module; moto's auth switch allows one.)"""
    global _server
    pytest.importorskip("moto.server", reason="moto[server] (the test extra) is not installed")
    pytest.importorskip("obstore", reason="obstore (the s3 extra) is not installed")
    if _server is None:
        from tools.s3_server import start_server

        _server = start_server()
        atexit.register(_server.stop)
    return _server


@pytest.fixture()
def s3_bucket(s3_server: Any, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh, empty bucket's name; the AWS environment points at the loopback server."""
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    return s3_server.make_bucket(f"ucp-test-{os.getpid()}-{next(_ids)}")


def multipart_uploads(server: Any, bucket: str) -> list[dict[str, Any]]:
    """The multipart uploads the server still holds for ``bucket`` (orphans, after a failed upload)."""
    return list(server.client().list_multipart_uploads(Bucket=bucket).get("Uploads", []))


def object_keys(server: Any, bucket: str, prefix: str = "") -> list[str]:
    pages = server.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"] for page in pages for o in page.get("Contents", []))
