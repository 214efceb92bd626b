"""GCSObjectOptions end to end: a checkpoint saved with dcp.save and loaded bitwise equal, then fake-gcs-server
asked what its objects carry, or, for what it does not keep, the recording proxy asked what reached the wire.

What fake-gcs-server (v1.54) honours: ``storageClass`` in the resource of a multipart upload (and so in the
object's metadata). What it accepts and ignores: ``kmsKeyName`` and ``destinationKmsKeyName`` (no
``kmsKeyName`` in the metadata), the customer key's headers (objects stay readable without the key, no
``customerEncryption`` in the metadata), ``userProject``, and ``storageClass`` in the resource of a compose
destination or a rewrite (the object stays STANDARD).
"""

from __future__ import annotations

import base64
import collections
import hashlib
import json
import logging
import pickle
import urllib.parse
import urllib.request
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_cloud import GCSReader, GCSWriter, TransferConfig
from dcp_cloud.errors import ConfigError
from dcp_cloud.store.gcs import GCSConfig, GCSObjectOptions, GCSStore
from dcp_cloud.testing.proxy import FaultProxy, RequestInfo

KEY = bytes(range(32))
KMS = "projects/p1/locations/europe-west4/keyRings/ring/cryptoKeys/ckpt"
PROJECT = "billed-project"
CSEK = GCSObjectOptions(
    customer_encryption_key=KEY,
    allow_customer_encryption_key_over_http=True,
    user_project=PROJECT,
    storage_class="NEARLINE",
)
CMEK = GCSObjectOptions(kms_key_name=KMS, user_project=PROJECT, storage_class="COLDLINE")
CUSTOMER = {
    "x-goog-encryption-algorithm": "AES256",
    "x-goog-encryption-key": base64.b64encode(KEY).decode(),
    "x-goog-encryption-key-sha256": base64.b64encode(hashlib.sha256(KEY).digest()).decode(),
}
SOURCE = {name.replace("x-goog-", "x-goog-copy-source-"): value for name, value in CUSTOMER.items()}


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    # "big" goes in parts (1.2 MB, 256 KiB parts: a compose); the rest in single uploads.
    return {"small": torch.arange(1000, dtype=torch.float32), "big": torch.randn(300_000, generator=g)}


def _save_and_load(endpoint: str, bucket: str, options: GCSObjectOptions | None, prefix: str = "ck") -> None:
    config = GCSConfig(endpoint=endpoint, object_options=options)
    transfer = TransferConfig(part_size=256 * 1024, multipart_threshold=256 * 1024, concurrency=2)
    state = _state()
    dcp.save(state, storage_writer=GCSWriter(f"gs://{bucket}/{prefix}", config=config, transfer=transfer))
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(out, storage_reader=GCSReader(f"gs://{bucket}/{prefix}", config=config, transfer=transfer))
    for name, tensor in state.items():
        assert torch.equal(out[name], tensor) and out[name].numpy().tobytes() == tensor.numpy().tobytes()


def _stored(endpoint: str, bucket: str, prefix: str = "ck/") -> dict[str, dict[str, Any]]:
    """The emulator's object resources under ``prefix`` (asked directly, not through the store)."""
    query = urllib.parse.urlencode({"prefix": prefix})
    with urllib.request.urlopen(f"{endpoint}/storage/v1/b/{bucket}/o?{query}", timeout=30) as resp:  # noqa: S310
        items = json.load(resp).get("items", [])
    names = [item["name"] for item in items if ".dcp-parts/" not in item["name"]]
    assert any(n.endswith(".metadata") for n in names) and len(names) >= 2, names
    out = {}
    for name in names:
        url = f"{endpoint}/storage/v1/b/{bucket}/o/{urllib.parse.quote(name, safe='')}"
        with urllib.request.urlopen(url, timeout=30) as resp:  # noqa: S310
            out[name] = json.load(resp)
    return out


def _kind(r: RequestInfo) -> str:
    """What a recorded request of the store is."""
    if r.path.startswith("/upload/"):
        return "upload"
    if r.path.startswith("/download/"):
        return "read"
    if r.path.endswith("/compose"):
        return "compose"
    if "/rewriteTo/" in r.path:
        return "rewrite"
    if r.method == "DELETE":
        return "delete"
    return "list" if r.path.endswith("/o") else "metadata"


def _params(r: RequestInfo) -> dict[str, str]:
    return dict(urllib.parse.parse_qsl(r.query))


def _recorded(
    gcs_emulator: Any, gcs_bucket: str, options: GCSObjectOptions | None, prefix: str = "ck"
) -> list[RequestInfo]:
    """Every request of a save and load with ``options``, a copy, a head, a small create-only put, a get and a
    delete, as the proxy saw them."""
    with FaultProxy(gcs_emulator.endpoint, flavor="gcs", record_requests=True) as proxy:
        _save_and_load(proxy.url, gcs_bucket, options, prefix)
        store = GCSStore(gcs_bucket, GCSConfig(endpoint=proxy.url, object_options=options))
        assert store.get(f"{prefix}/.metadata")
        store.copy(f"{prefix}/.metadata", f"{prefix}-copy/.metadata")
        store.head(f"{prefix}-copy/.metadata")
        store.put(f"{prefix}-small", b"x" * 100, create_only=True)
        store.delete([f"{prefix}-copy/.metadata", f"{prefix}-small"])
        store.close()
        return list(proxy.requests or ())


def test_storage_class_reaches_every_object(gcs_emulator: Any, gcs_bucket: str, gcs_env: dict[str, str]) -> None:
    """fake-gcs-server keeps the storage class of uploads: every object uploaded whole has it. The one
    composed from parts (above 1 MB) is STANDARD there: the emulator ignores storageClass in a compose
    destination (what was sent is checked in test_composed_and_copied_objects_are_sent_the_storage_class)."""
    _save_and_load(gcs_emulator.endpoint, gcs_bucket, GCSObjectOptions(storage_class="NEARLINE"))
    stored = _stored(gcs_emulator.endpoint, gcs_bucket)
    composed = {name for name, resource in stored.items() if int(resource["size"]) > 1_000_000}
    assert len(composed) == 1 and len(stored) >= 3
    for name, resource in stored.items():
        assert resource.get("storageClass") == ("STANDARD" if name in composed else "NEARLINE"), name
    _save_and_load(gcs_emulator.endpoint, gcs_bucket, None, prefix="plain")
    for name, resource in _stored(gcs_emulator.endpoint, gcs_bucket, "plain/").items():
        assert resource.get("storageClass") == "STANDARD", name


@pytest.mark.parametrize("options", [CSEK, CMEK], ids=["csek", "cmek"])
def test_every_request_carries_its_options_on_the_wire(
    gcs_emulator: Any, gcs_bucket: str, gcs_env: dict[str, str], options: GCSObjectOptions
) -> None:
    """fake-gcs-server keeps neither key nor billed project: the proxy shows every request carried them
    (uploads, ranged and whole reads, metadata GETs, composes, rewrites, listings and deletes)."""
    requests = _recorded(gcs_emulator, gcs_bucket, options)
    kinds: set[str] = set()
    for r in requests:
        kind, params, where = _kind(r), _params(r), (r.method, r.path, r.query)
        kinds.add(kind)
        assert params.get("userProject") == PROJECT, where
        with_key = kind in ("upload", "read", "metadata", "compose", "rewrite") and options is CSEK
        for name, value in CUSTOMER.items():
            assert r.headers.get(name) == (value if with_key else None), (name, *where)
        for name, value in SOURCE.items():
            assert r.headers.get(name) == (value if with_key and kind == "rewrite" else None), (name, *where)
        kms = {"upload": "kmsKeyName", "compose": "kmsKeyName", "rewrite": "destinationKmsKeyName"}.get(kind)
        if options is CMEK and kms is not None:
            assert params.get(kms) == KMS, where
        else:
            assert "kmsKeyName" not in params and "destinationKmsKeyName" not in params, where
        if kind == "upload":
            assert params.get("uploadType") == "multipart", where  # the storage class travels in the resource
    assert kinds == {"upload", "read", "metadata", "compose", "rewrite", "list", "delete"}
    reads = [r for r in requests if _kind(r) == "read"]
    assert any("range" in r.headers for r in reads) and any("range" not in r.headers for r in reads)


def test_no_options_send_nothing_new(gcs_emulator: Any, gcs_bucket: str, gcs_env: dict[str, str]) -> None:
    """Without options the wire is as it was: media uploads, and no parameter or header of the options."""
    requests = _recorded(gcs_emulator, gcs_bucket, GCSObjectOptions())
    for r in requests:
        params = _params(r)
        assert not {"userProject", "kmsKeyName", "destinationKmsKeyName"} & set(params), (r.method, r.path)
        assert not [h for h in r.headers if h.startswith(("x-goog-encryption", "x-goog-copy-source"))], r.path
    uploads = {_params(r)["uploadType"] for r in requests if _kind(r) == "upload"}
    assert uploads == {"media", "multipart"}  # multipart: only the small create-only put, as before
    assert _shape(requests) == _shape(_recorded(gcs_emulator, gcs_bucket, None, "ck2"))


def _shape(requests: list[RequestInfo]) -> collections.Counter[tuple[str, str, tuple[str, ...], tuple[str, ...]]]:
    """The requests as method, kind, parameter names and header names (their order varies with threads)."""
    return collections.Counter(
        (r.method, _kind(r), tuple(sorted(_params(r))), tuple(sorted(r.headers))) for r in requests
    )


def test_composed_and_copied_objects_are_sent_the_storage_class(
    gcs_emulator: Any, gcs_bucket: str, gcs_env: dict[str, str]
) -> None:
    """The compose destination and the rewrite body carry storageClass and kmsKeyName (the emulator ignores
    both there, and the proxy records no bodies: the bodies are read where the store's session sends them)."""
    store = GCSStore(gcs_bucket, GCSConfig(endpoint=gcs_emulator.endpoint, object_options=CMEK))
    session = store._client_()._http
    sent: list[tuple[str, str, Any]] = []
    original = session.request

    def spy(method: str, url: str, data: Any = None, **kw: Any) -> Any:
        sent.append((method, url, data))
        return original(method, url, data=data, **kw)

    session.request = spy
    try:
        upload = store.create_multipart("mp")
        parts = [store.put_part("mp", upload, n, bytes([n]) * 1000) for n in (1, 2)]
        assert store.complete_multipart("mp", upload, parts).size == 2000
        store.copy("mp", "mp-copy")
    finally:
        del session.request
    assert store.get("mp-copy") == b"\x01" * 1000 + b"\x02" * 1000
    store.close()
    bodies = {
        ("compose" if "/compose" in url else "rewrite"): json.loads(data)
        for method, url, data in sent
        if "/compose" in url or "/rewriteTo/" in url
    }
    assert bodies["compose"]["destination"]["storageClass"] == "COLDLINE"
    assert bodies["compose"]["destination"]["kmsKeyName"] == KMS
    assert bodies["rewrite"]["storageClass"] == "COLDLINE"
    # What the emulator made of it: the parts it kept the class of, the composed object and the copy not.
    assert _stored_one(gcs_emulator.endpoint, gcs_bucket, "mp-copy")["storageClass"] == "STANDARD"


def _stored_one(endpoint: str, bucket: str, name: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{endpoint}/storage/v1/b/{bucket}/o/{name}", timeout=30) as resp:  # noqa: S310
        return dict(json.load(resp))


def test_options_are_validated_with_actionable_errors() -> None:
    with pytest.raises(ConfigError, match="cryptoKeys/K"):
        GCSObjectOptions(kms_key_name="ckpt-key")
    with pytest.raises(ConfigError, match="no cryptoKeyVersions"):
        GCSObjectOptions(kms_key_name=KMS + "/cryptoKeyVersions/1")
    with pytest.raises(ConfigError, match="32 bytes") as info:
        GCSObjectOptions(customer_encryption_key=b"secret-but-short")
    assert "secret-but-short" not in str(info.value)
    with pytest.raises(ConfigError, match="choose one") as info:
        GCSObjectOptions(customer_encryption_key=KEY, kms_key_name=KMS)
    assert base64.b64encode(KEY).decode() not in str(info.value)
    with pytest.raises(ConfigError, match="must be a bool"):
        GCSObjectOptions(allow_customer_encryption_key_over_http="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="project to bill"):
        GCSObjectOptions(user_project="My Project")
    with pytest.raises(ConfigError, match="storage class like 'NEARLINE'"):
        GCSObjectOptions(storage_class="nearline")
    with pytest.raises(ConfigError, match="object_options must be a GCSObjectOptions"):
        GCSConfig(object_options={"storage_class": "NEARLINE"})  # type: ignore[arg-type]
    assert GCSObjectOptions(user_project="123456789012").user_project == "123456789012"


def test_the_customer_key_never_shows_and_needs_https(
    gcs_emulator: Any, gcs_bucket: str, gcs_env: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    key = b"K" * 32
    encoded = base64.b64encode(key).decode()
    options = GCSObjectOptions(customer_encryption_key=key)
    config = GCSConfig(endpoint="https://storage.example", object_options=options)
    for text in (repr(options), repr(config), repr(GCSStore("b", config))):
        assert "KKKK" not in text and encoded not in text
    with pytest.raises(ConfigError, match="only over https") as info:
        GCSConfig(endpoint="http://127.0.0.1:9", object_options=options)
    assert encoded not in str(info.value)
    # An endpoint from the environment (gcs_env: STORAGE_EMULATOR_HOST, plain http) is checked when the
    # client is built.
    with pytest.raises(ConfigError, match="only over https"):
        GCSStore(gcs_bucket, GCSConfig(object_options=options)).check_bucket()
    # Allowed over http: a save and load logs nothing of the key, nor do failures.
    allowed = GCSObjectOptions(customer_encryption_key=key, allow_customer_encryption_key_over_http=True)
    caplog.set_level(logging.DEBUG)
    _save_and_load(gcs_emulator.endpoint, gcs_bucket, allowed)
    store = GCSStore(gcs_bucket, GCSConfig(endpoint=gcs_emulator.endpoint, object_options=allowed))
    with pytest.raises(Exception) as missing:  # noqa: PT011 - whichever typed error: its text is checked
        store.head("ck/not-there")
    assert encoded not in str(missing.value) and "KKKK" not in str(missing.value)
    assert caplog.records and not [r for r in caplog.records if encoded in r.getMessage() or "KKKK" in r.getMessage()]


def test_uploads_with_a_storage_class_send_the_callers_buffer(
    gcs_emulator: Any, gcs_bucket: str, gcs_env: dict[str, str]
) -> None:
    """With a storage class, an upload is one uploadType=multipart POST whose body frames the caller's buffer
    itself (no copy), and the object is stored with the class and the bytes."""
    options = GCSObjectOptions(storage_class="ARCHIVE", user_project=PROJECT)
    store = GCSStore(gcs_bucket, GCSConfig(endpoint=gcs_emulator.endpoint, object_options=options))
    session = store._client_()._http
    sent: list[tuple[str, Any, dict[str, str]]] = []
    original = session.request

    def spy(method: str, url: str, data: Any = None, headers: Any = None, **kw: Any) -> Any:
        sent.append((url, data, dict(headers or {})))
        return original(method, url, data=data, headers=headers, **kw)

    session.request = spy
    buffer = bytearray(range(256)) * 8192  # 2 MiB
    try:
        info = store.put("archived", memoryview(buffer))
    finally:
        del session.request
    [(url, body, headers)] = sent
    query = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(url).query))
    assert query == {"uploadType": "multipart", "userProject": PROJECT}
    assert headers["Content-Type"].startswith("multipart/related; boundary=")
    pieces = body.pieces
    assert len(pieces) == 3 and pieces[1].obj is buffer  # framing, the caller's buffer itself, framing
    assert json.loads(bytes(pieces[0]).split(b"\r\n\r\n", 1)[1].split(b"\r\n", 1)[0])["storageClass"] == "ARCHIVE"
    assert info.size == len(buffer) and store.get("archived") == bytes(buffer)
    assert _stored_one(gcs_emulator.endpoint, gcs_bucket, "archived")["storageClass"] == "ARCHIVE"
    store.close()


def test_a_store_with_options_pickles_with_them() -> None:
    """A process-based async_save pickles the store: the options (the key too) travel with it."""
    config = GCSConfig(endpoint="https://storage.example", object_options=GCSObjectOptions(customer_encryption_key=KEY))
    clone = pickle.loads(pickle.dumps(GCSStore("bucket", config)))  # noqa: S301 - our own bytes
    assert clone.config == config and clone.config.object_options.customer_encryption_key == KEY  # type: ignore[union-attr]


def test_copy_checkpoint_reads_and_writes_with_the_key(
    gcs_emulator: Any, gcs_bucket: str, gcs_env: dict[str, str]
) -> None:
    """dcp_cloud.maintenance.copy_checkpoint (what ``dcp-cloud cp`` runs) copies server-side: every rewrite
    sends the customer key for the source and the copy, and the copy loads bitwise equal."""
    from dcp_cloud.maintenance import copy_checkpoint

    _save_and_load(gcs_emulator.endpoint, gcs_bucket, CSEK)
    with FaultProxy(gcs_emulator.endpoint, flavor="gcs", record_requests=True) as proxy:
        config = GCSConfig(endpoint=proxy.url, object_options=CSEK)
        copy_checkpoint(
            f"gs://{gcs_bucket}/ck", f"gs://{gcs_bucket}/copy", source_config=config, destination_config=config
        )
        requests = list(proxy.requests or ())
    rewrites = [r for r in requests if _kind(r) == "rewrite"]
    assert len(rewrites) >= 2
    for r in rewrites:
        assert {k: r.headers.get(k) for k in (*CUSTOMER, *SOURCE)} == {**CUSTOMER, **SOURCE}, r.path
        assert _params(r).get("userProject") == PROJECT
    state = _state()
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    config = GCSConfig(endpoint=gcs_emulator.endpoint, object_options=CSEK)
    dcp.load(out, storage_reader=GCSReader(f"gs://{gcs_bucket}/copy", config=config))
    assert all(torch.equal(out[k], v) for k, v in state.items())
