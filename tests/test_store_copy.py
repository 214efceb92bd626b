"""Server-side copies beyond the conformance suite: across buckets, and S3's UploadPartCopy path."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import pytest

from dcp_cloud import ObjectNotFoundError
from dcp_cloud.store.local import LocalStore


def _blob(n: int) -> bytes:
    return os.urandom(n)


def test_s3_copy_in_parts_above_the_single_copy_limit(s3_store: Any, moto_server: Any) -> None:
    calls: list[str] = []
    client = s3_store._full_client()  # copies go through botocore's client, whichever sends the data
    client.meta.events.register("before-call.s3.*", lambda model, **kw: calls.append(model.name))
    s3_store.copy_part_size = 256 * 1024  # S3's 5 GiB, scaled down to the test server's part minimum
    data = _blob(700 * 1024)
    s3_store.put("big/src", data)
    calls.clear()
    info = s3_store.copy("big/src", "big/dst")
    assert info.size == len(data)
    assert s3_store.get("big/dst") == data
    assert calls.count("UploadPartCopy") == 3 and "CopyObject" not in calls
    assert s3_store.list_multipart("big/") == []


def test_s3_copy_across_buckets(s3_store: Any, moto_s3_client: Any) -> None:
    other = f"dcp-test-{uuid.uuid4().hex[:16]}"
    moto_s3_client.create_bucket(Bucket=other)
    moto_s3_client.put_object(Bucket=other, Key="a/b", Body=b"from the other bucket")
    s3_store.copy("a/b", "copied", source_bucket=other)
    assert s3_store.get("copied") == b"from the other bucket"
    with pytest.raises(ObjectNotFoundError):
        s3_store.copy("a/missing", "copied", source_bucket=other)


def test_gcs_copy_across_buckets(gcs_store: Any, gcs_emulator: Any) -> None:
    from dcp_cloud.store.gcs import GCSConfig, GCSStore

    other = f"dcp-test-{uuid.uuid4().hex[:16]}"
    gcs_emulator.create_bucket(other)
    try:
        source = GCSStore(other, GCSConfig(endpoint=gcs_emulator.endpoint))
        source.put("a/b", b"from the other bucket")
        gcs_store.copy("a/b", "copied", source_bucket=other)
        assert gcs_store.get("copied") == b"from the other bucket"
        source.close()
    finally:
        gcs_emulator.delete_bucket(other)


def test_local_copy_across_roots(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    source = LocalStore(tmp_path / "a", fsync=False)
    data = _blob(3 * 1024 * 1024 + 5)
    source.put("x/y", data)
    target = LocalStore(tmp_path / "b", fsync=False)
    info = target.copy("x/y", "z", source_bucket=str(tmp_path / "a"))
    assert info.size == len(data) and (tmp_path / "b" / "z").read_bytes() == data
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["z"]  # no temporary left
    with pytest.raises(ObjectNotFoundError):
        target.copy("x/missing", "z2", source_bucket=str(tmp_path / "a"))
