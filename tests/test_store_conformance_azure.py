"""AzureStore passes the shared ObjectStore conformance suite, against Azurite."""

from __future__ import annotations

import pytest

from dcp_cloud.store.azure import AzureStore
from dcp_cloud.testing.conformance import ObjectStoreConformance


class TestAzureStoreConformance(ObjectStoreConformance):
    @pytest.fixture
    def store(self, azure_store: AzureStore) -> AzureStore:
        return azure_store
