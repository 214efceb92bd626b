"""Every object store of dcp_cloud passes the same conformance suite."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dcp_cloud.store.local import LocalStore
from dcp_cloud.store.memory import MemoryStore
from dcp_cloud.store.protocol import ObjectStore
from dcp_cloud.testing.conformance import ObjectStoreConformance


@pytest.fixture(params=["memory", "local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path) -> Iterator[ObjectStore]:
    if request.param == "memory":
        yield MemoryStore()
    elif request.param == "local":
        root = tmp_path / "bucket"
        root.mkdir()
        yield LocalStore(root, fsync=False)
    else:
        yield request.getfixturevalue("s3_store")


class TestStoreConformance(ObjectStoreConformance):
    @pytest.fixture
    def picklable(self, store: ObjectStore) -> bool:
        # MemoryStore keeps its objects (and a lock) in this process only.
        return store.scheme != "memory"
