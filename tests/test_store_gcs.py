"""GCS-specific behaviour of GCSStore, against fake-gcs-server (see the gcs_* fixtures)."""

from __future__ import annotations

import base64
import json
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable

import crc32c
import pytest
import requests
import urllib3.exceptions
from google.api_core import exceptions as api_exceptions
from google.auth import exceptions as auth_exceptions
from google.cloud.storage import exceptions as storage_exceptions

from dcp_cloud.errors import (
    AccessDeniedError,
    BucketNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    ObjectNotFoundError,
    PreconditionFailedError,
    StoreError,
    ThrottledError,
    TransientStoreError,
)
from dcp_cloud.store.gcs import PARTS_MARKER, GCSConfig, GCSStore, _translate
from dcp_cloud.store.protocol import ObjectStore
from dcp_cloud.testing.proxy import FaultPlan, FaultProxy, RequestInfo
from dcp_cloud.testing.servers.gcs_emulator import GCSEmulator, gcs_env


def raw_names(store: GCSStore) -> list[str]:
    """Every object in the bucket, temporaries included."""
    return sorted(blob.name for blob in store._iter_blobs(""))


def temporaries(store: GCSStore) -> list[str]:
    return [name for name in raw_names(store) if PARTS_MARKER in name]


def upload_parts(store: GCSStore, key: str, data: bytes, part_size: int):
    upload_id = store.create_multipart(key)
    parts = [
        store.put_part(key, upload_id, i + 1, data[off : off + part_size])
        for i, off in enumerate(range(0, len(data), part_size))
    ]
    return upload_id, parts


# -- basics -----------------------------------------------------------------------------


def test_is_an_object_store(gcs_store: GCSStore) -> None:
    assert isinstance(gcs_store, ObjectStore)
    assert gcs_store.url("a/b") == f"gs://{gcs_store.bucket}/a/b"
    gcs_store.check_bucket()


def test_put_get_head_list_delete(gcs_store: GCSStore) -> None:
    info = gcs_store.put("d/a", b"alpha")
    gcs_store.put("d/b", bytearray(b"beta"))
    gcs_store.put("e/c", memoryview(b"gamma"))
    assert info.size == 5 and info.version
    assert info.modified is not None and abs(info.modified - time.time()) < 3600
    assert gcs_store.get("d/a") == b"alpha"
    assert gcs_store.head("d/a") == info
    assert [(o.key, o.size) for o in gcs_store.list("d/")] == [("d/a", 5), ("d/b", 4)]
    assert all(o.modified is not None for o in gcs_store.list(""))
    gcs_store.delete(["d/a", "d/missing", "e/c"])
    assert [o.key for o in gcs_store.list("")] == ["d/b"]
    with pytest.raises(ObjectNotFoundError, match="d/a"):
        gcs_store.head("d/a")


def test_missing_bucket_is_named(gcs_emulator: GCSEmulator, gcs_env: dict[str, str]) -> None:
    store = GCSStore("no-such-bucket-dcp", GCSConfig(endpoint=gcs_emulator.endpoint))
    calls = [
        store.check_bucket,
        lambda: store.get("k"),
        lambda: store.head("k"),
        lambda: store.put("k", b"x"),
        lambda: list(store.list("")),
        lambda: store.read_into("k", 0, [memoryview(bytearray(4))]),
        lambda: store.create_multipart("k"),
    ]
    for call in calls:
        with pytest.raises(BucketNotFoundError, match="gs://no-such-bucket-dcp") as info:
            call()
        assert isinstance(info.value.__cause__, api_exceptions.NotFound)
        assert isinstance(info.value, FileNotFoundError)


def test_missing_object_is_not_a_missing_bucket(gcs_store: GCSStore) -> None:
    with pytest.raises(ObjectNotFoundError, match=f"gs://{gcs_store.bucket}/nope"):
        gcs_store.get("nope")
    with pytest.raises(ObjectNotFoundError):
        gcs_store.read_into("nope", 0, [memoryview(bytearray(1))])


def test_create_only_put_twice(gcs_store: GCSStore) -> None:
    gcs_store.put("meta/.metadata", b"first", create_only=True)
    with pytest.raises(PreconditionFailedError, match="meta/.metadata") as info:
        gcs_store.put("meta/.metadata", b"second", create_only=True)
    assert isinstance(info.value.__cause__, api_exceptions.PreconditionFailed)
    assert gcs_store.get("meta/.metadata") == b"first"
    gcs_store.put("meta/.metadata", b"third")  # an ordinary put overwrites
    assert gcs_store.get("meta/.metadata") == b"third"


def test_create_only_put_above_simple_upload_limit(gcs_store: GCSStore) -> None:
    # > 8 MiB goes through a media upload, whose precondition fake-gcs ignores:
    # the store's pre-check still refuses.
    data = os.urandom(8 * 1024 * 1024 + 1)
    gcs_store.put("big", data, create_only=True)
    with pytest.raises(PreconditionFailedError):
        gcs_store.put("big", b"x" * len(data), create_only=True)
    assert gcs_store.get("big") == data


def test_keys_with_the_parts_marker_are_refused(gcs_store: GCSStore) -> None:
    with pytest.raises(StoreError, match="reserves"):
        gcs_store.put(f"a{PARTS_MARKER}x", b"1")
    with pytest.raises(StoreError, match="reserves"):
        gcs_store.create_multipart(f"a{PARTS_MARKER}x")


# -- ranged reads -------------------------------------------------------------------------


def test_read_into_scatters(gcs_store: GCSStore) -> None:
    data = bytes(range(256)) * 4
    gcs_store.put("obj", data)
    a, b, c = bytearray(10), bytearray(0), bytearray(300)
    gcs_store.read_into("obj", 5, [memoryview(a), memoryview(b), memoryview(c)])
    assert bytes(a) == data[5:15] and bytes(c) == data[15:315]
    floats = memoryview(bytearray(16)).cast("f")  # any contiguous format is read as bytes
    gcs_store.read_into("obj", 1000, [floats])
    assert floats.tobytes() == data[1000:1016]
    target = bytearray(8)  # strided 1-D byte targets are filled through slice assignment
    gcs_store.read_into("obj", 0, [memoryview(target)[::2], memoryview(target)[1::2]])
    assert bytes(target) == bytes(data[i] for i in (0, 4, 1, 5, 2, 6, 3, 7))
    gcs_store.put("strided", memoryview(data)[::3])  # a strided source is copied into order
    assert gcs_store.get("strided") == data[::3]


def test_read_into_past_the_end(gcs_store: GCSStore) -> None:
    gcs_store.put("obj", b"0123456789")
    with pytest.raises(CorruptCheckpointError, match="obj"):  # straddles the end: a short 206
        gcs_store.read_into("obj", 8, [memoryview(bytearray(5))])
    with pytest.raises(CorruptCheckpointError, match="obj"):  # wholly past the end: 416
        gcs_store.read_into("obj", 10, [memoryview(bytearray(1))])
    with pytest.raises(CorruptCheckpointError):
        gcs_store.read_into("obj", -1, [memoryview(bytearray(1))])


def test_read_into_zero_bytes_makes_no_request(gcs_store: GCSStore, gcs_emulator: GCSEmulator) -> None:
    """Counted on the wire: reads of nothing send nothing (past the end too), and the next read is one GET."""
    gcs_store.put("obj", b"0123456789")
    with FaultProxy(gcs_emulator.endpoint, flavor="gcs") as proxy:
        store = GCSStore(gcs_store.bucket, GCSConfig(endpoint=proxy.url))
        store.read_into("obj", 123, [memoryview(bytearray(0))])
        store.read_into("obj", 0, [])
        assert proxy.snapshot().requests == {}, proxy.snapshot().requests
        out = bytearray(2)
        store.read_into("obj", 2, [memoryview(out)])  # the counter sees a read
        assert dict(proxy.snapshot().requests) == {"GET": 1} and out == b"23", proxy.snapshot().requests


def test_short_body_is_transient(gcs_store: GCSStore, gcs_emulator: GCSEmulator) -> None:
    """A body cut short on the wire (full Content-Length, then FIN) is retryable, and the pool recovers."""
    from dcp_cloud.testing.proxy import FaultPlan, FaultProxy

    data = os.urandom(3 * 1024 * 1024)
    gcs_store.put("obj", data)
    plan = FaultPlan(truncate=1.0, when=lambda r: "range" in r.headers, max_faults=1)
    with FaultProxy(gcs_emulator.endpoint, plan, flavor="gcs") as proxy:
        store = GCSStore(gcs_store.bucket, GCSConfig(endpoint=proxy.url), request_timeout=30.0)
        out = bytearray(len(data))
        with pytest.raises(TransientStoreError, match="ended early") as info:
            store.read_into("obj", 0, [memoryview(out)[:1000], memoryview(out)[1000:]])
        assert proxy.snapshot().faults["truncate"] == 1
        store.read_into("obj", 0, [memoryview(out)])  # the broken connection was not reused
        assert out == data
    assert info.value.__cause__ is None


def test_read_lands_in_the_buffers_without_copies(gcs_store: GCSStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranged reads go from http.client straight into the targets: never through urllib3's or the library's
    chunked reads (each a new bytes object copied into place)."""
    import urllib3.response

    def forbidden(self: object, *args: object, **kwargs: object) -> object:
        raise AssertionError("a body read that copies through temporary bytes objects")

    data = os.urandom(2 * 1024 * 1024)
    gcs_store.put("big", data)
    for name in ("read", "readinto", "stream", "read_chunked"):
        monkeypatch.setattr(urllib3.response.HTTPResponse, name, forbidden)
    monkeypatch.setattr(type(gcs_store._blob("big")), "download_to_file", forbidden)
    out = bytearray(len(data) - 10)
    gcs_store.read_into("big", 5, [memoryview(out)[:1000], memoryview(out)[1000:]])
    assert out == data[5:-5]


def test_read_sends_fresh_credentials(gcs_store: GCSStore, gcs_emulator: GCSEmulator) -> None:
    """Ranged reads carry the credentials' token, refreshed when it has expired (what the wire shows)."""
    import datetime

    import google.auth.credentials

    from dcp_cloud.testing.proxy import FaultPlan, FaultProxy

    class Counting(google.auth.credentials.Credentials):
        def __init__(self) -> None:
            super().__init__()
            self.refreshes = 0

        def refresh(self, request: object) -> None:
            self.refreshes += 1
            self.token = f"token-{self.refreshes}"
            now = datetime.datetime.now(datetime.timezone.utc).replace(tzinfo=None)  # google-auth: naive UTC
            self.expiry = now + datetime.timedelta(hours=1)

    gcs_store.put("obj", b"0123456789")
    seen: list[str | None] = []

    def record(request) -> bool:  # sees every ranged GET on the wire; injects nothing
        if "range" in request.headers:
            seen.append(request.headers.get("authorization"))
        return False

    creds = Counting()
    with FaultProxy(gcs_emulator.endpoint, FaultPlan(slowdown=1.0, when=record), flavor="gcs") as proxy:
        store = GCSStore(gcs_store.bucket, GCSConfig(endpoint=proxy.url), credentials=creds)
        out = bytearray(4)
        store.read_into("obj", 2, [memoryview(out)])
        store.read_into("obj", 2, [memoryview(out)])
        creds.expiry = datetime.datetime(2000, 1, 1)  # expired: refreshed before the next request
        store.read_into("obj", 2, [memoryview(out)])
    assert out == b"2345"
    assert seen == ["Bearer token-1", "Bearer token-1", "Bearer token-2"]
    assert creds.refreshes == 2


def _timed_out(exc: BaseException) -> bool:
    """Whether ``exc`` came of a socket timeout (anywhere down its chain of causes)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, (TimeoutError, urllib3.exceptions.TimeoutError, requests.Timeout)):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def test_read_stalled_mid_body_times_out_as_transient(gcs_store: GCSStore, gcs_emulator: GCSEmulator) -> None:
    """The request timeout bounds every socket read of the body too, not only the wait for the headers."""
    from dcp_cloud.testing.proxy import FaultPlan, FaultProxy

    gcs_store.put("obj", os.urandom(1 << 20))
    # the proxy holds the rest of the body until the client hangs up (or a minute passed): only the client's own
    # timeout can end the read, and it must say so (a body cut short would be "ended early")
    plan = FaultPlan(stall=1.0, stall_seconds=60.0, phase="response", when=lambda r: "range" in r.headers)
    with FaultProxy(gcs_emulator.endpoint, plan, flavor="gcs") as proxy:
        store = GCSStore(gcs_store.bucket, GCSConfig(endpoint=proxy.url), request_timeout=0.5)
        with pytest.raises(TransientStoreError, match="connection to GCS failed") as info:
            store.read_into("obj", 0, [memoryview(bytearray(1 << 20))])
        assert proxy.snapshot().faults["stall"] == 1
    assert _timed_out(info.value), repr(info.value)


def test_read_request_to_the_public_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without an emulator or endpoint, a ranged read is the library's media GET on storage.googleapis.com
    (answered here by a stub session: no network)."""
    from google.auth.credentials import AnonymousCredentials

    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    store = GCSStore("bkt", credentials=AnonymousCredentials())
    session = store._client_()._http
    sent: list[tuple[str, str, dict]] = []

    def stub(method, url, headers=None, **kwargs):
        sent.append((method, url, dict(headers or {})))
        response = requests.Response()
        response.status_code, response.url = 503, url
        response.request = requests.Request(method, url).prepare()
        response._content = b'{"error": {"code": 503, "message": "backend error"}}'
        return response

    monkeypatch.setattr(session, "request", stub)
    with pytest.raises(ThrottledError, match="gs://bkt/dir/a key"):
        store.read_into("dir/a key", 7, [memoryview(bytearray(3)), memoryview(bytearray(2))])
    ((method, url, headers),) = sent
    assert method == "GET"
    assert url == "https://storage.googleapis.com/download/storage/v1/b/bkt/o/dir%2Fa%20key?alt=media"
    assert headers["Range"] == "bytes=7-11" and headers["Accept-Encoding"] == "gzip"


def test_read_answer_for_other_bytes_is_refused(gcs_store: GCSStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Content-Range of the answer is checked: bytes of another range never land in the targets."""
    gcs_store.put("obj", b"0123456789")
    session = gcs_store._client_()._http
    real = session.request

    def shifted(method, url, *args, headers=None, **kwargs):
        return real(method, url, *args, headers={**(headers or {}), "Range": "bytes=1-3"}, **kwargs)

    monkeypatch.setattr(session, "request", shifted)
    out = bytearray(3)
    with pytest.raises(StoreError, match="bytes=0|bytes 0..3"):
        gcs_store.read_into("obj", 0, [memoryview(out)])
    assert out == bytearray(3)


# -- composite uploads ------------------------------------------------------------------------


def test_composite_upload_chains_compose(gcs_store: GCSStore) -> None:
    data = os.urandom(70 * 1000 + 123)  # 71 parts: 3 intermediates, then the final compose
    upload_id, parts = upload_parts(gcs_store, "ckpt/shard", data, 1000)
    assert len(parts) == 71 and all(p.token for p in parts)
    assert gcs_store.list_multipart("ckpt/")[0].upload_id == upload_id
    assert [o.key for o in gcs_store.list("")] == []  # temporaries are hidden
    info = gcs_store.complete_multipart("ckpt/shard", upload_id, parts, create_only=True)
    assert info.size == len(data)
    assert gcs_store.get("ckpt/shard") == data
    out = bytearray(5000)
    gcs_store.read_into("ckpt/shard", 31_500, [memoryview(out)])  # across part boundaries
    assert bytes(out) == data[31_500:36_500]
    assert temporaries(gcs_store) == []
    assert gcs_store.list_multipart("") == []
    assert raw_names(gcs_store) == ["ckpt/shard"]


def test_composite_upload_one_and_zero_parts(gcs_store: GCSStore) -> None:
    upload_id, parts = upload_parts(gcs_store, "one", b"single", 100)
    assert gcs_store.complete_multipart("one", upload_id, parts).size == 6
    assert gcs_store.get("one") == b"single"
    upload_id = gcs_store.create_multipart("zero")
    assert gcs_store.complete_multipart("zero", upload_id, []).size == 0
    assert gcs_store.get("zero") == b""
    assert raw_names(gcs_store) == ["one", "zero"]


def test_reuploaded_part_replaces_and_stale_token_is_refused(gcs_store: GCSStore) -> None:
    upload_id, parts = upload_parts(gcs_store, "k", b"aaaabbbb", 4)
    newer = gcs_store.put_part("k", upload_id, 2, b"cccc")
    with pytest.raises(StoreError, match="re-uploaded"):
        gcs_store.complete_multipart("k", upload_id, parts)
    assert temporaries(gcs_store) == []  # a permanent failure releases the upload
    upload_id, parts = upload_parts(gcs_store, "k", b"aaaabbbb", 4)
    newer = gcs_store.put_part("k", upload_id, 2, b"cccc")
    gcs_store.complete_multipart("k", upload_id, [parts[0], newer])
    assert gcs_store.get("k") == b"aaaacccc"


def test_abort_leaves_no_temporaries(gcs_store: GCSStore) -> None:
    upload_id, _ = upload_parts(gcs_store, "k", os.urandom(40 * 100), 100)
    other_id, _ = upload_parts(gcs_store, "other", b"keep me", 100)
    gcs_store.abort_multipart("k", upload_id)
    assert [u.upload_id for u in gcs_store.list_multipart("")] == [other_id]
    assert all(other_id in name for name in temporaries(gcs_store))
    gcs_store.abort_multipart("k", upload_id)  # twice: ignored
    gcs_store.abort_multipart("k", "not-an-upload-id")  # unknown: ignored
    with pytest.raises(StoreError, match="no multipart upload"):
        gcs_store.complete_multipart("k", upload_id, [])
    with pytest.raises(ObjectNotFoundError):
        gcs_store.head("k")


def test_list_multipart_reports_uploads_without_parts(gcs_store: GCSStore) -> None:
    before = time.time()
    upload_id = gcs_store.create_multipart("a/k")
    (pending,) = gcs_store.list_multipart("a/")
    assert (pending.key, pending.upload_id) == ("a/k", upload_id)
    assert before - 1 <= pending.initiated <= time.time() + 1
    assert gcs_store.list_multipart("b/") == []


def test_missing_component_fails_complete_and_deletes_temporaries(gcs_store: GCSStore) -> None:
    upload_id, parts = upload_parts(gcs_store, "k", os.urandom(40 * 100), 100)
    gcs_store._delete_one(f"k{PARTS_MARKER}{upload_id}/p00007")  # injected: a part vanished
    with pytest.raises(StoreError, match="part 7"):
        gcs_store.complete_multipart("k", upload_id, parts)
    assert temporaries(gcs_store) == []
    assert raw_names(gcs_store) == []


class _Composes:
    """A fault filter of the proxy (``FaultPlan(when=...)``): records the destination of every compose request
    in the order they arrive, and makes the first one whose destination passes ``refuse`` eligible for the
    plan's fault (the proxy answers it instead of the emulator)."""

    def __init__(self, refuse: Callable[[str], bool]) -> None:
        self.refuse = refuse
        self.seen: list[str] = []
        self.refused: list[str] = []

    def __call__(self, request: RequestInfo) -> bool:
        if request.method != "POST" or not request.path.endswith("/compose"):
            return False
        dest = urllib.parse.unquote(request.path[: -len("/compose")].rsplit("/o/", 1)[1])
        self.seen.append(dest)
        if not self.refused and self.refuse(dest):
            self.refused.append(dest)
            return True
        return False


def _through(emulator: GCSEmulator, plan: FaultPlan) -> FaultProxy:
    return FaultProxy(emulator.endpoint, plan, flavor="gcs")


def test_failure_in_final_compose(gcs_store: GCSStore, gcs_emulator: GCSEmulator) -> None:
    """Transient: parts and intermediates stay, and the retry only makes the final compose. Permanent: all go."""
    data = os.urandom(40 * 100)
    upload_id, parts = upload_parts(gcs_store, "k", data, 100)
    composes = _Composes(lambda dest: dest == "k")
    with _through(gcs_emulator, FaultPlan(slowdown=1.0, when=composes)) as proxy:
        store = GCSStore(gcs_store.bucket, GCSConfig(endpoint=proxy.url))
        with pytest.raises(TransientStoreError) as info:
            store.complete_multipart("k", upload_id, parts)
        assert isinstance(info.value.__cause__, api_exceptions.ServiceUnavailable)
        assert proxy.snapshot().faults["slowdown"] == 1
        left = temporaries(gcs_store)
        assert len(left) == 43 and sum("/c01-" in n for n in left) == 2  # 40 parts + marker + 2 intermediates
        # the final compose came after both intermediates, and was the one refused
        assert len(composes.seen) == 3 and composes.seen[-1] == "k" and composes.refused == ["k"], composes.seen
        assert all("/c01-" in dest for dest in composes.seen[:2]), composes.seen
        composes.seen.clear()
        assert store.complete_multipart("k", upload_id, parts).size == len(data)  # the retry
        assert composes.seen == ["k"]  # the intermediates were reused, not composed again
    assert gcs_store.get("k") == data and temporaries(gcs_store) == []

    upload_id, parts = upload_parts(gcs_store, "k2", data, 100)
    composes = _Composes(lambda dest: dest == "k2")
    with _through(gcs_emulator, FaultPlan(denied_403=1.0, when=composes)) as proxy:
        store = GCSStore(gcs_store.bucket, GCSConfig(endpoint=proxy.url))
        with pytest.raises(AccessDeniedError):
            store.complete_multipart("k2", upload_id, parts)
        assert proxy.snapshot().faults["denied_403"] == 1 and composes.refused == ["k2"]
    assert temporaries(gcs_store) == []


def test_retried_complete_does_not_redo_finished_intermediates(gcs_store: GCSStore, gcs_emulator: GCSEmulator) -> None:
    """One of three intermediates fails: the retry composes only that one and the final object."""
    data = os.urandom(70 * 50)  # 70 parts: intermediates of 32, 32 and 6 parts
    upload_id, parts = upload_parts(gcs_store, "k", data, 50)
    composes = _Composes(lambda dest: "c01-00001" in dest)
    with _through(gcs_emulator, FaultPlan(throttle_429=1.0, when=composes)) as proxy:
        store = GCSStore(gcs_store.bucket, GCSConfig(endpoint=proxy.url))
        with pytest.raises(TransientStoreError):
            store.complete_multipart("k", upload_id, parts)
        assert len(composes.seen) == 3 and len(composes.refused) == 1  # all three intermediates tried, one failed
        composes.seen.clear()
        assert store.complete_multipart("k", upload_id, parts).size == len(data)
        assert len(composes.seen) == 2 and composes.seen[0] == composes.refused[0] and composes.seen[1] == "k"
    assert gcs_store.get("k") == data and temporaries(gcs_store) == []


def test_intermediates_of_re_uploaded_parts_are_not_reused(gcs_store: GCSStore, gcs_emulator: GCSEmulator) -> None:
    """A part re-uploaded between two completes changes its generation, hence its intermediate's name."""
    data = bytearray(os.urandom(40 * 50))
    upload_id, parts = upload_parts(gcs_store, "k", bytes(data), 50)
    composes = _Composes(lambda dest: dest == "k")
    with _through(gcs_emulator, FaultPlan(slowdown=1.0, when=composes)) as proxy:
        store = GCSStore(gcs_store.bucket, GCSConfig(endpoint=proxy.url))
        with pytest.raises(TransientStoreError):
            store.complete_multipart("k", upload_id, parts)
        first = [dest for dest in composes.seen if dest != "k"]
        data[0:50] = os.urandom(50)
        parts[0] = store.put_part("k", upload_id, 1, bytes(data[0:50]))
        composes.seen.clear()
        assert store.complete_multipart("k", upload_id, parts).size == len(data)
        # the intermediate holding part 1 was composed again under another name, the other one reused
        again = [dest for dest in composes.seen if dest != "k"]
        assert len(first) == 2 and len(again) == 1 and again[0] not in first, (first, composes.seen)
    assert gcs_store.get("k") == bytes(data) and temporaries(gcs_store) == []


def test_create_only_complete_onto_existing(gcs_store: GCSStore) -> None:
    gcs_store.put("k", b"committed")
    upload_id, parts = upload_parts(gcs_store, "k", os.urandom(3300), 100)
    with pytest.raises(PreconditionFailedError, match="gs://.*/k"):
        gcs_store.complete_multipart("k", upload_id, parts, create_only=True)
    assert gcs_store.get("k") == b"committed"
    assert temporaries(gcs_store) == []


def test_limits_and_part_numbers(gcs_store: GCSStore) -> None:
    assert gcs_store.limits.min_part_size == 1
    assert gcs_store.limits.max_parts == 10_000
    upload_id = gcs_store.create_multipart("k")
    for bad in (0, 10_001):
        with pytest.raises(StoreError, match="outside"):
            gcs_store.put_part("k", upload_id, bad, b"x")
    with pytest.raises(StoreError, match="not an upload id"):
        gcs_store.put_part("k", "../../etc", 1, b"x")


# -- integrity ----------------------------------------------------------------------------------


def _capture_upload_checksums(store: GCSStore, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str | None]]:
    """Spy on the client's session: (uploadType, CRC32C sent or None) of every upload request.

    Media uploads carry it in the ``x-goog-hash`` header, multipart uploads in
    the object metadata (the first part of the multipart/related body).
    """
    session = store._client_()._http
    real = session.request
    seen: list[tuple[str, str | None]] = []

    def spy(method, url, data=None, headers=None, **kwargs):
        if method == "POST" and "/upload/" in url:
            upload_type = urllib.parse.parse_qs(urllib.parse.urlsplit(url).query)["uploadType"][0]
            if upload_type == "multipart":
                part = bytes(data).split(b"\r\n\r\n", 1)[1].split(b"\r\n--", 1)[0]
                seen.append((upload_type, json.loads(part).get("crc32c")))
            else:
                hashes = {k.lower(): v for k, v in (headers or {}).items()}.get("x-goog-hash")
                seen.append((upload_type, hashes.removeprefix("crc32c=") if hashes else None))
        return real(method, url, data=data, headers=headers, **kwargs)

    monkeypatch.setattr(session, "request", spy)
    return seen


def _b64(value: int) -> str:
    return base64.b64encode(value.to_bytes(4, "big")).decode()


def test_uploads_carry_crc32c(gcs_store: GCSStore, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _capture_upload_checksums(gcs_store, monkeypatch)
    small, large = b"small object", os.urandom(9 * 1024 * 1024)
    upload_id = gcs_store.create_multipart("m")
    seen.clear()
    gcs_store.put("given", small, crc32c=crc32c.crc32c(small))
    gcs_store.put("computed", small)  # no crc32c given: the store computes it
    gcs_store.put("large", large, crc32c=crc32c.crc32c(large))
    gcs_store.put_part("m", upload_id, 1, large, crc32c=crc32c.crc32c(large))
    gcs_store.put("meta", small, create_only=True)  # the small create-only path: in the metadata
    gcs_store.put("big-meta", large, create_only=True)
    assert seen == [
        ("media", _b64(crc32c.crc32c(small))),
        ("media", _b64(crc32c.crc32c(small))),
        ("media", _b64(crc32c.crc32c(large))),
        ("media", _b64(crc32c.crc32c(large))),
        ("multipart", _b64(crc32c.crc32c(small))),
        ("media", _b64(crc32c.crc32c(large))),
    ]
    # fake-gcs-server does not verify it (real GCS answers 400), but stores the right bytes:
    assert gcs_store.get("large") == large and gcs_store.get("big-meta") == large


def test_checksums_can_be_turned_off(gcs_emulator: GCSEmulator, gcs_env, gcs_bucket, monkeypatch) -> None:
    store = GCSStore(gcs_bucket, GCSConfig(endpoint=gcs_emulator.endpoint, transport_checksums=False))
    seen = _capture_upload_checksums(store, monkeypatch)
    store.put("k", b"data", crc32c=123)
    store.put("c", b"data", crc32c=123, create_only=True)
    assert seen == [("media", None), ("multipart", None)]


# -- one attempt per call -------------------------------------------------------------------------


def _new_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    """Threads alive now that were not in ``before``, the proxy's own aside."""
    return [t for t in threading.enumerate() if t not in before and not t.name.startswith("FaultProxy")]


def test_each_call_is_one_request(gcs_store: GCSStore, gcs_emulator: GCSEmulator) -> None:
    """Counted on the wire; and no call leaves a thread behind that could send more after it returned."""
    gcs_store.put("k", b"0123456789")
    upload_id = gcs_store.create_multipart("p")
    big = memoryview(bytearray(9 * 1024 * 1024))  # above the library's single-request limit
    with FaultProxy(gcs_emulator.endpoint, flavor="gcs") as proxy:
        store = GCSStore(gcs_store.bucket, GCSConfig(endpoint=proxy.url))
        calls = [
            lambda: store.put("k2", b"x", create_only=True),
            lambda: store.put("k3", b"x"),
            lambda: store.put("k4", big),
            lambda: store.put_part("p", upload_id, 1, b"x"),
            lambda: store.put_part("p", upload_id, 2, big),
            lambda: store.get("k"),
            lambda: store.head("k"),
            lambda: store.read_into("k", 2, [memoryview(bytearray(3)), memoryview(bytearray(4))]),
            lambda: list(store.list("")),
            lambda: store.create_multipart("m"),
            store.check_bucket,
        ]
        for index, call in enumerate(calls):
            threads = set(threading.enumerate())
            proxy.reset_counters()
            call()
            assert _new_threads(threads) == [], (index, _new_threads(threads))
            assert sum(proxy.snapshot().requests.values()) == 1, (index, proxy.snapshot().by_path)


def test_media_upload_sends_the_callers_buffer(gcs_store: GCSStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """put / put_part: one uploadType=media POST whose body is the caller's buffer, not a copy."""
    session = gcs_store._client_()._http
    real = session.request
    sent: list[tuple[str, dict, dict]] = []

    def spy(method, url, data=None, headers=None, **kwargs):
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(url).query)
        sent.append((method, query, {"data": data, "headers": dict(headers or {})}))
        return real(method, url, data=data, headers=headers, **kwargs)

    upload_id = gcs_store.create_multipart("ckpt/shard")
    monkeypatch.setattr(session, "request", spy)
    buffer = bytearray(os.urandom(3 * 1024 * 1024))
    key = "dir/a key+with ?#% é"
    info = gcs_store.put(key, memoryview(buffer), crc32c=crc32c.crc32c(buffer))
    part = gcs_store.put_part("ckpt/shard", upload_id, 7, memoryview(buffer)[: 1 << 20])
    big = bytearray(9 * 1024 * 1024)
    gcs_store.put("big", memoryview(big), create_only=True)  # pre-check GET, then a media upload
    methods = [method for method, _, _ in sent]
    assert methods == ["POST", "POST", "GET", "POST"], sent
    (_, q1, r1), (_, q2, r2), _, (_, q3, r3) = sent
    assert q1 == {"uploadType": ["media"], "name": [key]}
    assert q2 == {"uploadType": ["media"], "name": [f"ckpt/shard{PARTS_MARKER}{upload_id}/p00007"]}
    assert q3 == {"uploadType": ["media"], "name": ["big"], "ifGenerationMatch": ["0"]}
    for request, source in ((r1, buffer), (r2, buffer), (r3, big)):
        assert isinstance(request["data"], memoryview) and request["data"].obj is source  # no copy
        assert request["headers"]["Content-Type"] == "application/octet-stream"
    assert r1["headers"]["x-goog-hash"] == f"crc32c={_b64(crc32c.crc32c(buffer))}"
    assert r2["headers"]["x-goog-hash"] == f"crc32c={_b64(crc32c.crc32c(buffer[: 1 << 20]))}"
    assert (info.key, info.size) == (key, len(buffer)) and info.version and info.modified is not None
    assert gcs_store.head(key) == info and gcs_store.get(key) == bytes(buffer)
    assert (part.number, part.size) == (7, 1 << 20) and part.token
    done = gcs_store.complete_multipart("ckpt/shard", upload_id, [part])
    assert gcs_store.get("ckpt/shard") == bytes(buffer[: 1 << 20]) and done.size == 1 << 20


def test_empty_media_upload(gcs_store: GCSStore) -> None:
    assert gcs_store.put("empty", memoryview(bytearray(0))).size == 0
    assert gcs_store.get("empty") == b""


def test_no_library_retries(gcs_store: GCSStore, gcs_emulator: GCSEmulator) -> None:
    """Every request the proxy refuses with a 503 is sent once: the library retries nothing (the retry loop is
    dcp_cloud's)."""
    gcs_store.put("k", b"0123456789")
    upload_id, parts = upload_parts(gcs_store, "m", b"abcdef", 2)

    def targeted(request: RequestInfo) -> bool:
        path = urllib.parse.unquote(request.path)
        return path.endswith("/compose") or path.startswith("/upload/") or path.endswith("/o/k")

    with _through(gcs_emulator, FaultPlan(slowdown=1.0, when=targeted)) as proxy:
        store = GCSStore(gcs_store.bucket, GCSConfig(endpoint=proxy.url))
        calls = [
            lambda: store.put("k", b"y"),
            lambda: store.put("k", b"y" * (9 * 1024 * 1024)),
            lambda: store.put_part("m", upload_id, 1, b"y" * (9 * 1024 * 1024)),
            lambda: store.get("k"),
            lambda: store.head("k"),
            lambda: store.read_into("k", 0, [memoryview(bytearray(3))]),
            lambda: store.complete_multipart("m", upload_id, parts),
        ]
        for index, call in enumerate(calls):
            proxy.reset_counters()
            with pytest.raises(TransientStoreError) as info:
                call()
            assert info.value.__cause__ is not None
            assert proxy.snapshot().faults["slowdown"] == 1, (index, proxy.snapshot().by_path)
    assert gcs_store.list_multipart("m")  # the transient failure kept the parts for a retry


# -- errors ----------------------------------------------------------------------------------------


class _Response:
    def __init__(self, status_code: int) -> None:
        self.status_code = status_code
        self.headers: dict[str, str] = {}


@pytest.mark.parametrize(
    ("exc", "missing", "expected"),
    [
        (api_exceptions.NotFound("x"), "bucket", BucketNotFoundError),
        (api_exceptions.NotFound("x"), "object", ObjectNotFoundError),
        (api_exceptions.Unauthorized("x"), "object", AccessDeniedError),
        (api_exceptions.Forbidden("x"), "object", AccessDeniedError),
        (api_exceptions.PreconditionFailed("x"), "object", PreconditionFailedError),
        (api_exceptions.RequestRangeNotSatisfiable("x"), "object", CorruptCheckpointError),
        (api_exceptions.from_http_status(408, "x"), "object", TransientStoreError),
        (api_exceptions.TooManyRequests("x"), "object", ThrottledError),
        (api_exceptions.InternalServerError("x"), "object", TransientStoreError),
        (api_exceptions.BadGateway("x"), "object", TransientStoreError),
        (api_exceptions.ServiceUnavailable("x"), "object", ThrottledError),
        (api_exceptions.GatewayTimeout("x"), "object", TransientStoreError),
        (api_exceptions.BadRequest("x"), "object", StoreError),
        (api_exceptions.Conflict("x"), "object", StoreError),
        (storage_exceptions.InvalidResponse(_Response(503), "x"), "object", ThrottledError),
        (storage_exceptions.InvalidResponse(_Response(404), "x"), "bucket", BucketNotFoundError),
        (storage_exceptions.InvalidResponse(_Response(412), "x"), "object", PreconditionFailedError),
        (storage_exceptions.DataCorruption(_Response(200), "x"), "object", TransientStoreError),
        (requests.exceptions.ConnectionError("reset"), "object", TransientStoreError),
        (requests.exceptions.ReadTimeout("slow"), "object", TransientStoreError),
        (requests.exceptions.ChunkedEncodingError("cut"), "object", TransientStoreError),
        (urllib3.exceptions.ProtocolError("IncompleteRead"), "object", TransientStoreError),
        (ConnectionResetError(), "object", TransientStoreError),
        (auth_exceptions.TransportError("metadata server down"), "object", TransientStoreError),
        (auth_exceptions.DefaultCredentialsError("none"), "object", AccessDeniedError),
        (auth_exceptions.RefreshError("revoked"), "object", AccessDeniedError),
        (ValueError("weird"), "object", StoreError),
    ],
)
def test_translate(exc: BaseException, missing: str, expected: type) -> None:
    err = _translate(exc, "bkt", "a/key", missing=missing)
    assert type(err) is expected
    assert "gs://bkt" in str(err)
    if expected is not BucketNotFoundError:
        assert "gs://bkt/a/key" in str(err)


def test_translate_keeps_bodies_out() -> None:
    exc = api_exceptions.Forbidden("caller does not have storage.objects.get access; token=ya29.SECRET")
    err = _translate(exc, "bkt", "k")
    assert "SECRET" not in str(err) and "HTTP 403" in str(err)


def test_connection_refused_is_transient(gcs_env: dict[str, str]) -> None:
    store = GCSStore("b", GCSConfig(endpoint="http://127.0.0.1:9"), request_timeout=2)
    with pytest.raises(TransientStoreError, match="gs://b/k") as info:
        store.get("k")
    assert isinstance(info.value.__cause__, requests.exceptions.ConnectionError)


# -- configuration, credentials, pickling, processes ---------------------------------------------------


def test_config_validation() -> None:
    with pytest.raises(ConfigError):
        GCSConfig(endpoint="ftp://host")
    with pytest.raises(ConfigError):
        GCSConfig(endpoint="http://host:1/some/path")
    with pytest.raises(ConfigError):
        GCSConfig(project="")
    with pytest.raises(ConfigError):
        GCSConfig(transport_checksums="yes")  # type: ignore[arg-type]
    assert GCSConfig(endpoint="http://127.0.0.1:4443/").endpoint == "http://127.0.0.1:4443"
    with pytest.raises(ConfigError):
        GCSStore("gs://bucket")
    with pytest.raises(ConfigError):
        GCSStore("b", request_timeout=0)
    with pytest.raises(ConfigError):
        GCSStore("b", max_connections=0)
    with pytest.raises(ConfigError):
        GCSStore("b", GCSConfig(credentials_file="x.json"), credentials=object())  # type: ignore[arg-type]


def test_no_credentials_anywhere_is_access_denied(monkeypatch: pytest.MonkeyPatch) -> None:
    import google.auth

    def no_adc(*args, **kwargs):
        raise auth_exceptions.DefaultCredentialsError("no ADC")

    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    monkeypatch.setattr(google.auth, "default", no_adc)
    with pytest.raises(AccessDeniedError, match="application-default login") as info:
        GCSStore("some-bucket").check_bucket()
    assert isinstance(info.value.__cause__, auth_exceptions.DefaultCredentialsError)
    # An explicit endpoint without credentials falls back to anonymous access (emulators).
    store = GCSStore("some-bucket", GCSConfig(endpoint="https://storage.example.internal"))
    from google.auth.credentials import AnonymousCredentials

    assert isinstance(store._resolve_credentials()[0], AnonymousCredentials)


def test_missing_credentials_file(tmp_path) -> None:
    store = GCSStore("b", GCSConfig(credentials_file=str(tmp_path / "absent.json")))
    with pytest.raises(ConfigError, match="absent.json"):
        store.check_bucket()


def test_store_pickles_without_client(gcs_store: GCSStore) -> None:
    gcs_store.put("k", b"v")
    assert gcs_store._client is not None
    clone = pickle.loads(pickle.dumps(gcs_store))
    assert clone._client is None
    assert clone.get("k") == b"v"
    assert clone._client is gcs_store._client  # one client per configuration and process


def test_explicit_credentials_refuse_to_pickle(gcs_emulator: GCSEmulator, gcs_bucket: str) -> None:
    from google.oauth2.credentials import Credentials

    creds = Credentials(token="ya29.SECRET-TOKEN")
    store = GCSStore(gcs_bucket, GCSConfig(endpoint=gcs_emulator.endpoint), credentials=creds)
    assert "SECRET" not in repr(store)
    store.put("k", b"usable in-process")  # the emulator ignores the token
    assert store.get("k") == b"usable in-process"
    with pytest.raises(ConfigError, match="credentials_file"):
        pickle.dumps(store)


def test_emulator_host_env_alone_is_enough(gcs_env: dict[str, str], gcs_bucket: str) -> None:
    store = GCSStore(gcs_bucket)  # default config: STORAGE_EMULATOR_HOST does it
    store.put("k", b"via env")
    assert store.get("k") == b"via env"
    assert store._client_()._connection.API_BASE_URL == gcs_env["STORAGE_EMULATOR_HOST"]


def test_client_is_recreated_after_fork(gcs_store: GCSStore) -> None:
    gcs_store.put("parent", b"p")
    parent_client = gcs_store._client_()
    ctx = multiprocessing.get_context("fork")
    proc = ctx.Process(target=_child_put, args=(gcs_store, id(parent_client)))
    proc.start()
    proc.join(30)
    assert proc.exitcode == 0
    assert gcs_store.get("child") == b"ok"
    assert gcs_store._client_() is parent_client


def test_pickled_store_works_in_a_fresh_process(gcs_store: GCSStore) -> None:
    """What a process-based async_save does: the child gets the pickled store and the environment."""
    code = (
        "import pickle, sys\n"
        "store = pickle.loads(sys.stdin.buffer.read())\n"
        "store.put('from-child', b'written by a child process')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(gcs_store), capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr.decode()
    assert gcs_store.get("from-child") == b"written by a child process"


def _child_put(store: GCSStore, parent_client_id: int) -> None:
    assert id(store._client_()) != parent_client_id
    store.put("child", b"ok")


def test_connection_pool_fits_max_connections(gcs_store: GCSStore) -> None:
    adapter = gcs_store._client_()._http.get_adapter(gcs_store.config.endpoint)
    assert adapter._pool_maxsize == gcs_store.max_connections


def test_concurrent_reads(gcs_store: GCSStore) -> None:
    import concurrent.futures

    data = os.urandom(1 << 20)
    gcs_store.put("obj", data)

    def read(i: int) -> bytes:
        out = bytearray(4096)
        gcs_store.read_into("obj", i * 4096, [memoryview(out)])
        return bytes(out)

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        chunks = list(pool.map(read, range(256)))
    assert b"".join(chunks) == data


# -- the emulator itself -------------------------------------------------------------------------------


def test_emulator_process_is_gone_after_stop() -> None:
    emulator = GCSEmulator().start()
    pid = emulator.pid
    assert pid is not None and emulator.running
    env = gcs_env(emulator)
    assert env["STORAGE_EMULATOR_HOST"] == emulator.endpoint and env["GOOGLE_CLOUD_PROJECT"]
    emulator.stop()
    assert not emulator.running and emulator.pid is None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    with pytest.raises(RuntimeError, match="not running"):
        _ = emulator.endpoint
    emulator.stop()  # idempotent


def test_emulator_dies_with_the_process_that_started_it(tmp_path) -> None:
    """PR_SET_PDEATHSIG: a test process killed with SIGKILL takes its server along."""
    import dcp_cloud.testing.servers.gcs_emulator as module

    code = (
        "import importlib.util, sys, time\n"
        f"spec = importlib.util.spec_from_file_location('standalone_emulator', {module.__file__!r})\n"
        "mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)\n"
        "emu = mod.GCSEmulator().start()\n"
        "print(emu.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        server_pid = int(parent.stdout.readline())
        assert _alive(server_pid)
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 10
        while _alive(server_pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not _alive(server_pid)
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead
    except FileNotFoundError:
        return False


def test_emulator_keeps_answering_after_many_requests(gcs_store: GCSStore) -> None:
    # The wrapper's unread stderr pipe stalled the server after ~380 requests.
    for i in range(500):
        with pytest.raises(ObjectNotFoundError):
            gcs_store.head(f"missing-{i}")


def test_emulator_reset_and_restart() -> None:
    with GCSEmulator() as emulator:
        emulator.create_bucket("b1")
        store = GCSStore("b1", GCSConfig(endpoint=emulator.endpoint))
        store.put("k", b"v")
        emulator.reset()
        assert emulator.buckets() == []
        emulator.create_bucket("b1")
        assert list(store.list("")) == []
        # A server killed from outside is noticed and can be started again.
        os.kill(emulator.pid, signal.SIGKILL)
        time.sleep(0.05)
        assert not emulator.running
        emulator.start()
        assert emulator.running and emulator.buckets() == []


def test_emulator_failure_shows_log(tmp_path) -> None:
    fake = tmp_path / "fake-gcs-server"
    fake.write_text("#!/bin/sh\necho 'cannot bind: address in use' >&2\nexit 3\n")
    fake.chmod(0o755)
    with pytest.raises(RuntimeError, match="cannot bind"):
        GCSEmulator(binary=fake, port=1).start()
