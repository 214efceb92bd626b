"""Every object store of dcp_cloud passes the same conformance suite: the memory and local stores here; S3 in the
compatibility matrix (tests/compat: moto, s3rver and Ceph RGW, each with both clients), GCS and Azure in their own
modules."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dcp_cloud.store.local import LocalStore
from dcp_cloud.store.memory import MemoryStore
from dcp_cloud.store.protocol import ObjectStore
from dcp_cloud.testing.conformance import ObjectStoreConformance


@pytest.fixture(params=["memory", "local"])
def store(request: pytest.FixtureRequest, tmp_path) -> Iterator[ObjectStore]:
    if request.param == "memory":
        yield MemoryStore()
    else:
        root = tmp_path / "bucket"
        root.mkdir()
        yield LocalStore(root, fsync=False)


class TestStoreConformance(ObjectStoreConformance):
    @pytest.fixture
    def picklable(self, store: ObjectStore) -> bool:
        # MemoryStore keeps its objects (and a lock) in this process only.
        return store.scheme != "memory"


# -- LocalStore behaviour the shared suite cannot express ----------------------------------------

from dcp_cloud.errors import BucketNotFoundError, PreconditionFailedError, StoreError  # noqa: E402


def test_local_missing_root(tmp_path) -> None:
    store = LocalStore(tmp_path / "nope")
    with pytest.raises(BucketNotFoundError, match="nope"):
        store.check_bucket()
    with pytest.raises(BucketNotFoundError):
        store.put("a/b", b"x")
    with pytest.raises(BucketNotFoundError):
        store.get("a/b")
    with pytest.raises(BucketNotFoundError):
        list(store.list(""))
    assert not (tmp_path / "nope").exists()  # a write must not invent the bucket
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(BucketNotFoundError):
        LocalStore(tmp_path / "file").check_bucket()


@pytest.mark.parametrize(
    "key", ["", "/abs", "../up", "a/../b", "a//b", "a/./b", "dir/", ".dcp_cloud_uploads/x", "a/.dcp_cloud-tmp-1"]
)
def test_local_rejects_keys_outside_the_root_or_reserved(tmp_path, key: str) -> None:
    with pytest.raises(StoreError):
        LocalStore(tmp_path).put(key, b"x")
    assert list(tmp_path.iterdir()) == []


def test_local_key_and_directory_of_keys_conflict(tmp_path) -> None:
    store = LocalStore(tmp_path, fsync=False)
    store.put("a/b", b"x")
    with pytest.raises(StoreError, match="share the name"):
        store.put("a", b"y")
    store.put("c", b"z")
    with pytest.raises(StoreError):
        store.put("c/d", b"w")


def test_local_leaves_no_temporary_files(tmp_path) -> None:
    store = LocalStore(tmp_path)  # with fsync
    store.put("d/k", b"1", create_only=True)
    with pytest.raises(PreconditionFailedError):
        store.put("d/k", b"2", create_only=True)
    upload_id = store.create_multipart("d/m")
    parts = [store.put_part("d/m", upload_id, 1, b"a" * 10), store.put_part("d/m", upload_id, 2, b"b")]
    store.complete_multipart("d/m", upload_id, parts)
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["k", "m"]
    assert list((tmp_path / ".dcp_cloud_uploads").iterdir()) == []
    (tmp_path / "d" / ".dcp_cloud-tmp-stray").write_bytes(b"half written")
    assert [i.key for i in store.list("")] == ["d/k", "d/m"]


def test_local_delete_prunes_empty_directories(tmp_path) -> None:
    store = LocalStore(tmp_path, fsync=False)
    store.put("x/y/z", b"1")
    store.put("x/keep", b"2")
    store.delete(["x/y/z"])
    assert not (tmp_path / "x" / "y").exists()
    store.delete(["x/keep"])
    assert not (tmp_path / "x").exists() and tmp_path.is_dir()
    store.put("x", b"now a plain key")  # possible because nothing is left of the directory
    assert store.get("x") == b"now a plain key"


def test_local_stale_part_info_is_refused(tmp_path) -> None:
    store = LocalStore(tmp_path, fsync=False)
    upload_id = store.create_multipart("k")
    old = store.put_part("k", upload_id, 1, b"old")
    store.put_part("k", upload_id, 1, b"new")  # same size, and maybe the same mtime
    with pytest.raises(StoreError, match="replaced"):
        store.complete_multipart("k", upload_id, [old])
    with pytest.raises(StoreError):
        store.put_part("other-key", upload_id, 1, b"x")
