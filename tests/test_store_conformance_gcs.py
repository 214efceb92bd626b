"""GCSStore passes the shared ObjectStore conformance suite, against fake-gcs-server."""

from __future__ import annotations

import pytest

from dcp_cloud.store.gcs import GCSStore
from dcp_cloud.testing.conformance import ObjectStoreConformance


class TestGCSStoreConformance(ObjectStoreConformance):
    @pytest.fixture
    def store(self, gcs_store: GCSStore) -> GCSStore:
        return gcs_store
