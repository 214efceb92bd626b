"""S3-specific behaviour of S3Store, MotoServer and the S3 fixtures (the shared semantics are
covered by tests/test_store_conformance.py)."""

from __future__ import annotations

import base64
import http.client
import json
import os
import pickle
import socket
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import crc32c
import pytest
from botocore import exceptions as bce
from urllib3 import exceptions as u3e

from dcp_cloud.errors import (
    AccessDeniedError,
    BucketNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    DcpCloudError,
    ObjectNotFoundError,
    PreconditionFailedError,
    StoreError,
    ThrottledError,
    TransientStoreError,
)
from dcp_cloud.store.s3 import S3_PART_LIMITS, S3Config, S3Store, _translate
from dcp_cloud.testing.s3_fixtures import MOTO_PART_LIMITS, moto_client
from dcp_cloud.testing.servers.moto_server import MotoServer, MotoServerError, moto_env

SECRET = "s3cr3t-Do-Not-Leak-0123456789abcdef"


def _client_error(code: str, status: int, op: str = "GetObject", **extra: Any) -> bce.ClientError:
    return bce.ClientError(
        {"Error": {"Code": code, "Message": "server says no", **extra}, "ResponseMetadata": {"HTTPStatusCode": status}},
        op,
    )


# -- error translation ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "status", "key", "expected"),
    [
        ("NoSuchBucket", 404, "k", BucketNotFoundError),
        ("404", 404, None, BucketNotFoundError),  # HEAD bucket
        ("NoSuchKey", 404, "k", ObjectNotFoundError),
        ("404", 404, "k", ObjectNotFoundError),  # HEAD object: no body, no code
        ("AccessDenied", 403, "k", AccessDeniedError),
        ("InvalidAccessKeyId", 403, "k", AccessDeniedError),
        ("SignatureDoesNotMatch", 403, "k", AccessDeniedError),
        ("403", 403, None, AccessDeniedError),
        ("ExpiredToken", 400, "k", AccessDeniedError),
        ("PreconditionFailed", 412, "k", PreconditionFailedError),
        ("ConditionalRequestConflict", 409, "k", PreconditionFailedError),
        ("SlowDown", 503, "k", ThrottledError),
        ("ServiceUnavailable", 503, "k", ThrottledError),
        ("InternalError", 500, "k", TransientStoreError),
        ("RequestTimeout", 400, "k", TransientStoreError),
        ("TooManyRequests", 429, "k", ThrottledError),
        ("BadGateway", 502, "k", TransientStoreError),
        ("GatewayTimeout", 504, "k", TransientStoreError),
        ("InvalidRange", 416, "k", CorruptCheckpointError),
        ("EntityTooSmall", 400, "k", StoreError),
        ("NoSuchUpload", 404, "k", StoreError),
        ("InvalidPart", 400, "k", StoreError),
    ],
)
def test_translate_client_errors(code: str, status: int, key: str | None, expected: type) -> None:
    error = _translate(_client_error(code, status), "bkt", key, "read")
    assert type(error) is expected
    assert "s3://bkt" in str(error)


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (bce.NoCredentialsError(), AccessDeniedError),
        (bce.PartialCredentialsError(provider="env", cred_var="AWS_SECRET_ACCESS_KEY"), AccessDeniedError),
        (bce.ProfileNotFound(profile="nope"), AccessDeniedError),
        (bce.EndpointConnectionError(endpoint_url="http://127.0.0.1:1"), TransientStoreError),
        (bce.ConnectTimeoutError(endpoint_url="http://x"), TransientStoreError),
        (bce.ReadTimeoutError(endpoint_url="http://x"), TransientStoreError),
        (bce.ConnectionClosedError(endpoint_url="http://x"), TransientStoreError),
        (bce.IncompleteReadError(actual_bytes=1, expected_bytes=2), TransientStoreError),
        (u3e.ProtocolError("Connection broken", ConnectionResetError()), TransientStoreError),
        (u3e.ReadTimeoutError(None, "/", "read timed out"), TransientStoreError),
        (http.client.IncompleteRead(b"", 10), TransientStoreError),
        (ConnectionResetError(104, "reset"), TransientStoreError),
        (TimeoutError("timed out"), TransientStoreError),
        (ValueError("something odd"), StoreError),
    ],
)
def test_translate_other_errors(exc: BaseException, expected: type) -> None:
    assert type(_translate(exc, "bkt", "k", "read")) is expected


def test_translate_keeps_dcp_errors_and_hides_secrets() -> None:
    original = ObjectNotFoundError("x")
    assert _translate(original, "bkt", "k") is original
    error = _translate(
        _client_error("SignatureDoesNotMatch", 403, AWSAccessKeyId="AKIAEXAMPLE", StringToSign=SECRET), "bkt", "a/b"
    )
    assert "s3://bkt/a/b" in str(error)
    assert "AWS_ACCESS_KEY_ID" in str(error)
    assert SECRET not in str(error)


def test_translate_no_credentials_says_what_to_do() -> None:
    message = str(_translate(bce.NoCredentialsError(), "bkt", "k", "write"))
    assert "AWS_ACCESS_KEY_ID" in message and "AWS_PROFILE" in message


# -- configuration ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"addressing_style": "bogus"},
        {"endpoint_url": "ftp://host"},
        {"endpoint_url": "no-scheme-host:9000"},
        {"endpoint_url": ""},
        {"endpoint_url": "http://host:9000/?x=1"},
        {"region": "us east 1"},
        {"region": ""},
        {"profile": "  "},
        {"transport_checksums": "yes"},
    ],
)
def test_config_validation(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        S3Config(**kwargs)


def test_config_rejects_credentials_in_endpoint_without_echoing_them() -> None:
    with pytest.raises(ConfigError) as info:
        S3Config(endpoint_url=f"http://AKIA:{SECRET}@host:9000")
    assert SECRET not in str(info.value)


def test_config_accepts_ordinary_values() -> None:
    config = S3Config(
        endpoint_url="https://s3.example.com:8443/base",
        region="eu-west-3",
        profile="dev",
        addressing_style="path",
        transport_checksums=False,
    )
    assert config.addressing_style == "path"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"bucket": ""},
        {"bucket": "a/b"},
        {"request_timeout": 0},
        {"max_connections": 0},
        {"limits": MOTO_PART_LIMITS.__class__(10, 5, 1)},
    ],
)
def test_store_validation(kwargs: dict[str, Any]) -> None:
    args = {"bucket": "bkt", **kwargs}
    bucket = args.pop("bucket")
    with pytest.raises(ConfigError):
        S3Store(bucket, **args)


def test_default_limits_are_s3s() -> None:
    limits = S3Store("bkt").limits
    assert limits == S3_PART_LIMITS
    assert (limits.min_part_size, limits.max_part_size, limits.max_parts) == (5 * 2**20, 5 * 2**30, 10_000)


def test_client_settings(s3_store: S3Store) -> None:
    store = S3Store(s3_store.bucket, S3Config(client="botocore"), request_timeout=7.5, max_connections=5)
    config = store._client().meta.config
    assert config.retries["total_max_attempts"] == 1
    assert (config.connect_timeout, config.read_timeout) == (7.5, 7.5)
    assert config.max_pool_connections == 5
    assert config.request_checksum_calculation == "when_required"
    assert config.response_checksum_validation == "when_required"


# -- against the moto server -----------------------------------------------------------------


def test_missing_bucket(s3_env: dict[str, str]) -> None:
    store = S3Store("no-such-bucket-dcp")
    with pytest.raises(BucketNotFoundError) as info:
        store.check_bucket()
    assert "no-such-bucket-dcp" in str(info.value)
    assert "create the bucket" in str(info.value)
    assert isinstance(info.value, FileNotFoundError)
    assert isinstance(info.value.__cause__, bce.ClientError)
    with pytest.raises(BucketNotFoundError, match="no-such-bucket-dcp"):
        store.put("k", b"x")
    with pytest.raises(BucketNotFoundError):
        list(store.list(""))


def test_errors_keep_the_sdk_exception_as_cause(s3_store: S3Store) -> None:
    with pytest.raises(ObjectNotFoundError) as info:
        s3_store.get("missing")
    assert isinstance(info.value.__cause__, bce.ClientError)
    assert info.value.__cause__.response["Error"]["Code"] == "NoSuchKey"


def test_store_from_environment_only(s3_bucket: str, monkeypatch: pytest.MonkeyPatch, moto_server: MotoServer) -> None:
    # AWS_ENDPOINT_URL (set by s3_env) alone.
    store = S3Store(s3_bucket)
    store.put("k", b"env")
    assert store._client().meta.endpoint_url == moto_server.endpoint_url
    # The service-specific variable alone.
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto_server.endpoint_url)
    assert S3Store(s3_bucket).get("k") == b"env"


def test_region_from_aws_region(s3_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)
    monkeypatch.setenv("AWS_REGION", "eu-west-3")
    assert S3Store("bkt")._client().meta.region_name == "eu-west-3"
    monkeypatch.setenv("AWS_DEFAULT_REGION", "ap-south-1")
    assert S3Store("bkt")._client().meta.region_name == "eu-west-3"  # AWS_REGION wins, as in other SDKs
    monkeypatch.delenv("AWS_REGION")
    assert S3Store("bkt")._client().meta.region_name == "ap-south-1"
    assert S3Store("bkt", S3Config(region="ca-central-1"))._client().meta.region_name == "ca-central-1"


def test_explicit_endpoint_beats_environment(
    s3_bucket: str, moto_server: MotoServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    store = S3Store(s3_bucket, S3Config(endpoint_url=moto_server.endpoint_url))
    store.put("k", b"explicit")
    assert store.get("k") == b"explicit"


def _record_requests(store: S3Store) -> list[Any]:
    seen: list[Any] = []
    store._client().meta.events.register("before-send.s3", lambda request, **_: seen.append(request))
    return seen


class _NoBody:
    def stream(self, **_: Any) -> Iterator[bytes]:
        yield b""

    def read(self, *_: Any, **__: Any) -> bytes:
        return b""


def _payload_hashes(store: S3Store) -> dict[str, str]:
    """x-amz-content-sha256 of a part upload and of a PUT, answered locally (no server)."""
    from botocore.awsrequest import AWSResponse

    seen: dict[str, str] = {}

    def answer(request: Any, **_: Any) -> AWSResponse:
        op = "part" if "partNumber" in request.url else "put"
        seen[op] = request.headers["X-Amz-Content-SHA256"].decode()
        return AWSResponse(request.url, 200, {"ETag": '"e"'}, _NoBody())

    store._client().meta.events.register("before-send.s3", answer)
    store.put_part("k", "upload", 1, b"x" * 70_000)
    store.put("k", b"y" * 70_000)
    return seen


@pytest.mark.parametrize(
    ("endpoint", "checksums", "unsigned"),
    [
        ("https://127.0.0.1:9", True, True),  # TLS + CRC32C header: no SHA-256 pass over the body
        ("http://127.0.0.1:9", True, False),  # plain HTTP: the signature is all that protects the body
        ("https://127.0.0.1:9", False, False),  # no checksum header: keep the signed payload
    ],
)
def test_payload_signing_over_tls_with_checksums(
    endpoint: str, checksums: bool, unsigned: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    config = S3Config(endpoint_url=endpoint, region="us-east-1", transport_checksums=checksums, client="botocore")
    hashes = _payload_hashes(S3Store("bucket", config))
    assert set(hashes) == {"part", "put"}
    for value in hashes.values():
        assert (value == "UNSIGNED-PAYLOAD") is unsigned, hashes


def test_path_style_addressing(s3_bucket: str, moto_server: MotoServer) -> None:
    config = S3Config(endpoint_url=moto_server.endpoint_url, addressing_style="path", client="botocore")
    store = S3Store(s3_bucket, config)
    assert store._client().meta.config.s3["addressing_style"] == "path"
    seen = _record_requests(store)
    store.put("dir/k", b"path style")
    assert store.get("dir/k") == b"path style"
    assert seen and all(r.url.startswith(f"{moto_server.endpoint_url}/{s3_bucket}/dir/k") for r in seen)


def test_pickle_has_no_client_and_no_secret(s3_bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)  # moto does not check it by default
    store = S3Store(s3_bucket)
    store.put("k", b"v")  # the client (holding the credentials) exists now
    assert store._client_obj is not None
    blob = pickle.dumps(store)
    assert SECRET.encode() not in blob
    assert SECRET not in repr(store)
    copy = pickle.loads(blob)
    assert copy._client_obj is None
    assert copy.get("k") == b"v"
    assert SECRET.encode() not in pickle.dumps(copy)


def test_client_is_created_once_and_per_process(s3_store: S3Store) -> None:
    s3_store.put("k", b"parent")
    clients: set[int] = set()
    threads = [threading.Thread(target=lambda: clients.add(id(s3_store._client()))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(clients) == 1
    parent_client = s3_store._client()
    pid = os.fork()
    if pid == 0:  # child: must build its own client, not reuse the parent's sockets
        code = 1
        try:
            ok = s3_store.get("k") == b"parent" and s3_store._client() is not parent_client
            code = 0 if ok else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert s3_store._client() is parent_client


def test_transport_checksums_are_sent(s3_store: S3Store) -> None:
    # The lean client's headers: tests/test_s3_lean.py.
    s3_store = S3Store(s3_store.bucket, S3Config(client="botocore"), limits=s3_store.limits)
    seen = _record_requests(s3_store)
    data = os.urandom(300_000)
    crc = crc32c.crc32c(data)
    expected = base64.b64encode(crc.to_bytes(4, "big")).decode()
    s3_store.put("whole", data, crc32c=crc)
    put = seen[-1]
    assert put.headers["x-amz-checksum-crc32c"] == expected.encode() or put.headers["x-amz-checksum-crc32c"] == expected
    assert "x-amz-checksum-crc32" not in put.headers  # boto3 computed nothing of its own
    s3_store.put("pieces", [data[:1000], memoryview(data)[1000:]])  # crc computed by the store
    assert seen[-1].headers["x-amz-checksum-crc32c"] in (expected, expected.encode())
    assert s3_store.get("pieces") == data

    upload_id = s3_store.create_multipart("mp")
    assert seen[-1].headers.get("x-amz-checksum-algorithm") in ("CRC32C", b"CRC32C")
    first = s3_store.put_part("mp", upload_id, 1, data[:262_144], crc32c=crc32c.crc32c(data[:262_144]))
    second = s3_store.put_part("mp", upload_id, 2, data[262_144:])  # crc computed by the store
    for part, chunk in ((first, data[:262_144]), (second, data[262_144:])):
        assert part.token.endswith("|" + base64.b64encode(crc32c.crc32c(chunk).to_bytes(4, "big")).decode())
    s3_store.complete_multipart("mp", upload_id, [first, second])
    body = ET.fromstring(seen[-1].body)
    crcs = [el.text for el in body.iter() if el.tag.endswith("ChecksumCRC32C")]
    assert len(crcs) == 2
    assert s3_store.get("mp") == data


def test_transport_checksums_off(s3_bucket: str) -> None:
    store = S3Store(s3_bucket, S3Config(transport_checksums=False, client="botocore"), limits=MOTO_PART_LIMITS)
    seen = _record_requests(store)
    store.put("k", b"abc", crc32c=crc32c.crc32c(b"abc"))
    assert not [h for h in seen[-1].headers if h.lower().startswith("x-amz-checksum")]
    upload_id = store.create_multipart("mp")
    part = store.put_part("mp", upload_id, 1, b"xyz", crc32c=crc32c.crc32c(b"xyz"))
    assert "|" not in part.token
    store.complete_multipart("mp", upload_id, [part])
    assert store.get("mp") == b"xyz"


def test_modified_times(s3_store: S3Store) -> None:
    before = time.time()
    put = s3_store.put("k", b"x")
    upload_id = s3_store.create_multipart("m")
    done = s3_store.complete_multipart("m", upload_id, [s3_store.put_part("m", upload_id, 1, b"y")])
    for info in (put, done, s3_store.head("k"), *s3_store.list("")):
        assert info.modified is not None and abs(info.modified - before) < 60


def test_delete_in_batches_of_1000(s3_store: S3Store) -> None:
    s3_store = S3Store(s3_store.bucket, S3Config(client="botocore"), limits=s3_store.limits)
    s3_store.put("keep", b"1")
    s3_store.put("gone-0001", b"2")
    batches: list[int] = []
    s3_store._client().meta.events.register(
        "before-parameter-build.s3.DeleteObjects", lambda params, **_: batches.append(len(params["Delete"]["Objects"]))
    )
    s3_store.delete([f"gone-{i:04d}" for i in range(2500)])
    assert batches == [1000, 1000, 500]
    assert [i.key for i in s3_store.list("")] == ["keep"]


def test_list_paginates(s3_store: S3Store) -> None:
    keys = [f"p/{i}" for i in range(7)]
    for key in keys:
        s3_store.put(key, b"x")
    s3_store._list_page_size = 2
    listed = list(s3_store.list("p/"))
    assert [i.key for i in listed] == keys
    assert all(i.modified is not None and i.modified > 0 for i in listed)
    ids = [s3_store.create_multipart(f"u/{i}") for i in range(5)]
    assert sorted(u.upload_id for u in s3_store.list_multipart("u/")) == sorted(ids)


def test_read_streams_into_the_buffers_without_urllib3_copies(
    s3_store: S3Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    import urllib3.response

    def forbidden(self: Any, b: Any) -> int:
        raise AssertionError("urllib3's readinto copies through a temporary bytes object")

    monkeypatch.setattr(urllib3.response.HTTPResponse, "readinto", forbidden)
    data = os.urandom(2 * 1024 * 1024)
    s3_store.put("big", data)
    out = bytearray(len(data) - 10)
    s3_store.read_into("big", 5, [memoryview(out)[:1000], memoryview(out)[1000:]])
    assert out == data[5:-5]


# -- credentials checked by moto ------------------------------------------------------------------


@pytest.fixture(scope="module")
def auth_server() -> Iterator[tuple[MotoServer, dict[str, str], str]]:
    """A second moto server that checks credentials (IAM auth after 3 unauthenticated setup calls)."""
    with MotoServer(env={"INITIAL_NO_AUTH_ACTION_COUNT": "3"}) as server:
        iam = moto_client(server, "iam")
        iam.create_user(UserName="dcp")
        iam.put_user_policy(
            UserName="dcp",
            PolicyName="all",
            PolicyDocument=json.dumps(
                {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
            ),
        )
        key = iam.create_access_key(UserName="dcp")["AccessKey"]
        creds = {"AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]}
        env = {**moto_env(server), **creds}
        bucket = "auth-bucket"
        import boto3

        boto3.session.Session().client(
            "s3",
            endpoint_url=server.endpoint_url,
            region_name="us-east-1",
            aws_access_key_id=creds["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=creds["AWS_SECRET_ACCESS_KEY"],
        ).create_bucket(Bucket=bucket)
        yield server, env, bucket


@pytest.mark.parametrize("wrong", ["key id", "secret"])
def test_wrong_credentials(
    auth_server: tuple[MotoServer, dict[str, str], str],
    s3_env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    wrong: str,
) -> None:
    server, env, bucket = auth_server
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    S3Store(bucket).put("ok", b"good credentials work")  # the setup itself is right
    if wrong == "key id":
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGWRONGWRONG0")
    else:
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    store = S3Store(bucket)
    with pytest.raises(AccessDeniedError) as info:
        store.put("k", b"x")
    assert isinstance(info.value, PermissionError)
    assert "AWS_ACCESS_KEY_ID" in str(info.value) and bucket in str(info.value)
    assert SECRET not in str(info.value) and env["AWS_SECRET_ACCESS_KEY"] not in str(info.value)
    with pytest.raises(AccessDeniedError):
        store.get("ok")
    with pytest.raises(AccessDeniedError):
        store.check_bucket()


def test_credentials_from_a_named_profile(
    auth_server: tuple[MotoServer, dict[str, str], str],
    s3_env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path,
) -> None:
    server, env, bucket = auth_server
    credentials = tmp_path / "credentials"
    credentials.write_text(
        f"[good]\naws_access_key_id = {env['AWS_ACCESS_KEY_ID']}\n"
        f"aws_secret_access_key = {env['AWS_SECRET_ACCESS_KEY']}\n"
        f"[bad]\naws_access_key_id = {env['AWS_ACCESS_KEY_ID']}\naws_secret_access_key = {SECRET}\n"
    )
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    monkeypatch.setenv("AWS_ENDPOINT_URL", server.endpoint_url)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    S3Store(bucket, S3Config(profile="good")).put("from-profile", b"ok")
    monkeypatch.setenv("AWS_PROFILE", "good")
    assert S3Store(bucket).get("from-profile") == b"ok"
    with pytest.raises(AccessDeniedError):
        S3Store(bucket, S3Config(profile="bad")).get("from-profile")


def test_no_credentials_at_all(s3_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    with pytest.raises(AccessDeniedError) as info:
        S3Store("bkt").put("k", b"x")
    assert isinstance(info.value.__cause__, bce.NoCredentialsError)
    assert "AWS_ACCESS_KEY_ID" in str(info.value)


def test_unknown_profile(s3_env: dict[str, str]) -> None:
    with pytest.raises(AccessDeniedError, match="profile"):
        S3Store("bkt", S3Config(profile="no-such-profile")).put("k", b"x")


# -- a scripted fake endpoint for faults moto cannot produce ------------------------------------------------


class FakeS3:
    """An HTTP server whose every answer is decided by ``respond(handler)``."""

    def __init__(self) -> None:
        outer = self
        self.respond: Callable[[BaseHTTPRequestHandler], None] = lambda h: h.send_error(500)
        #: (client address, request line) of every request, to see connections being reused.
        self.requests: list[tuple[Any, str]] = []

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive unless a response says otherwise

            def log_message(self, *args: Any) -> None:
                pass

            def _any(self) -> None:
                outer.requests.append((self.client_address, self.requestline))
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                outer.respond(self)

            do_GET = do_PUT = do_HEAD = do_POST = do_DELETE = _any

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
        self.thread.start()
        self.endpoint_url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def store(self, request_timeout: float = 5.0, client: str = "auto") -> S3Store:
        return S3Store(
            "bkt",
            S3Config(endpoint_url=self.endpoint_url, region="us-east-1", addressing_style="path", client=client),  # type: ignore[arg-type]
            request_timeout=request_timeout,
        )

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_s3(s3_env: dict[str, str]) -> Iterator[FakeS3]:
    fake = FakeS3()
    try:
        yield fake
    finally:
        fake.close()


def _ranged(
    body: bytes,
    *,
    status: int = 206,
    content_range: str | None,
    length: int | None = None,
    delay_body: float = 0.0,
    keep_alive: bool = False,
) -> Callable[[BaseHTTPRequestHandler], None]:
    def respond(h: BaseHTTPRequestHandler) -> None:
        h.send_response(status)
        if content_range:
            h.send_header("Content-Range", content_range)
        h.send_header("Content-Length", str(len(body) if length is None else length))
        if not keep_alive:
            h.send_header("Connection", "close")
        h.end_headers()
        if delay_body:
            time.sleep(delay_body)
        h.wfile.write(body)
        h.wfile.flush()
        h.close_connection = not keep_alive

    return respond


def _error(status: int, code: str) -> Callable[[BaseHTTPRequestHandler], None]:
    def respond(h: BaseHTTPRequestHandler) -> None:
        payload = f"<?xml version='1.0'?><Error><Code>{code}</Code><Message>m</Message></Error>".encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/xml")
        h.send_header("Content-Length", str(len(payload)))
        h.end_headers()
        h.wfile.write(payload)

    return respond


def test_short_body_is_transient(fake_s3: FakeS3) -> None:
    fake_s3.respond = _ranged(b"x" * 50, content_range="bytes 0-99/1000", length=100)
    with pytest.raises(TransientStoreError, match="ended early"):
        fake_s3.store().read_into("k", 0, [memoryview(bytearray(100))])


def test_connection_is_reused_after_a_complete_read(fake_s3: FakeS3) -> None:
    fake_s3.respond = _ranged(b"0123456789", content_range="bytes 0-9/100", keep_alive=True)
    store = fake_s3.store()
    for _ in range(3):
        out = bytearray(10)
        store.read_into("k", 0, [memoryview(out[:4]), memoryview(out)[4:]])
        assert out[4:] == b"456789"
    assert len(fake_s3.requests) == 3
    assert len({addr for addr, _ in fake_s3.requests}) == 1  # one TCP connection for all three


def test_connection_is_dropped_after_an_unfinished_read(fake_s3: FakeS3) -> None:
    # The server sends more than asked for (it ignored Range): the rest must not poison the next request.
    fake_s3.respond = _ranged(bytes(range(100)), status=200, content_range=None, keep_alive=True)
    store = fake_s3.store()
    for _ in range(2):
        out = bytearray(10)
        store.read_into("k", 5, [memoryview(out)])
        assert out == bytes(range(5, 15))
    assert len({addr for addr, _ in fake_s3.requests}) == 2


def test_object_shorter_than_range_is_corrupt(fake_s3: FakeS3) -> None:
    fake_s3.respond = _ranged(b"x" * 10, content_range="bytes 90-99/100")
    with pytest.raises(CorruptCheckpointError, match="100 bytes"):
        fake_s3.store().read_into("k", 90, [memoryview(bytearray(50))])


def test_range_ignored_by_server_still_reads_the_right_bytes(fake_s3: FakeS3) -> None:
    whole = bytes(range(256)) * 40
    fake_s3.respond = _ranged(whole, status=200, content_range=None)
    out = bytearray(100)
    fake_s3.store().read_into("k", 1000, [memoryview(out)])
    assert out == whole[1000:1100]


@pytest.mark.parametrize(
    ("status", "code", "expected"),
    [
        (503, "SlowDown", TransientStoreError),
        (500, "InternalError", TransientStoreError),
        (429, "TooManyRequests", TransientStoreError),
        (416, "InvalidRange", CorruptCheckpointError),
        (403, "AccessDenied", AccessDeniedError),
        (404, "NoSuchBucket", BucketNotFoundError),
    ],
)
@pytest.mark.parametrize("client", ["botocore", "lean"])
def test_http_errors_of_either_client(fake_s3: FakeS3, status: int, code: str, expected: type, client: str) -> None:
    fake_s3.respond = _error(status, code)
    store = fake_s3.store(client=client)
    with pytest.raises(expected) as info:
        store.read_into("k", 0, [memoryview(bytearray(10))])
    assert len(fake_s3.requests) == 1  # the client did not retry on its own
    assert isinstance(info.value.__cause__, bce.ClientError)
    assert info.value.__cause__.response["Error"]["Code"] == code


def test_stalled_body_times_out_as_transient(fake_s3: FakeS3) -> None:
    fake_s3.respond = _ranged(b"x" * 10, content_range="bytes 0-9/10", delay_body=1.5)
    with pytest.raises(TransientStoreError):
        fake_s3.store(request_timeout=0.3).read_into("k", 0, [memoryview(bytearray(10))])


@pytest.mark.parametrize("client", ["botocore", "lean"])
def test_connection_refused_is_transient(s3_env: dict[str, str], client: str) -> None:
    import urllib3.exceptions

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    store = S3Store("bkt", S3Config(endpoint_url=f"http://127.0.0.1:{port}", client=client), request_timeout=2)
    with pytest.raises(TransientStoreError) as info:
        store.get("k")
    cause = bce.EndpointConnectionError if client == "botocore" else urllib3.exceptions.NewConnectionError
    assert isinstance(info.value.__cause__, cause)


# -- MotoServer -----------------------------------------------------------------------------------------


def test_moto_server_lifecycle() -> None:
    with MotoServer() as server:
        pid = server.pid
        assert pid is not None and server.running
        client = moto_client(server)
        client.create_bucket(Bucket="lifecycle")
        assert [b["Name"] for b in client.list_buckets()["Buckets"]] == ["lifecycle"]
        server.reset()
        assert client.list_buckets()["Buckets"] == []
        log = server._log_path
        assert log and os.path.exists(log)
    assert not server.running
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # gone and reaped
    assert not os.path.exists(log)
    server.stop()  # twice is fine


def test_moto_server_start_failure_shows_its_output() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        with pytest.raises(MotoServerError, match="exited"):
            MotoServer(port=port, startup_timeout=20).start()


def test_moto_env(moto_server: MotoServer) -> None:
    env = moto_env(moto_server)
    assert env["AWS_ENDPOINT_URL"] == moto_server.endpoint_url
    assert env["AWS_REGION"] == "us-east-1"
    assert env["AWS_ACCESS_KEY_ID"] and env["AWS_SECRET_ACCESS_KEY"]
    full = moto_env(
        moto_server, base={"PATH": "/bin", "AWS_PROFILE": "prod", "AWS_SESSION_TOKEN": "t", "no_proxy": "corp.example"}
    )
    assert full["PATH"] == "/bin" and "AWS_PROFILE" not in full and "AWS_SESSION_TOKEN" not in full
    assert full["NO_PROXY"] == full["no_proxy"] == "corp.example,127.0.0.1"


def test_moto_server_ignores_http_proxy(moto_server: MotoServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    moto_server.reset()  # the same direct opener that waits for a starting server
    for name, value in moto_env(moto_server).items():
        monkeypatch.setenv(name, value)
    moto_client(moto_server).create_bucket(Bucket="via-no-proxy")
    S3Store("via-no-proxy").put("k", b"direct")


def test_fixture_store_uses_lowered_part_minimum(s3_store: S3Store, moto_server: MotoServer) -> None:
    assert moto_server.min_part_size == s3_store.limits.min_part_size == 256 * 1024
    assert isinstance(ObjectNotFoundError("x"), DcpCloudError)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead, just not reaped
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc and PR_SET_PDEATHSIG")
def test_moto_server_dies_with_a_killed_owner() -> None:
    import signal
    import subprocess
    import sys

    import dcp_cloud.testing.servers.moto_server as module

    # The owner loads moto_server.py by path: importing the dcp_cloud package would pull in torch.
    script = (
        "import importlib.util, sys, time\n"
        "spec = importlib.util.spec_from_file_location('moto_server', sys.argv[1])\n"
        "mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)\n"
        "s = mod.MotoServer().start()\nprint(s.pid, flush=True)\ntime.sleep(120)\n"
    )
    owner = subprocess.Popen([sys.executable, "-c", script, module.__file__], stdout=subprocess.PIPE)
    try:
        assert owner.stdout is not None
        server_pid = int(owner.stdout.readline())
        assert _alive(server_pid)
        os.kill(owner.pid, signal.SIGKILL)  # no atexit, no finally: only the kernel can clean up
        owner.wait()
        deadline = time.monotonic() + 10
        while _alive(server_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(server_pid)
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
