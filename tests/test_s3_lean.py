"""The lean S3 client: its signatures agree with botocore's, its requests on the wire, and when it is chosen."""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import os
import subprocess
import sys
import threading
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import crc32c
import pytest

from dcp_cloud.errors import ConfigError, ObjectNotFoundError
from dcp_cloud.store.s3 import S3Config, S3Store
from dcp_cloud.store.s3.clientsetup import lean_settings
from dcp_cloud.store.s3.headers import HEADERS, RequestOptions, wire_headers
from dcp_cloud.store.s3.lean import LeanS3Client
from dcp_cloud.store.s3.sigv4 import Credentials, payload_sha256, sign

# -- SigV4 against botocore's signer ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "query", "extra", "body", "token"),
    [
        ("GET", "/bkt/dir/__0_abc.distcp", {}, {}, b"", None),  # botocore also signs Range; S3 needs only these
        ("PUT", "/bkt/a key+with spaces/ünï.distcp", {"partNumber": "3", "uploadId": "u/p+id="}, {}, b"x" * 1000, None),
        ("POST", "/bkt/k", {"uploads": ""}, {"x-amz-checksum-algorithm": "CRC32C"}, b"", "tok/en=="),
        ("GET", "/bkt", {"list-type": "2", "prefix": "run/step 1/", "max-keys": "1000"}, {}, b"", None),
    ],
)
def test_signature_matches_botocore(
    method: str, path: str, query: dict[str, str], extra: dict[str, str], body: bytes, token: str | None
) -> None:
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials as BotoCredentials

    from dcp_cloud.store.s3.sigv4 import canonical_query, uri_encode_path

    host = "127.0.0.1:9000"
    encoded = uri_encode_path(path)
    url = f"http://{host}{encoded}" + (f"?{canonical_query(query)}" if query else "")
    request = AWSRequest(method=method, url=url, data=body, headers={**extra, "host": host})
    S3SigV4Auth(BotoCredentials("AKIDEXAMPLE", "secret/key+", token), "s3", "eu-west-1").add_auth(request)
    when = dt.datetime.strptime(request.headers["X-Amz-Date"], "%Y%m%dT%H%M%SZ").replace(tzinfo=dt.timezone.utc)

    ours = dict(extra)
    sign(method, host, encoded, query, ours, payload_sha256([body]), Credentials("AKIDEXAMPLE", "secret/key+", token),
         "eu-west-1", now=when)  # fmt: skip
    assert ours["authorization"] == request.headers["Authorization"]
    assert ours["x-amz-content-sha256"] == request.headers["X-Amz-Content-SHA256"]


def test_credentials_never_print_the_secret() -> None:
    text = repr(Credentials("AKIDEXAMPLE", "very-secret", "session-token"))
    assert "very-secret" not in text and "session-token" not in text


# -- which client a store builds -------------------------------------------------------------------


def _env(monkeypatch: pytest.MonkeyPatch, **values: str | None) -> None:
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "HTTPS_PROXY", "HTTP_PROXY", "AWS_REGION",
                 "AWS_DEFAULT_REGION", "https_proxy", "http_proxy", "ALL_PROXY", "all_proxy"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    for name, value in values.items():
        if value is not None:
            monkeypatch.setenv(name, value)


def test_lean_settings_choose_the_client(monkeypatch: pytest.MonkeyPatch) -> None:
    _env(monkeypatch)
    assert lean_settings(S3Config()) is None  # AWS itself, settings may live in ~/.aws/config: botocore
    explicit = lean_settings(S3Config(endpoint_url="http://127.0.0.1:9000"))
    assert explicit is not None and explicit.path_style and explicit.region == "us-east-1"
    assert lean_settings(S3Config(endpoint_url="http://127.0.0.1:9000", client="botocore")) is None
    assert lean_settings(S3Config(endpoint_url="http://127.0.0.1:9000", profile="p")) is None
    named = lean_settings(S3Config(endpoint_url="https://minio.example:9000", region="eu-west-1"))
    assert named is not None and not named.path_style and named.region == "eu-west-1"
    aws = lean_settings(S3Config(client="lean", region="ap-south-1"))
    assert aws is not None and aws.endpoint_url == "https://s3.ap-south-1.amazonaws.com"

    _env(monkeypatch, AWS_ENDPOINT_URL_S3="http://127.0.0.1:9001", AWS_REGION="eu-west-3")
    from_env = lean_settings(S3Config())
    assert from_env is not None and from_env.endpoint_url == "http://127.0.0.1:9001" and from_env.region == "eu-west-3"
    _env(monkeypatch, AWS_ENDPOINT_URL="http://127.0.0.1:9001", HTTPS_PROXY="http://proxy:3128")
    assert lean_settings(S3Config()) is None  # botocore routes through the proxy
    _env(monkeypatch, AWS_ENDPOINT_URL="http://127.0.0.1:9001", AWS_PROFILE="p")
    assert lean_settings(S3Config()) is None


def test_store_builds_the_lean_client_and_botocore_only_when_asked(s3_env: dict[str, str]) -> None:
    assert isinstance(S3Store("bkt")._client(), LeanS3Client)
    assert not isinstance(S3Store("bkt", S3Config(client="botocore"))._client(), LeanS3Client)


def test_a_lean_save_and_load_never_builds_a_botocore_client(s3_env: dict[str, str], s3_bucket: str) -> None:
    script = f"""
import sys, torch, torch.distributed.checkpoint as dcp
from dcp_cloud import S3Reader, S3Writer
sd = {{f"t{{i}}": torch.arange(1000, dtype=torch.float32) + i for i in range(20)}}
dcp.save(sd, storage_writer=S3Writer("s3://{s3_bucket}/lean-only"))
out = {{k: torch.zeros_like(v) for k, v in sd.items()}}
dcp.load(out, storage_reader=S3Reader("s3://{s3_bucket}/lean-only"))
assert all(torch.equal(out[k], sd[k]) for k in sd)
print(sorted(m for m in ("botocore.client", "botocore.session", "boto3") if m in sys.modules))
"""
    done = subprocess.run([sys.executable, "-c", script], env={**os.environ, **s3_env}, capture_output=True, text=True,
                          timeout=240)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_credentials_from_the_provider_chain(
    s3_env: dict[str, str], s3_bucket: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No keys in the environment: the lean client asks botocore's chain (here: the shared credentials file).
    creds = tmp_path / "credentials"
    creds.write_text("[default]\naws_access_key_id = AKIDFILE\naws_secret_access_key = from-file\n")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID", raising=False)
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY", raising=False)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    store = S3Store(s3_bucket)
    assert isinstance(store._client(), LeanS3Client)
    store.put("k", b"chain")
    assert store.get("k") == b"chain"


def test_no_credentials_is_access_denied(
    s3_env: dict[str, str], tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dcp_cloud import AccessDeniedError

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(AccessDeniedError, match="credentials"):
        S3Store("bkt", S3Config(client="lean")).head("k")


# -- the requests on the wire ------------------------------------------------------------------------------------


class Recorder:
    """An HTTP server that records every request and answers like S3 would, for the few requests tested."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _any(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                split = urlsplit(self.path)
                record = {"method": self.command, "path": split.path, "query": parse_qs(split.query, True),
                          "headers": {k.lower(): v for k, v in self.headers.items()}, "body": body}  # fmt: skip
                outer.seen.append(record)
                answer = outer.answer(record)
                self.send_response(200)
                self.send_header("ETag", '"etag-1"')
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            do_GET = do_PUT = do_HEAD = do_POST = do_DELETE = _any

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
        self.endpoint_url = f"http://127.0.0.1:{self.server.server_address[1]}"

    @staticmethod
    def answer(record: dict[str, Any]) -> bytes:
        q = record["query"]
        if record["method"] == "POST" and "uploads" in q:
            return b"<InitiateMultipartUploadResult><UploadId>up-1</UploadId></InitiateMultipartUploadResult>"
        if record["method"] == "POST" and "uploadId" in q:
            return b"<CompleteMultipartUploadResult><ETag>&quot;done&quot;</ETag></CompleteMultipartUploadResult>"
        if record["method"] == "POST" and "delete" in q:
            return b"<DeleteResult/>"
        return b""


@pytest.fixture
def recorder(s3_env: dict[str, str]) -> Iterator[Recorder]:
    rec = Recorder()
    try:
        yield rec
    finally:
        rec.server.shutdown()
        rec.server.server_close()


def test_lean_requests_carry_checksums_and_signed_bodies(recorder: Recorder) -> None:
    store = S3Store("bkt", S3Config(endpoint_url=recorder.endpoint_url, region="us-east-1"))
    assert isinstance(store._client(), LeanS3Client)
    data = os.urandom(300_000)
    crc = base64.b64encode(crc32c.crc32c(data).to_bytes(4, "big")).decode()
    store.put("dir/whole", [data[:1000], memoryview(data)[1000:]])  # pieces: the store computes the CRC
    put = recorder.seen[-1]
    assert (put["method"], put["path"]) == ("PUT", "/bkt/dir/whole")
    assert put["body"] == data
    assert put["headers"]["x-amz-checksum-crc32c"] == crc
    assert put["headers"]["x-amz-content-sha256"] == hashlib.sha256(data).hexdigest()  # plain HTTP: signed
    assert "expect" not in put["headers"]  # no 100-continue round trip before the body

    upload = store.create_multipart("mp")
    assert upload == "up-1"
    assert recorder.seen[-1]["headers"]["x-amz-checksum-algorithm"] == "CRC32C"
    part = store.put_part("mp", upload, 2, data)
    sent = recorder.seen[-1]
    assert sent["query"] == {"partNumber": ["2"], "uploadId": ["up-1"]} and sent["body"] == data
    assert part.token == f"etag-1|{crc}"
    done = store.complete_multipart("mp", upload, [part], create_only=True)
    complete = recorder.seen[-1]
    assert complete["headers"]["if-none-match"] == "*"
    parts = ET.fromstring(complete["body"])
    assert [el.text for el in parts.iter() if el.tag.endswith("ChecksumCRC32C")] == [crc]
    assert [el.text for el in parts.iter() if el.tag.endswith("PartNumber")] == ["2"]
    assert done.version == "done"

    store.delete([f"gone-{i:04d}" for i in range(2500)])
    deletes = [r for r in recorder.seen if "delete" in r["query"]]
    assert [len(ET.fromstring(r["body"])) - 1 for r in deletes] == [1000, 1000, 500]  # minus <Quiet>
    for r in deletes:
        assert r["headers"]["content-md5"] == base64.b64encode(hashlib.md5(r["body"]).digest()).decode()


def test_lean_requests_without_transport_checksums(recorder: Recorder) -> None:
    store = S3Store("bkt", S3Config(endpoint_url=recorder.endpoint_url, transport_checksums=False))
    store.put("k", b"abc", crc32c=crc32c.crc32c(b"abc"))
    assert not [h for h in recorder.seen[-1]["headers"] if h.startswith("x-amz-checksum")]
    store.create_multipart("mp")
    assert "x-amz-checksum-algorithm" not in recorder.seen[-1]["headers"]


class _FakePool:
    def __init__(self, seen: list[dict[str, str]]) -> None:
        self.seen = seen

    def urlopen(self, method: str, url: str, *, headers: dict[str, str], **_: Any) -> Any:
        self.seen.append(headers)

        class Response:
            status = 200
            data = b""
            headers = {"etag": '"e"'}

        return Response()


@pytest.mark.parametrize(
    ("endpoint", "checksums", "unsigned"),
    [
        ("https://s3.example:9", True, True),  # TLS + CRC32C header: no SHA-256 pass over the body
        ("http://s3.example:9", True, False),  # plain HTTP: the signature is all that protects the body
        ("https://s3.example:9", False, False),  # no checksum header: keep the signed payload
    ],
)
def test_lean_payload_signing(endpoint: str, checksums: bool, unsigned: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    store = S3Store("bucket", S3Config(endpoint_url=endpoint, region="us-east-1", transport_checksums=checksums))
    client = store._client()
    seen: list[dict[str, str]] = []
    client._pool.connection_from_host = lambda *a, **k: _FakePool(seen)  # type: ignore[method-assign]
    store.put_part("k", "upload", 1, b"x" * 70_000)
    store.put("k", b"y" * 70_000)
    assert len(seen) == 2
    for headers in seen:
        assert (headers["x-amz-content-sha256"] == "UNSIGNED-PAYLOAD") is unsigned
        assert headers["host"] == "bucket.s3.example:9"  # a host name: virtual-hosted, as botocore


def test_lean_path_style_and_odd_keys(s3_store: S3Store) -> None:
    assert isinstance(s3_store._client(), LeanS3Client)
    keys = ["a b/c+d", "ü/ñ.distcp", "x?y=z&w", "tilde~/pct%20"]
    for key in keys:
        s3_store.put(key, key.encode())
    assert sorted(i.key for i in s3_store.list("")) == sorted(keys)
    for key in keys:
        assert s3_store.get(key) == key.encode()
        assert s3_store.head(key).size == len(key.encode())


def test_fallback_builds_botocore_once(s3_store: S3Store) -> None:
    client = s3_store._client()
    assert isinstance(client, LeanS3Client)
    first: Callable[..., Any] = client.get_paginator  # not lean: botocore's, built on first use
    assert client.botocore() is client.botocore()
    assert first.__self__ is client.botocore()  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("method", "op", "extra"),
    [
        ("put_object", "PutObject", {"ObjectLockMode": "GOVERNANCE"}),  # S3ObjectOptions rows aside, none
        ("put_object", "PutObject", {"IfMatch": '"etag"', "ACL": "private"}),
        ("upload_part", "UploadPart", {"IfNoneMatch": "*"}),  # botocore's model has no precondition on a part
        ("create_multipart_upload", "CreateMultipartUpload", {"ACL": "private"}),
        ("get_object", "GetObject", {"VersionId": "v1"}),
        ("head_object", "HeadObject", {"PartNumber": 1}),
        ("complete_multipart_upload", "CompleteMultipartUpload", {"ChecksumCRC32C": "AAAAAA=="}),
    ],
)
def test_lean_refuses_a_keyword_it_cannot_send(s3_store: S3Store, method: str, op: str, extra: dict[str, str]) -> None:
    """A botocore keyword without a header row is refused before anything is sent, never dropped."""
    client = s3_store._client()
    assert isinstance(client, LeanS3Client)
    args: dict[str, Any] = {"Bucket": s3_store.bucket, "Key": "refused"}
    if method in ("put_object", "upload_part"):
        args["Body"] = b"never sent"
    if method in ("upload_part", "complete_multipart_upload"):
        args["UploadId"] = s3_store.create_multipart("refused")
        args.update({"PartNumber": 1} if method == "upload_part" else {"MultipartUpload": {"Parts": []}})
    with pytest.raises(ConfigError) as raised:
        getattr(client, method)(**args, **extra)
    assert op in str(raised.value) and all(name in str(raised.value) for name in extra)
    assert isinstance(raised.value, ValueError)
    with pytest.raises(ObjectNotFoundError):
        s3_store.head("refused")
    if method == "create_multipart_upload":
        assert s3_store.list_multipart("refused") == []


@pytest.mark.parametrize("op", sorted(HEADERS))
def test_both_clients_send_the_header_table(recorder: Recorder, op: str) -> None:
    """Every option of every row, as botocore's keywords: botocore's service model names the row's header for
    the keyword, and botocore and the lean client both send exactly the row's headers, with the same values."""
    import botocore.session
    from botocore import xform_name

    body = b"body of the request"
    crc = base64.b64encode(crc32c.crc32c(body).to_bytes(4, "big")).decode()
    params = RequestOptions(crc32c=crc, checksum_algorithm="CRC32C", if_none_match="*").params(op)
    rows = HEADERS[op]
    assert sorted(params) == sorted(h.param for h in rows)  # every row's option is set
    members = botocore.session.get_session().get_service_model("s3").operation_model(op).input_shape.members
    for row in rows:
        serialization = members[row.param].serialization
        assert (serialization["location"], serialization["name"].lower()) == ("header", row.wire)
    expected = {h.wire: params[h.param] for h in rows}
    assert wire_headers(op, params) == expected and list(wire_headers(op, params)) == [h.wire for h in rows]

    args: dict[str, Any] = {"Bucket": "bkt", "Key": "k"}
    if op in ("PutObject", "UploadPart"):
        args.update(Body=body, ContentLength=len(body))
    if op == "UploadPart":
        args.update(UploadId="up-1", PartNumber=1)
    if op == "CompleteMultipartUpload":
        args.update(UploadId="up-1", MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": '"e"'}]})
    sent = {}
    for kind in ("lean", "botocore"):
        client = S3Store("bkt", S3Config(endpoint_url=recorder.endpoint_url, client=kind))._client()  # type: ignore[arg-type]
        assert isinstance(client, LeanS3Client) is (kind == "lean")
        getattr(client, xform_name(op))(**args, **params)
        headers = recorder.seen[-1]["headers"]
        sent[kind] = {h.wire: headers.get(h.wire) for h in rows}
    assert sent["lean"] == sent["botocore"] == expected
