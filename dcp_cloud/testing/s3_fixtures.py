"""pytest fixtures for S3 tests against a real moto server (loaded by the ``dcp_cloud`` plugin).

* ``moto_server`` (session): one :class:`~dcp_cloud.testing.servers.moto_server.MotoServer`
  with the multipart minimum lowered to :data:`MOTO_MIN_PART_SIZE` (256 KiB).
* ``s3_env``: points the ``AWS_*`` environment of this process at it, with fake
  credentials, and hides the user's own AWS configuration.
* ``s3_bucket``: resets the server and yields the name of a fresh, empty bucket.
* ``s3_store``: an :class:`~dcp_cloud.store.s3.S3Store` on that bucket whose
  limits match the lowered minimum.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from ..store.protocol import PartLimits
from .servers.moto_server import (
    _CONFLICTING_ENV,
    DEFAULT_REGION,
    FAKE_ACCESS_KEY_ID,
    FAKE_SECRET_ACCESS_KEY,
    MotoServer,
    moto_env,
)

#: Smallest multipart part the ``moto_server`` fixture accepts (S3's is 5 MiB).
MOTO_MIN_PART_SIZE = 256 * 1024
#: Part limits of a store on the ``moto_server`` fixture.
MOTO_PART_LIMITS = PartLimits(min_part_size=MOTO_MIN_PART_SIZE, max_part_size=5 * 1024**3, max_parts=10_000)


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoServer]:
    """A moto S3 server for the whole session (multipart minimum 256 KiB)."""
    server = MotoServer(min_part_size=MOTO_MIN_PART_SIZE)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_env(moto_server: MotoServer, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Point boto3 in this process at ``moto_server`` with fake credentials; returns the variables set."""
    for name in _CONFLICTING_ENV:
        monkeypatch.delenv(name, raising=False)
    # Keep the user's ~/.aws files (profiles, endpoints, addressing style) out of tests.
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    values = moto_env(moto_server)
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    return values


def moto_client(server: MotoServer, service: str = "s3") -> Any:
    """A boto3 client for ``service`` on ``server`` with the fake credentials (for setting tests up)."""
    import boto3

    return boto3.session.Session().client(
        service,
        endpoint_url=server.endpoint_url,
        region_name=DEFAULT_REGION,
        aws_access_key_id=FAKE_ACCESS_KEY_ID,
        aws_secret_access_key=FAKE_SECRET_ACCESS_KEY,
    )


@pytest.fixture(scope="session")
def moto_s3_client(moto_server: MotoServer) -> Iterator[Any]:
    """A boto3 S3 client on ``moto_server`` (fake credentials), to arrange test data directly."""
    client = moto_client(moto_server)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def s3_bucket(moto_server: MotoServer, moto_s3_client: Any, s3_env: dict[str, str]) -> str:
    """Name of a fresh, empty bucket on a freshly reset ``moto_server``."""
    moto_server.reset()
    name = f"dcp-test-{uuid.uuid4().hex[:16]}"
    moto_s3_client.create_bucket(Bucket=name)
    return name


@pytest.fixture
def s3_store(s3_bucket: str) -> Iterator[object]:
    """An S3Store on ``s3_bucket``, configured from the environment ``s3_env`` set."""
    from ..store.s3 import S3Store

    store = S3Store(s3_bucket, limits=MOTO_PART_LIMITS, request_timeout=30.0)
    try:
        yield store
    finally:
        store.close()


__all__ = [
    "MOTO_MIN_PART_SIZE",
    "MOTO_PART_LIMITS",
    "moto_client",
    "moto_s3_client",
    "moto_server",
    "s3_bucket",
    "s3_env",
    "s3_store",
]
