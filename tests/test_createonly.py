"""The create-only commit's probe (dcp_cloud.format.createonly) on a moto server: servers that honour
If-None-Match are recognised and the probe leaves nothing behind; a probe that cannot be deleted does not
fail the commit; trusted stores (AWS itself, local, memory) are not probed. The servers that ignore the
precondition (s3rver) are in tests/compat/test_compat_commit.py."""

from __future__ import annotations

import pytest

from dcp_cloud.errors import PreconditionFailedError
from dcp_cloud.format import createonly
from dcp_cloud.store.memory import MemoryStore
from dcp_cloud.store.s3 import S3Config, S3Store
from dcp_cloud.testing.faults import FaultyStore, StoreFaultPlan

PROBE = f"run/step-1/{createonly.PROBE_NAME}"


def test_a_server_that_honours_create_only_is_recognised(s3_store: S3Store) -> None:
    assert not s3_store.trusts_create_only()  # a custom endpoint: probed
    counted = FaultyStore(s3_store)
    assert createonly.honours_create_only(counted, PROBE, None)
    calls, _ = counted.counts()
    assert (calls["put"], calls["delete"]) == (2, 1)
    assert list(s3_store.list("run/")) == []


def test_the_verdict_is_kept_per_cache_key(s3_store: S3Store) -> None:
    counted = FaultyStore(s3_store)
    key = ("test", s3_store.bucket)
    createonly._verdicts.pop(key, None)
    for _ in range(3):
        createonly.put_create_only(counted, f"run/{_}/.metadata", b"m", key)
    calls, _ = counted.counts()
    assert calls["put"] == 2 + 3  # one probe (two puts), then only the commits


def test_a_probe_that_cannot_be_deleted_does_not_fail_the_commit(s3_store: S3Store) -> None:
    denied = FaultyStore(s3_store, StoreFaultPlan(fail_nth={"delete": 1}))
    createonly.put_create_only(denied, "run/step-1/.metadata", b"meta", None)
    assert s3_store.get("run/step-1/.metadata") == b"meta"
    assert [o.key for o in s3_store.list("run/")] == ["run/step-1/.metadata", PROBE]  # rm knows the probe
    with pytest.raises(PreconditionFailedError):  # the leftover probe still counts as a 412: honoured
        createonly.put_create_only(FaultyStore(s3_store), "run/step-1/.metadata", b"again", None)


def test_trusted_stores_are_not_probed() -> None:
    counted = FaultyStore(MemoryStore())
    createonly.put_create_only(counted, "run/step-1/.metadata", b"m", None)
    calls, _ = counted.counts()
    assert calls["put"] == 1 and calls.get("delete", 0) == 0


@pytest.mark.parametrize(
    ("endpoint", "trusted"),
    [
        ("https://s3.us-west-2.amazonaws.com", True),
        ("https://s3.cn-north-1.amazonaws.com.cn", True),
        ("http://127.0.0.1:9000", False),
        ("https://minio.example.com", False),
        ("https://amazonaws.com.evil.example", False),
    ],
)
def test_only_aws_itself_is_trusted(endpoint: str, trusted: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    store = S3Store("bkt", S3Config(endpoint_url=endpoint, region="us-east-1"))
    try:
        assert store.trusts_create_only() is trusted
    finally:
        store.close()
