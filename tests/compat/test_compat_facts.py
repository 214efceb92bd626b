"""Where the servers of the matrix differ from S3, asked of each server with plain boto3 (not dcp_cloud code).

Every entry of ``FACTS`` (conftest.py; the docs' table shows the same) is checked here, so a server upgrade
that changes one fails a test until the table and the docs follow.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterator
from typing import Any

import crc32c
import pytest
from botocore.exceptions import ClientError
from compat_matrix import FACTS, SERVERS

from dcp_cloud.testing.s3_servers import S3Target

_AWS_NS = "http://s3.amazonaws.com/doc/2006-03-01/"
_PART = 256 * 1024


@pytest.fixture(params=SERVERS)
def server(request: pytest.FixtureRequest) -> Iterator[tuple[S3Target, str]]:
    target: S3Target = request.getfixturevalue(f"{request.param}_target")
    bucket = target.new_bucket("dcp-facts")
    try:
        yield target, bucket
    finally:
        target.drop_bucket(bucket)


def _code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code"))


def _upload(s3: Any, bucket: str, key: str) -> tuple[str, list[dict[str, Any]]]:
    upload_id = s3.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    etag = s3.upload_part(Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=1, Body=b"p" * _PART)["ETag"]
    return upload_id, [{"PartNumber": 1, "ETag": etag}]


def if_none_match_put(s3: Any, bucket: str) -> bool:
    s3.put_object(Bucket=bucket, Key="k", Body=b"first")
    try:
        s3.put_object(Bucket=bucket, Key="k", Body=b"second", IfNoneMatch="*")
    except ClientError as exc:
        assert _code(exc) in ("PreconditionFailed", "412"), exc
        return s3.get_object(Bucket=bucket, Key="k")["Body"].read() == b"first"
    return False


def if_none_match_complete(s3: Any, bucket: str) -> bool:
    s3.put_object(Bucket=bucket, Key="k", Body=b"first")
    upload_id, parts = _upload(s3, bucket, "k")
    try:
        s3.complete_multipart_upload(
            Bucket=bucket, Key="k", UploadId=upload_id, MultipartUpload={"Parts": parts}, IfNoneMatch="*"
        )
    except ClientError as exc:
        assert _code(exc) in ("PreconditionFailed", "412"), exc
        s3.abort_multipart_upload(Bucket=bucket, Key="k", UploadId=upload_id)
        return s3.get_object(Bucket=bucket, Key="k")["Body"].read() == b"first"
    return False


def list_uploads(s3: Any, bucket: str) -> bool:
    upload_id, _ = _upload(s3, bucket, "pending")
    try:
        listed = s3.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    except ClientError as exc:
        assert _code(exc) == "NotImplemented", exc
        return False
    return [u["UploadId"] for u in listed] == [upload_id]


def abort_uploads(s3: Any, bucket: str) -> bool:
    upload_id, _ = _upload(s3, bucket, "pending")
    try:
        s3.abort_multipart_upload(Bucket=bucket, Key="pending", UploadId=upload_id)
    except ClientError as exc:
        assert _code(exc) == "MethodNotAllowed", exc
        return False
    return True


def verifies_checksums(s3: Any, bucket: str) -> bool:
    wrong = base64.b64encode((crc32c.crc32c(b"other bytes")).to_bytes(4, "big")).decode()
    try:
        s3.put_object(Bucket=bucket, Key="k", Body=b"the bytes", ChecksumCRC32C=wrong)
    except ClientError as exc:
        assert _code(exc) in ("BadDigest", "InvalidRequest", "XAmzContentChecksumMismatch"), exc
        return True
    return False


def complete_returns_etag(s3: Any, bucket: str) -> bool:
    upload_id, parts = _upload(s3, bucket, "k")
    answer = s3.complete_multipart_upload(Bucket=bucket, Key="k", UploadId=upload_id, MultipartUpload={"Parts": parts})
    head = s3.head_object(Bucket=bucket, Key="k")["ETag"]
    assert head.strip('"'), "HEAD answered no ETag"
    return answer.get("ETag", "").strip('"') == head.strip('"')


def aws_namespace(s3: Any, bucket: str) -> bool:
    bodies: list[bytes] = []

    def keep(http_response: Any, **_: Any) -> None:
        bodies.append(http_response.content)

    s3.put_object(Bucket=bucket, Key="k", Body=b"x")
    s3.meta.events.register("after-call.s3.ListObjectsV2", keep)
    try:
        s3.list_objects_v2(Bucket=bucket)
    finally:
        s3.meta.events.unregister("after-call.s3.ListObjectsV2", keep)
    return f'xmlns="{_AWS_NS}"'.encode() in bodies[0]


def byte_order_listing(s3: Any, bucket: str) -> bool:
    for key in ("a/b/x", "a/b-1"):
        s3.put_object(Bucket=bucket, Key=key, Body=b"x")
    return [o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"]] == ["a/b-1", "a/b/x"]


def paginates_listings(s3: Any, bucket: str) -> bool:
    for key in ("a", "b", "c"):
        s3.put_object(Bucket=bucket, Key=key, Body=b"x")
    try:
        first = s3.list_objects_v2(Bucket=bucket, MaxKeys=2)
    except ClientError as exc:
        assert _code(exc) == "InternalError", exc
        return False
    rest = s3.list_objects_v2(Bucket=bucket, MaxKeys=2, ContinuationToken=first["NextContinuationToken"])
    return [o["Key"] for page in (first, rest) for o in page["Contents"]] == ["a", "b", "c"]


PROBES: dict[str, Callable[[Any, str], bool]] = {
    f.__name__: f
    for f in (
        if_none_match_put,
        if_none_match_complete,
        list_uploads,
        abort_uploads,
        verifies_checksums,
        complete_returns_etag,
        aws_namespace,
        byte_order_listing,
        paginates_listings,
    )
}


def test_every_fact_has_a_probe() -> None:
    for facts in FACTS.values():
        assert set(facts) == set(PROBES)


@pytest.mark.parametrize("fact", sorted(PROBES))
def test_server_fact(server: tuple[S3Target, str], fact: str) -> None:
    target, bucket = server
    observed = PROBES[fact](target.client(), bucket)
    assert observed == FACTS[target.name][fact], f"{target.description}: {fact} is {observed}"
