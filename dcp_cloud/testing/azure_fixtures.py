"""pytest fixtures for code that talks to Azure Blob Storage, backed by a local Azurite.

Loaded by the ``dcp_cloud`` pytest plugin (installed with the package), so a user's test suite can simply
ask for them:

* ``azurite_server`` (session): a running :class:`~dcp_cloud.testing.servers.azurite.Azurite`;
* ``azure_env``: ``AZURE_STORAGE_CONNECTION_STRING`` set in ``os.environ`` for the test (inherited by
  child processes; the user's other ``AZURE_STORAGE_*`` variables are hidden); the dict is returned;
* ``azure_container``: the name of a fresh, empty container, deleted with its blobs after the test;
* ``azure_store``: an :class:`~dcp_cloud.store.azure.AzureStore` bound to ``azure_container``.

Tests that need Azurite are skipped where node or Azurite is missing (``python -m
dcp_cloud.testing.servers.azurite`` installs it), and fail instead under ``DCP_CLOUD_REQUIRE_SERVERS=1`` (CI), as
every server fixture does (:mod:`dcp_cloud.testing.required`).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from .required import server_unavailable
from .servers.azurite import Azurite, missing_reason

__all__ = ["azure_container", "azure_env", "azure_store", "azurite_server"]


@pytest.fixture(scope="session")
def azurite_server() -> Iterator[Azurite]:
    """An Azurite Blob service for the whole session (127.0.0.1, free port, temporary data directory)."""
    reason = missing_reason()
    if reason is not None:
        server_unavailable("Azurite", reason)
    with Azurite() as server:
        yield server


@pytest.fixture
def azure_env(azurite_server: Azurite, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Point Azure clients (in this process and its children) at ``azurite_server``."""
    for name in list(os.environ):
        if name.startswith("AZURE_STORAGE_"):
            monkeypatch.delenv(name)
    env = azurite_server.env()
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


@pytest.fixture
def azure_container(azurite_server: Azurite) -> Iterator[str]:
    """A fresh empty container on Azurite; removed (with its blobs) afterwards."""
    name = f"dcp-test-{uuid.uuid4().hex[:16]}"
    azurite_server.create_container(name)
    yield name
    azurite_server.delete_container(name)


@pytest.fixture
def azure_store(azure_env: dict[str, str], azure_container: str) -> Iterator[object]:
    """An AzureStore on ``azure_container`` (credentials from the connection string ``azure_env`` set)."""
    from ..store.azure import AzureStore

    store = AzureStore(azure_container, request_timeout=30.0)
    yield store
    store.close()
