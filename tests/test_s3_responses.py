"""Reading S3's answers as botocore does: any namespace (or none) is read, and a body that cannot be read is an
error, never an empty result.

The parsers are pure functions (s3xml); the end-to-end cases talk to real servers: s3rver's listings carry
another namespace (tests/compat runs every listing there), and an endpoint that is a web page (a real
``python -m http.server`` process) must make both clients raise instead of listing nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from dcp_cloud.errors import StoreError
from dcp_cloud.store.s3 import S3Config, S3Store
from dcp_cloud.store.s3.s3xml import (
    MalformedResponseError,
    parse_complete,
    parse_delete,
    parse_error,
    parse_initiate,
    parse_list_v2,
)
from dcp_cloud.testing.servers.moto_server import _free_port

NAMESPACES = [
    ' xmlns="http://s3.amazonaws.com/doc/2006-03-01/"',  # AWS
    ' xmlns="http://doc.s3.amazonaws.com/2006-03-01/"',  # s3rver
    ' xmlns="urn:example:some-other-s3"',  # a namespace nobody has seen
    "",  # none
]


def _listing(ns: str, keys: list[str], truncated: bool = False) -> bytes:
    contents = "".join(
        f"<Contents><Key>{k}</Key><LastModified>2026-11-26T06:00:00.000Z</LastModified>"
        f'<ETag>"e{i}"</ETag><Size>{i + 1}</Size></Contents>'
        for i, k in enumerate(keys)
    )
    token = "<NextContinuationToken>tok</NextContinuationToken>" if truncated else ""
    return (
        f'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult{ns}><Name>b</Name><Prefix></Prefix>'
        f"<KeyCount>{len(keys)}</KeyCount><MaxKeys>1000</MaxKeys><IsTruncated>{str(truncated).lower()}</IsTruncated>"
        f"{token}{contents}</ListBucketResult>"
    ).encode()


@pytest.mark.parametrize("ns", NAMESPACES)
def test_listing_in_any_namespace_returns_the_keys(ns: str) -> None:
    page = parse_list_v2(_listing(ns, ["run/step-1/.metadata", "run/step-1/__0_a.distcp"], truncated=True))
    assert [c["Key"] for c in page["Contents"]] == ["run/step-1/.metadata", "run/step-1/__0_a.distcp"]
    assert [c["Size"] for c in page["Contents"]] == [1, 2]
    assert page["Contents"][0]["ETag"] == '"e0"'
    assert page["Contents"][0]["LastModified"].year == 2026
    assert page["IsTruncated"] is True and page["NextContinuationToken"] == "tok" and page["KeyCount"] == 2


def test_listing_with_prefixed_namespace_returns_the_keys() -> None:
    body = _listing("", ["k"]).replace(b"<ListBucketResult>", b'<s3:ListBucketResult xmlns:s3="urn:x">')
    body = body.replace(b"</ListBucketResult>", b"</s3:ListBucketResult>")
    assert [c["Key"] for c in parse_list_v2(body)["Contents"]] == ["k"]


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"<html><body><h1>Sign in</h1></body></html>",
        b"not xml at all",
        b'<?xml version="1.0"?><ListBucketResult><Contents><Key>a</Key>',  # cut short
        b"<ListAllMyBucketsResult><Buckets/></ListAllMyBucketsResult>",  # another answer
        b"<ListBucketResult><Contents><Size>3</Size></Contents></ListBucketResult>",  # an entry without a key
        b"<ListBucketResult><Contents><Key>a</Key><Size>big</Size></Contents></ListBucketResult>",
    ],
    ids=["empty", "html", "text", "truncated", "other-root", "no-key", "bad-size"],
)
def test_unreadable_listing_raises(body: bytes) -> None:
    with pytest.raises(MalformedResponseError):
        parse_list_v2(body)


@pytest.mark.parametrize("ns", NAMESPACES)
def test_other_answers_in_any_namespace(ns: str) -> None:
    def xml(root: str, inner: str) -> bytes:
        return f"<{root}{ns}>{inner}</{root}>".encode()

    assert parse_initiate(xml("InitiateMultipartUploadResult", "<UploadId>u-1</UploadId>")) == "u-1"
    assert parse_complete(xml("CompleteMultipartUploadResult", '<ETag>"x"</ETag>')) == {"ETag": '"x"'}
    assert parse_complete(xml("CompleteMultipartUploadResult", "<ETag></ETag>")) == {"ETag": None}  # Ceph RGW 16
    # moto up to 5.2.1 wraps the answer in <{Operation}Response>; botocore reads it, so must we.
    moto_521 = xml("CompleteMultipartUploadResponse", '<Location>http://b/k</Location><Key>k</Key><ETag>"y-1"</ETag>')
    assert parse_complete(moto_521) == {"ETag": '"y-1"'}
    assert parse_initiate(xml("CreateMultipartUploadResponse", "<UploadId>u-2</UploadId>")) == "u-2"
    failed = parse_complete(xml("Error", "<Code>InternalError</Code><Message>m</Message>"))
    assert failed == {"Error": {"Code": "InternalError", "Message": "m"}}
    assert parse_error(xml("Error", "<Code>NoSuchKey</Code><Message>gone</Message>")) == ("NoSuchKey", "gone")
    deleted = parse_delete(
        f"<DeleteResult{ns}><Deleted><Key>a</Key></Deleted><Error><Key>b</Key><Code>AccessDenied</Code>"
        f"<Message>no</Message></Error></DeleteResult>".encode()
    )
    assert deleted == [{"Key": "b", "Code": "AccessDenied", "Message": "no"}]


def test_other_unreadable_answers_raise() -> None:
    for parse in (parse_initiate, parse_complete, parse_delete):
        with pytest.raises(MalformedResponseError):
            parse(b"<html><body>proxy login</body></html>")
    with pytest.raises(MalformedResponseError):
        parse_initiate(b"<InitiateMultipartUploadResult><Bucket>b</Bucket></InitiateMultipartUploadResult>")
    assert parse_delete(b"") == []  # a quiet delete may answer with no body
    assert parse_error(b"<html/>") == (None, "")  # the status code is the error then


@pytest.fixture(scope="module")
def web_page(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real HTTP server (``python -m http.server``) that answers requests for bucket ``bkt`` with a web page:
    an endpoint URL that points at the wrong service."""
    root: Path = tmp_path_factory.mktemp("web")
    (root / "bkt").write_bytes(b"<html><head><title>Welcome</title></head><body><p>Sign in</p></body></html>")
    port = _free_port("127.0.0.1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port), "--directory", str(root)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(f"{url}/bkt", timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.mark.parametrize("client", ["lean", "botocore"])
def test_endpoint_answering_a_web_page_raises_instead_of_listing_nothing(
    web_page: str, client: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    store = S3Store("bkt", S3Config(endpoint_url=web_page, region="us-east-1", client=client))
    try:
        with pytest.raises(StoreError, match="not .*(XML|ListObjectsV2)"):
            list(store.list("run/"))
        with pytest.raises(StoreError, match="ListMultipartUploads"):
            store.list_multipart("run/")
    finally:
        store.close()


def test_listing_page_that_holds_more_than_was_read_is_refused() -> None:
    from dcp_cloud.store.s3.listing import _check_page

    _check_page({"Name": "b", "IsTruncated": False, "KeyCount": 2}, 2, "s3://b/run/")
    with pytest.raises(StoreError, match="2 key"):
        _check_page({"Name": "b", "IsTruncated": False, "KeyCount": 2}, 0, "s3://b/run/")
    with pytest.raises(StoreError, match="without a continuation token"):
        _check_page({"Name": "b", "IsTruncated": True, "NextContinuationToken": None}, 0, "s3://b/run/")
    with pytest.raises(StoreError, match="not a ListObjectsV2 answer"):
        _check_page({"ResponseMetadata": {}}, 0, "s3://b/run/")
