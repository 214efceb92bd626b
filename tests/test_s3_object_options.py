"""S3ObjectOptions end to end: a checkpoint saved with dcp.save through each S3 client, then the server (moto)
asked what its objects carry, or, for what moto does not keep, the recording proxy asked what reached the wire."""

from __future__ import annotations

import base64
import hashlib
import os
from typing import Any

import botocore.session
import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_cloud import S3Reader, S3Writer, TransferConfig
from dcp_cloud.errors import ConfigError
from dcp_cloud.store.s3 import S3Config, S3ObjectOptions, S3Store
from dcp_cloud.store.s3.headers import wire_headers
from dcp_cloud.store.s3.objectopts import OPTION_PARAMS, WIRE, option_params
from dcp_cloud.testing.proxy import FaultProxy
from dcp_cloud.testing.s3_fixtures import MOTO_PART_LIMITS, moto_client

CLIENTS = ("lean", "botocore")
KEY = bytes(range(32))
#: moto's account id: the expected owner moto accepts.
OWNER = "123456789012"
EVERYTHING = S3ObjectOptions(
    sse_customer_key=KEY,
    allow_sse_customer_key_over_http=True,
    storage_class="STANDARD_IA",
    tags={"team": "ml"},
    requester_pays=True,
    expected_bucket_owner=OWNER,
)


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    # "big" goes in parts (1.2 MB, 256 KiB parts); the rest in single PUTs.
    return {"small": torch.arange(1000, dtype=torch.float32), "big": torch.randn(300_000, generator=g)}


def _config(endpoint: str, client: str, options: S3ObjectOptions) -> S3Config:
    return S3Config(endpoint_url=endpoint, client=client, part_limits=MOTO_PART_LIMITS, object_options=options)  # type: ignore[arg-type]


def _save_and_load(endpoint: str, bucket: str, client: str, options: S3ObjectOptions, prefix: str = "ck") -> None:
    config = _config(endpoint, client, options)
    transfer = TransferConfig(part_size=256 * 1024, multipart_threshold=256 * 1024, concurrency=2)
    state = _state()
    dcp.save(state, storage_writer=S3Writer(f"s3://{bucket}/{prefix}", config=config, transfer=transfer))
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(out, storage_reader=S3Reader(f"s3://{bucket}/{prefix}", config=config, transfer=transfer))
    for name, tensor in state.items():
        assert torch.equal(out[name], tensor) and out[name].numpy().tobytes() == tensor.numpy().tobytes()


def _heads(s3: Any, bucket: str, prefix: str = "ck/") -> dict[str, dict[str, Any]]:
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", ())]
    assert any(k.endswith(".metadata") for k in keys) and len(keys) >= 2
    return {k: s3.head_object(Bucket=bucket, Key=k) for k in keys}


@pytest.mark.parametrize("client", CLIENTS)
def test_sse_s3_objects_are_aes256(moto_server: Any, s3_bucket: str, moto_s3_client: Any, client: str) -> None:
    _save_and_load(moto_server.endpoint_url, s3_bucket, client, S3ObjectOptions(sse="AES256"))
    for key, head in _heads(moto_s3_client, s3_bucket).items():
        assert head.get("ServerSideEncryption") == "AES256", key


@pytest.mark.parametrize("client", CLIENTS)
def test_sse_kms_objects_carry_the_key_and_bucket_key(
    moto_server: Any, s3_bucket: str, moto_s3_client: Any, client: str
) -> None:
    kms = moto_client(moto_server, "kms")
    key_id = kms.create_key(Description="dcp_cloud test")["KeyMetadata"]["KeyId"]
    options = S3ObjectOptions(sse="aws:kms", kms_key_id=key_id, bucket_key=True)
    _save_and_load(moto_server.endpoint_url, s3_bucket, client, options)
    for key, head in _heads(moto_s3_client, s3_bucket).items():
        assert head.get("ServerSideEncryption") == "aws:kms", key
        assert str(head.get("SSEKMSKeyId")).endswith(key_id), key
        if "-" not in head["ETag"]:  # moto keeps no Bucket Key flag for multipart objects (S3 does)
            assert head.get("BucketKeyEnabled") is True, key


@pytest.mark.parametrize("client", CLIENTS)
def test_storage_class_and_tags_reach_every_object(
    moto_server: Any, s3_bucket: str, moto_s3_client: Any, client: str
) -> None:
    tags = {"team": "ml", "run id": "a/b c=d+e@f:g"}
    options = S3ObjectOptions(storage_class="STANDARD_IA", tags=tags)
    _save_and_load(moto_server.endpoint_url, s3_bucket, client, options)
    for key, head in _heads(moto_s3_client, s3_bucket).items():
        assert head.get("StorageClass") == "STANDARD_IA", key
        tag_set = moto_s3_client.get_object_tagging(Bucket=s3_bucket, Key=key)["TagSet"]
        assert {t["Key"]: t["Value"] for t in tag_set} == tags, key


def _md5(key: bytes) -> str:
    return base64.b64encode(hashlib.md5(key, usedforsecurity=False).digest()).decode()


@pytest.mark.parametrize("client", CLIENTS)
def test_every_request_carries_its_options_on_the_wire(moto_server: Any, s3_bucket: str, client: str) -> None:
    """moto keeps neither SSE-C nor request payer nor expected owner: the recording proxy shows that every
    request carried them (SSE-C: every PUT, part, upload start and completion, GET and HEAD)."""
    with FaultProxy(moto_server.endpoint_url, record_requests=True) as proxy:
        _save_and_load(proxy.url, s3_bucket, client, EVERYTHING)
        store = S3Store(s3_bucket, _config(proxy.url, client, EVERYTHING))
        assert [o.key for o in store.list("ck/")]
        store.head(next(iter(store.list("ck/"))).key)
        store.delete(["ck/not-there"])
        requests = list(proxy.requests or ())
    assert requests
    customer = {
        "x-amz-server-side-encryption-customer-algorithm": "AES256",
        "x-amz-server-side-encryption-customer-key": base64.b64encode(KEY).decode(),
        "x-amz-server-side-encryption-customer-key-md5": _md5(KEY),
    }
    kinds = set()
    for r in requests:
        h = r.headers
        assert h.get("x-amz-expected-bucket-owner") == OWNER, (r.method, r.path, r.query)
        on_object = r.path.strip("/").count("/") >= 1
        if r.method == "HEAD" and not on_object:
            continue  # HeadBucket takes no request payer
        assert h.get("x-amz-request-payer") == "requester", (r.method, r.path, r.query)
        if on_object and not (r.method == "DELETE" or "delete" in r.query):
            kinds.add((r.method, "uploadId" in r.query, "uploads" in r.query))
            for name, value in customer.items():
                assert h.get(name) == value, (name, r.method, r.path, r.query)
        new_object = r.method == "PUT" and "partNumber" not in r.query or "uploads" in r.query
        if new_object:
            assert h.get("x-amz-storage-class") == "STANDARD_IA" and h.get("x-amz-tagging") == "team=ml", r
    # PUT, part upload, upload start, completion, GET and HEAD were all seen (and checked)
    assert {("PUT", False, False), ("PUT", True, False), ("POST", False, True), ("POST", True, False)} <= kinds
    assert {m for m, _, _ in kinds} >= {"GET", "HEAD"}


@pytest.mark.parametrize("size", [1000, 1024 * 1024])
def test_server_side_copies_give_the_copy_the_options(
    moto_server: Any, s3_bucket: str, moto_s3_client: Any, size: int
) -> None:
    """CopyObject (small) and UploadPartCopy (the copy part size lowered): the copy carries the options."""
    moto_s3_client.put_object(Bucket=s3_bucket, Key="src", Body=os.urandom(size))
    options = S3ObjectOptions(sse="AES256", storage_class="STANDARD_IA", tags={"copied": "yes"})
    store = S3Store(s3_bucket, _config(moto_server.endpoint_url, "lean", options), limits=MOTO_PART_LIMITS)
    store.copy_part_size = 256 * 1024  # type: ignore[misc]
    store.copy("src", "dst")
    head = moto_s3_client.head_object(Bucket=s3_bucket, Key="dst")
    assert (head["ContentLength"], head.get("ServerSideEncryption"), head.get("StorageClass")) == (
        size,
        "AES256",
        "STANDARD_IA",
    )
    tag_set = moto_s3_client.get_object_tagging(Bucket=s3_bucket, Key="dst")["TagSet"]
    assert tag_set == [{"Key": "copied", "Value": "yes"}]


def test_copies_send_the_customer_key_for_source_and_destination(moto_server: Any, s3_bucket: str) -> None:
    moto_s3_client = moto_client(moto_server)
    moto_s3_client.put_object(Bucket=s3_bucket, Key="src", Body=b"x" * 600_000)
    with FaultProxy(moto_server.endpoint_url, record_requests=True) as proxy:
        store = S3Store(s3_bucket, _config(proxy.url, "lean", EVERYTHING), limits=MOTO_PART_LIMITS)
        store.copy_part_size = 256 * 1024  # type: ignore[misc]
        store.copy("src", "dst")
        requests = list(proxy.requests or ())
    copies = [r for r in requests if "x-amz-copy-source" in r.headers]
    assert len(copies) == 3  # three UploadPartCopy ranges
    for r in copies:
        assert r.headers.get("x-amz-copy-source-server-side-encryption-customer-key-md5") == _md5(KEY)
        assert r.headers.get("x-amz-server-side-encryption-customer-key-md5") == _md5(KEY)
        assert r.headers.get("x-amz-source-expected-bucket-owner") == OWNER


def test_the_lean_client_sends_every_option_botocore_sends() -> None:
    """Every option keyword of every operation has a header row, the one botocore's service model names; the
    lean client sends it and refuses a keyword it has no row for."""
    model = botocore.session.get_session().get_service_model("s3")
    kms = S3ObjectOptions(sse="aws:kms", kms_key_id="k", bucket_key=True, storage_class="GLACIER_IR", tags={"a": "b"})
    for op, names in OPTION_PARAMS.items():
        members = model.operation_model(op).input_shape.members
        for name in names:
            assert members[name].serialization["name"].lower() == WIRE[name], (op, name)
        for options in (EVERYTHING, kms):
            params = option_params(options, op)
            sent = wire_headers(op, params)
            assert {WIRE[name] for name in params} == set(sent), op
    assert wire_headers("PutObject", {"BucketKeyEnabled": True}) == {
        "x-amz-server-side-encryption-bucket-key-enabled": "true"
    }
    with pytest.raises(ConfigError, match="cannot send ObjectLockMode"):
        wire_headers("PutObject", {"ObjectLockMode": "GOVERNANCE"})


def test_options_are_validated_with_actionable_errors() -> None:
    with pytest.raises(ConfigError, match="sse must be one of"):
        S3ObjectOptions(sse="aes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match='needs sse="aws:kms"'):
        S3ObjectOptions(kms_key_id="k")
    with pytest.raises(ConfigError, match="bucket_key applies only to SSE-KMS"):
        S3ObjectOptions(sse="AES256", bucket_key=True)
    with pytest.raises(ConfigError, match="32 bytes") as info:
        S3ObjectOptions(sse_customer_key=b"secret-but-short")
    assert "secret-but-short" not in str(info.value)
    with pytest.raises(ConfigError, match="cannot be combined"):
        S3ObjectOptions(sse="AES256", sse_customer_key=KEY)
    with pytest.raises(ConfigError, match="storage class"):
        S3ObjectOptions(storage_class="standard ia")
    with pytest.raises(ConfigError, match="at most 10 tags"):
        S3ObjectOptions(tags={str(i): "v" for i in range(11)})
    with pytest.raises(ConfigError, match="character S3 refuses"):
        S3ObjectOptions(tags={"a": "b&c"})
    with pytest.raises(ConfigError, match="12-digit"):
        S3ObjectOptions(expected_bucket_owner="me")
    with pytest.raises(ConfigError, match="object_options must be"):
        S3Config(object_options={"sse": "AES256"})  # type: ignore[arg-type]


def test_the_customer_key_never_shows_and_needs_https(s3_env: dict[str, str]) -> None:
    key = b"K" * 32
    options = S3ObjectOptions(sse_customer_key=key)
    encoded = base64.b64encode(key).decode()
    for text in (repr(options), repr(S3Config(object_options=options)), repr(S3Store("b", S3Config()))):
        assert "KKKK" not in text and encoded not in text
    with pytest.raises(ConfigError, match="only over https") as info:
        S3Config(endpoint_url="http://127.0.0.1:9", object_options=options)
    assert encoded not in str(info.value)
    assert S3Config(endpoint_url="https://s3.example", object_options=options).object_options is options
    # An endpoint from the environment (s3_env points at moto over http) is checked when the client is built.
    with pytest.raises(ConfigError, match="only over https"):
        S3Store("b", S3Config(object_options=options)).check_bucket()
    assert S3Config(endpoint_url="http://127.0.0.1:9", object_options=S3ObjectOptions(sse_customer_key=key, **_http()))


def _http() -> dict[str, bool]:
    return {"allow_sse_customer_key_over_http": True}


@pytest.mark.parametrize("client", CLIENTS)
def test_copy_checkpoint_gives_the_copies_the_options(
    moto_server: Any, s3_bucket: str, moto_s3_client: Any, client: str
) -> None:
    """dcp_cloud.maintenance.copy_checkpoint (what ``dcp-cloud cp`` runs) copies server-side: the copies
    carry the destination config's options, and load bitwise equal."""
    from dcp_cloud.maintenance import copy_checkpoint

    _save_and_load(moto_server.endpoint_url, s3_bucket, client, S3ObjectOptions())
    options = S3ObjectOptions(sse="AES256", storage_class="STANDARD_IA", tags={"copied": "yes"})
    config = _config(moto_server.endpoint_url, client, options)
    copy_checkpoint(f"s3://{s3_bucket}/ck", f"s3://{s3_bucket}/copy", source_config=config, destination_config=config)
    for key, head in _heads(moto_s3_client, s3_bucket, "copy/").items():
        assert (head.get("ServerSideEncryption"), head.get("StorageClass")) == ("AES256", "STANDARD_IA"), key
        tag_set = moto_s3_client.get_object_tagging(Bucket=s3_bucket, Key=key)["TagSet"]
        assert tag_set == [{"Key": "copied", "Value": "yes"}], key
    state = _state()
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(out, storage_reader=S3Reader(f"s3://{s3_bucket}/copy", config=config))
    assert all(torch.equal(out[k], v) for k, v in state.items())
