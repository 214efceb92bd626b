"""What the S3 compatibility matrix is made of: its servers and clients, what each server does where S3
servers differ (``FACTS``), and :class:`Compat`, one cell of the matrix (see conftest.py for the fixtures)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dcp_cloud import S3Reader, S3Writer, TransferConfig
from dcp_cloud.store.s3 import S3Config, S3Store
from dcp_cloud.testing.s3_servers import S3Target

SERVERS = ("moto", "s3rver", "rgw")
CLIENTS = ("lean", "botocore")
#: Small parts, so a few hundred KiB of state already goes up as multipart uploads on every server.
SMALL_PARTS = TransferConfig(part_size=256 * 1024, multipart_threshold=256 * 1024)

#: What each server does where S3 servers differ, as the matrix finds it (docs/reference/s3-compatibility.md
#: shows the same table; tests/compat/test_compat_facts.py checks every entry against the servers).
FACTS: dict[str, dict[str, bool]] = {
    "moto": {
        "if_none_match_put": True,
        "if_none_match_complete": True,
        "list_uploads": True,
        "abort_uploads": True,
        "verifies_checksums": False,
        "complete_returns_etag": True,
        "aws_namespace": True,
        "byte_order_listing": True,
        "paginates_listings": True,
    },
    "s3rver": {
        "if_none_match_put": False,
        "if_none_match_complete": False,
        "list_uploads": False,
        "abort_uploads": False,
        "verifies_checksums": False,
        "complete_returns_etag": True,
        "aws_namespace": False,
        "byte_order_listing": False,
        "paginates_listings": False,
    },
    "rgw": {
        "if_none_match_put": True,
        "if_none_match_complete": False,
        "list_uploads": True,
        "abort_uploads": True,
        "verifies_checksums": False,
        "complete_returns_etag": False,
        "aws_namespace": True,
        "byte_order_listing": True,
        "paginates_listings": True,
    },
}

#: Whether the server's create-only PutObject holds between requests that race (one winner, always). Not a
#: probed fact (a race that happens to have one winner proves nothing): moto checks for the object and
#: stores it in two steps without a lock (moto/s3/responses.py, put_object), and the matrix's race tests
#: on moto 5.2.1 had two winners in two runs of fifteen; RGW commits the condition with the write
#: (8 racing writers: one 200, seven 412, every time); s3rver ignores the header altogether.
ATOMIC_CREATE_ONLY: dict[str, bool] = {"moto": False, "s3rver": False, "rgw": True}


@dataclass
class Compat:
    """One cell of the matrix: a server, a client, a fresh bucket."""

    target: S3Target
    client: str
    bucket: str
    #: An AWS config file naming a profile: the command line takes botocore where a profile is set.
    profile_file: Path

    @property
    def server(self) -> str:
        return self.target.name

    @property
    def facts(self) -> dict[str, bool]:
        return FACTS[self.server]

    def uri(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix.strip('/')}"

    def config(self) -> S3Config:
        return S3Config(endpoint_url=self.target.endpoint_url, region=self.target.region, client=self.client)

    def store(self) -> S3Store:
        return S3Store(self.bucket, self.config(), limits=self.target.limits, request_timeout=30.0)

    def writer(self, uri: str, **kw: Any) -> S3Writer:
        kw.setdefault("transfer", SMALL_PARTS)
        return S3Writer(uri, config=self.config(), part_limits=self.target.limits, **kw)

    def reader(self, uri: str, **kw: Any) -> S3Reader:
        return S3Reader(uri, config=self.config(), **kw)

    def cli_env(self) -> dict[str, str]:
        """Variables under which ``dcp-cloud`` reaches the server with this cell's client: the lean client
        by default; botocore where a profile is named (as for a user with ``AWS_PROFILE``)."""
        env = self.target.env()
        if self.client == "botocore":
            env.update(AWS_PROFILE="compat", AWS_CONFIG_FILE=str(self.profile_file))
        return env

    def child_env(self) -> dict[str, str]:
        return self.target.child_env()

    def keys(self, prefix: str) -> list[str]:
        """Keys under ``prefix`` as boto3 lists them (not dcp_cloud)."""
        pages = self.target.client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))
