"""Several S3 implementations behind one interface, for tests that must hold on more than one server.

:class:`S3Target` is what a test needs of a running S3 server: its endpoint,
credentials and region, the environment that points a (child) process at
it, the multipart part limits it accepts, and a factory of fresh buckets.
The fixtures (loaded by the ``dcp_cloud`` pytest plugin) start each server
once per session and skip with the reason where it cannot start:

* ``moto_target``: the ``moto_server`` fixture's moto server (always available);
* ``s3rver_target``: s3rver (npm; ``python -m dcp_cloud.testing.servers.s3rver`` installs it);
* ``rgw_target``: a throwaway one-node Ceph cluster with a RADOS Gateway
  (:mod:`dcp_cloud.testing.servers.ceph_rgw`; needs the Debian/Ubuntu Ceph packages).

With ``DCP_CLOUD_REQUIRE_SERVERS=1`` in the environment (CI sets it) a
server that cannot start fails its tests instead of skipping them
(:mod:`dcp_cloud.testing.required`).

A test that takes a target::

    def test_roundtrip(rgw_target):
        bucket = rgw_target.new_bucket()
        os.environ.update(rgw_target.env())  # or monkeypatch / a child's env
        S3Store(bucket, S3Config(endpoint_url=rgw_target.endpoint_url)).put("k", b"v")

Buckets made by ``new_bucket`` are emptied and deleted when the session ends
(or earlier, with :meth:`S3Target.drop_buckets`).
"""

from __future__ import annotations

import contextlib
import os
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from ..store.protocol import PartLimits
from .required import server_unavailable
from .servers.moto_server import _CONFLICTING_ENV, MotoServer, moto_env


@dataclass
class S3Target:
    """A running S3 server a test can use (see the module docstring)."""

    #: ``"moto"``, ``"s3rver"`` or ``"rgw"``.
    name: str
    endpoint_url: str
    access_key: str
    secret_key: str
    region: str
    #: Part limits of a store on this server (the smallest part it accepts is lowered for tests where it can be).
    limits: PartLimits
    #: What the server is, for messages and reports (e.g. ``"Ceph RGW 16.2.15"``).
    description: str = ""
    _buckets: list[str] = field(default_factory=list, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _client: Any = field(default=None, repr=False)

    def env(self) -> dict[str, str]:
        """``AWS_*`` variables that point boto3 and dcp_cloud at this server, and hide the user's AWS files."""
        values = {
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": self.region,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        }
        no_proxy = ",".join(p for p in [os.environ.get("NO_PROXY", ""), "127.0.0.1"] if p)
        values.update(NO_PROXY=no_proxy, no_proxy=no_proxy)
        return values

    def child_env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """A full environment for a child process: ``base`` (default ``os.environ``) without the variables
        that would send it elsewhere, plus :meth:`env`."""
        source = dict(os.environ if base is None else base)
        env = {k: v for k, v in source.items() if k not in _CONFLICTING_ENV}
        env.update(self.env())
        return env

    def client(self) -> Any:
        """A plain boto3 client on the server (path-style, retries on), for arranging and checking tests."""
        from .servers.s3rver import client

        with self._lock:
            if self._client is None:
                self._client = client(self)
            return self._client

    def new_bucket(self, prefix: str = "dcp-compat") -> str:
        """Create a fresh, empty bucket and return its name."""
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        with self._lock:
            self._buckets.append(name)
        return name

    def drop_bucket(self, name: str) -> None:
        """Empty and delete one bucket (objects and pending uploads; errors ignored)."""
        from .servers.s3rver import empty_bucket

        client = self.client()
        with contextlib.suppress(Exception):
            empty_bucket(client, name)
            client.delete_bucket(Bucket=name)
        with self._lock:
            if name in self._buckets:
                self._buckets.remove(name)

    def drop_buckets(self) -> None:
        """Empty and delete every bucket :meth:`new_bucket` made."""
        with self._lock:
            names = list(self._buckets)
        for name in names:
            self.drop_bucket(name)

    def close(self) -> None:
        self.drop_buckets()
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()


def _target_fixture(make: Callable[[], S3Target]) -> Iterator[S3Target]:
    target = make()
    try:
        yield target
    finally:
        target.close()


@pytest.fixture(scope="session")
def moto_target(moto_server: MotoServer) -> Iterator[S3Target]:
    """The session's moto server as an :class:`S3Target` (multipart minimum 256 KiB)."""
    from .s3_fixtures import MOTO_PART_LIMITS

    env = moto_env(moto_server)
    yield from _target_fixture(
        lambda: S3Target(
            "moto",
            moto_server.endpoint_url,
            env["AWS_ACCESS_KEY_ID"],
            env["AWS_SECRET_ACCESS_KEY"],
            env["AWS_REGION"],
            MOTO_PART_LIMITS,
            "moto (server mode)",
        )
    )


@pytest.fixture(scope="session")
def s3rver_server() -> Iterator[Any]:
    """One s3rver process for the session; skips where node or the s3rver package is missing."""
    from .servers.s3rver import S3rver, missing_reason

    reason = missing_reason()
    if reason is not None:
        server_unavailable("s3rver", reason)
    with S3rver() as server:
        yield server


@pytest.fixture(scope="session")
def s3rver_target(s3rver_server: Any) -> Iterator[S3Target]:
    """The session's s3rver as an :class:`S3Target` (it takes parts of any size)."""
    from .servers.s3rver import VERSION

    limits = PartLimits(min_part_size=256 * 1024, max_part_size=5 * 1024**3, max_parts=10_000)
    yield from _target_fixture(
        lambda: S3Target(
            "s3rver",
            s3rver_server.endpoint_url,
            s3rver_server.access_key,
            s3rver_server.secret_key,
            s3rver_server.region,
            limits,
            f"s3rver {VERSION}",
        )
    )


@pytest.fixture(scope="session")
def ceph_rgw() -> Iterator[Any]:
    """A throwaway one-node Ceph cluster with a RADOS Gateway for the session (about 2 s to start, 5 s to
    stop); skips where the Ceph packages are missing."""
    from .servers.ceph_rgw import INSTALL_HINT, CephRGW, missing_programs

    missing = missing_programs()
    if missing:
        server_unavailable("Ceph RGW", f"not installed (missing {', '.join(missing)}): {INSTALL_HINT}")
    with CephRGW() as cluster:
        yield cluster


@pytest.fixture(scope="session")
def rgw_target(ceph_rgw: Any) -> Iterator[S3Target]:
    """The session's Ceph RGW as an :class:`S3Target` (multipart minimum lowered to 256 KiB)."""
    from .servers.ceph_rgw import MIN_PART_SIZE, version

    limits = PartLimits(min_part_size=MIN_PART_SIZE, max_part_size=5 * 1024**3, max_parts=10_000)
    yield from _target_fixture(
        lambda: S3Target(
            "rgw",
            ceph_rgw.endpoint_url,
            ceph_rgw.access_key,
            ceph_rgw.secret_key,
            ceph_rgw.region,
            limits,
            f"Ceph RGW {version()}",
        )
    )


__all__ = ["S3Target", "ceph_rgw", "moto_target", "rgw_target", "s3rver_server", "s3rver_target"]
