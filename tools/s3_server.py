"""A real S3 endpoint on loopback for tests and benchmarks: moto's S3 server (``moto[server]``).

moto is the only S3 server the package registries reachable here offer; ``ucp`` talks to it as to
any S3 endpoint (AWS S3, MinIO, GCS's S3 API): through ``AWS_ENDPOINT_URL`` and the usual
credential variables, nothing in ``ucp`` knows it is moto.

With ``auth=True`` the server checks requests against its own IAM (moto's
``INITIAL_NO_AUTH_ACTION_COUNT``): the first three requests create a user with an S3 policy and
an access key, and every later request must be signed with that key, so wrong credentials are
refused as on AWS (403). That setting is process-wide, so start at most one authenticating
server per process.

Run ``python tools/s3_server.py [--port N] [--bucket NAME]`` to serve until interrupted; it prints
the environment to export.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

POLICY = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
REGION = "us-east-1"


@dataclass
class S3Server:
    """A running loopback server: its URL, an access key it accepts, and how to stop it."""

    server: Any
    url: str
    key: str
    secret: str
    buckets: list[str] = field(default_factory=list)

    def env(self) -> dict[str, str]:
        """The AWS variables that point a client at this server."""
        return {
            "AWS_ENDPOINT_URL": self.url,
            "AWS_ACCESS_KEY_ID": self.key,
            "AWS_SECRET_ACCESS_KEY": self.secret,
            "AWS_REGION": REGION,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_EC2_METADATA_DISABLED": "true",  # never look for instance credentials off this machine
        }

    def client(self, **overrides: Any) -> Any:
        """A boto3 S3 client for this server (tests use it to look behind ucp's back: multipart uploads)."""
        import boto3

        kw: dict[str, Any] = dict(
            endpoint_url=self.url, aws_access_key_id=self.key, aws_secret_access_key=self.secret, region_name=REGION
        )
        kw.update(overrides)
        return boto3.client("s3", **kw)

    def make_bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        self.buckets.append(name)
        return name

    def stop(self) -> None:
        self.server.stop()


def start_server(*, port: int = 0, auth: bool = True) -> S3Server:
    """Start moto's S3 server on 127.0.0.1 (``port`` 0: a free one) in a thread of this process."""
    import moto.settings
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    host, real_port = server.get_host_and_port()
    url = f"http://{host}:{real_port}"
    key, secret = "testing", "testing"
    if auth:
        import boto3

        moto.settings.INITIAL_NO_AUTH_ACTION_COUNT = 3
        iam = boto3.client(
            "iam", endpoint_url=url, aws_access_key_id=key, aws_secret_access_key=secret, region_name=REGION
        )
        iam.create_user(UserName="ucp")
        iam.put_user_policy(UserName="ucp", PolicyName="s3", PolicyDocument=json.dumps(POLICY))
        access = iam.create_access_key(UserName="ucp")["AccessKey"]
        key, secret = access["AccessKeyId"], access["SecretAccessKey"]
    return S3Server(server=server, url=url, key=key, secret=secret)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--bucket", action="append", default=[], help="create this bucket (repeatable)")
    ap.add_argument("--no-auth", action="store_true", help="accept any credentials")
    args = ap.parse_args()
    srv = start_server(port=args.port, auth=not args.no_auth)
    for b in args.bucket:
        srv.make_bucket(b)
    for k, v in srv.env().items():
        print(f"export {k}={v}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        srv.stop()


if __name__ == "__main__":
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    main()
