"""LeanS3Client: the S3 requests a checkpoint makes, over urllib3, without building a botocore client.

Why it exists: a fresh process pays for its first botocore client in CPU time (the S3 service model and
endpoint rules parsed from JSON, its event handlers registered), and the objects it leaves behind can tip
Python into a full garbage collection of the whole torch heap. Every rank of a job pays both before its
first byte moves, which on small shards can be most of a save or load. botocore also runs its event chain
on every request and waits a round trip for ``100-continue`` before every upload body. This client signs
with SigV4 itself (:mod:`.sigv4`) and sends on a urllib3 pool, with nothing to parse when it is built.

It speaks botocore's dialect, so the store and its one error-translation
function treat both clients alike: the same method names and keyword
arguments, the same response keys, failures raised as botocore's
``ClientError`` (with the same ``Error``/``ResponseMetadata`` shape) or as
urllib3's exceptions. What it does not implement (server-side copies,
listings of pending uploads) goes to a botocore client built on first use.
A keyword argument it has no header for raises ConfigError rather than go
unsent; the headers come from :mod:`.headers`, the table the store builds
botocore's keywords from.

Which client a store uses is :attr:`S3Config.client`; see :func:`.clientsetup.lean_settings`.
"""

from __future__ import annotations

import base64
import email.utils
import hashlib
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit
from xml.sax.saxutils import escape

from ..warmup import warm_pool
from .clientsetup import LeanSettings, _Credentials
from .headers import wire_headers
from .s3xml import _XMLNS, parse_complete, parse_delete, parse_error, parse_initiate, parse_list_v2
from .sigv4 import (
    EMPTY_SHA256,
    UNSIGNED_PAYLOAD,
    canonical_query,
    payload_sha256,
    sign,
    uri_encode_path,
)


def _dns_bucket(bucket: str, tls: bool) -> bool:
    """Whether the bucket name can be a host label (virtual-hosted addressing), as botocore decides."""
    if not 3 <= len(bucket) <= 63 or bucket.lower() != bucket or (tls and "." in bucket):
        return False
    return all(part and part[0].isalnum() and part[-1].isalnum() for part in bucket.split("."))


class _Body:
    """botocore's StreamingBody, as far as the store uses it: ``_raw_stream`` and a checked ``read``."""

    def __init__(self, raw: Any) -> None:
        self._raw_stream = raw

    def read(self) -> bytes:
        raw = self._raw_stream
        try:
            data = raw.read()
        finally:
            raw.release_conn()
        expected = raw.headers.get("content-length")
        if expected is not None and len(data) != int(expected):
            from botocore.exceptions import IncompleteReadError

            raise IncompleteReadError(actual_bytes=len(data), expected_bytes=int(expected))
        return data

    def close(self) -> None:
        self._raw_stream.close()


class _Meta:
    def __init__(self, endpoint_url: str, region_name: str) -> None:
        self.endpoint_url = endpoint_url
        self.region_name = region_name


class LeanS3Client:
    """See the module docstring. Thread-safe; one per configuration and process (store/clients.py)."""

    def __init__(
        self,
        settings: LeanSettings,
        *,
        profile: str | None,
        timeout: float,
        max_connections: int,
        unsigned_payload_over_tls: bool,
        fallback: Callable[[], Any],
    ) -> None:
        import urllib3
        from urllib3.connection import HTTPConnection

        parts = urlsplit(settings.endpoint_url)
        self._scheme = parts.scheme
        self._host = parts.hostname or ""
        self._port = parts.port
        self._prefix = parts.path.rstrip("/")
        self._tls = parts.scheme == "https"
        self._settings = settings
        self._unsigned = unsigned_payload_over_tls and self._tls
        self._credentials = _Credentials(profile)
        self._timeout = urllib3.Timeout(connect=timeout, read=timeout)
        options = [*HTTPConnection.default_socket_options, (socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
        tls_kwargs: dict[str, Any] = {}
        if self._tls:
            tls_kwargs = {"cert_reqs": "CERT_REQUIRED", "ca_certs": settings.ca_bundle or _default_ca_bundle()}
        self._pool = urllib3.PoolManager(
            num_pools=16, maxsize=max_connections, block=False, socket_options=options, **tls_kwargs
        )
        self._fallback_factory = fallback
        self._fallback: Any = None
        self._fallback_lock = threading.Lock()
        self.meta = _Meta(settings.endpoint_url, settings.region)

    # -- plumbing --------------------------------------------------------------

    def botocore(self) -> Any:
        """The botocore client of the same configuration, built on first use."""
        with self._fallback_lock:
            if self._fallback is None:
                self._fallback = self._fallback_factory()
            return self._fallback

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.botocore(), name)

    def close(self) -> None:
        self._pool.clear()
        fallback = self._fallback
        if fallback is not None and hasattr(fallback, "close"):
            fallback.close()

    def warm(self, bucket: str, count: int) -> None:
        """Have ``count`` connections to ``bucket``'s endpoint open, the missing ones opened in the background
        (see :func:`.warmup.warm_pool`): their handshakes overlap a load's or save's first request instead of
        delaying the parallel requests after it."""
        host, _, _ = self._where(bucket, None)
        warm_pool(self._pool.connection_from_host(host, self._port, self._scheme), count, self._timeout.connect_timeout)

    def _where(self, bucket: str, key: str | None) -> tuple[str, str, str]:
        """(host to connect to, Host header, encoded path) of a bucket or object."""
        host = self._host
        if self._settings.path_style or not _dns_bucket(bucket, self._tls):
            path = f"{self._prefix}/{bucket}" + (f"/{key}" if key is not None else "")
        else:
            host = f"{bucket}.{host}"
            path = self._prefix + (f"/{key}" if key is not None else "/")
        netloc = f"[{host}]" if ":" in host else host
        if self._port is not None:
            netloc = f"{netloc}:{self._port}"
        return host, netloc, uri_encode_path(path)

    def _send(
        self,
        op: str,
        method: str,
        bucket: str,
        key: str | None = None,
        *,
        query: dict[str, str] | None = None,
        headers: dict[str, str] | None = None,
        body: Sequence[Any] | None = None,
        stream: bool = False,
    ) -> Any:
        host, netloc, path = self._where(bucket, key)
        query = query or {}
        headers = dict(headers or {})
        headers["host"] = netloc
        if body is not None:
            headers["content-length"] = str(sum(memoryview(b).nbytes for b in body))
            digest = UNSIGNED_PAYLOAD if self._unsigned else payload_sha256(body)
        else:
            digest = EMPTY_SHA256
        sign(method, netloc, path, query, headers, digest, self._credentials.get(), self._settings.region)
        url = path + ("?" + canonical_query(query) if query else "")
        pool = self._pool.connection_from_host(host, self._port, self._scheme)
        response = pool.urlopen(
            method,
            url,
            body=list(body) if body is not None else None,
            headers=headers,
            retries=False,
            redirect=False,
            timeout=self._timeout,
            preload_content=not stream,
            decode_content=False,
            assert_same_host=False,
        )
        if response.status >= 300:
            self._raise(op, method, response, stream)
        return response

    def _raise(self, op: str, method: str, response: Any, streamed: bool) -> None:
        from botocore.exceptions import ClientError

        data = b""
        if method != "HEAD":
            try:
                data = response.read() if streamed else response.data
            except Exception:  # noqa: BLE001 - the status is the error to report
                data = b""
        if streamed:
            response.release_conn()
        code, message = parse_error(data)
        code = code or str(response.status)
        raise ClientError(
            {"Error": {"Code": code, "Message": message}, "ResponseMetadata": self._metadata(response)}, op
        )

    @staticmethod
    def _metadata(response: Any) -> dict[str, Any]:
        headers = {k.lower(): v for k, v in response.headers.items()}
        return {
            "HTTPStatusCode": response.status,
            "HTTPHeaders": headers,
            "RequestId": headers.get("x-amz-request-id", ""),
        }

    @staticmethod
    def _pieces(body: Any) -> list[Any]:
        pieces = getattr(body, "pieces", None)
        if pieces is not None:
            return list(pieces)
        return [body]

    # -- operations (botocore's names and arguments) ---------------------------

    def head_bucket(self, *, Bucket: str, **kwargs: Any) -> dict[str, Any]:  # noqa: N803 - botocore's names
        response = self._send("HeadBucket", "HEAD", Bucket, headers=wire_headers("HeadBucket", kwargs))
        return {"ResponseMetadata": self._metadata(response)}

    def head_object(self, *, Bucket: str, Key: str, **kwargs: Any) -> dict[str, Any]:  # noqa: N803
        response = self._send("HeadObject", "HEAD", Bucket, Key, headers=wire_headers("HeadObject", kwargs))
        headers = response.headers
        modified = headers.get("last-modified")
        return {
            "ContentLength": int(headers.get("content-length", 0)),
            "ETag": headers.get("etag"),
            "LastModified": email.utils.parsedate_to_datetime(modified) if modified else None,
            "ResponseMetadata": self._metadata(response),
        }

    def get_object(self, *, Bucket: str, Key: str, Range: str | None = None, **kwargs: Any) -> dict[str, Any]:  # noqa: N803
        headers = {"range": Range} if Range else {}
        headers.update(wire_headers("GetObject", kwargs))
        response = self._send("GetObject", "GET", Bucket, Key, headers=headers, stream=True)
        headers = response.headers
        return {
            "Body": _Body(response),
            "ContentLength": int(headers.get("content-length", 0)),
            "ContentRange": headers.get("content-range"),
            "ETag": headers.get("etag"),
            "ResponseMetadata": self._metadata(response),
        }

    def put_object(
        self,
        *,
        Bucket: str,  # noqa: N803
        Key: str,  # noqa: N803
        Body: Any,  # noqa: N803
        ContentLength: int | None = None,  # noqa: N803 - the body's length, which content-length is counted from
        **kwargs: Any,
    ) -> dict[str, Any]:
        headers = wire_headers("PutObject", kwargs)
        response = self._send("PutObject", "PUT", Bucket, Key, headers=headers, body=self._pieces(Body))
        return {"ETag": response.headers.get("etag"), "ResponseMetadata": self._metadata(response)}

    def create_multipart_upload(self, *, Bucket: str, Key: str, **kwargs: Any) -> dict[str, Any]:  # noqa: N803
        headers = wire_headers("CreateMultipartUpload", kwargs)
        response = self._send("CreateMultipartUpload", "POST", Bucket, Key, query={"uploads": ""}, headers=headers)
        upload_id = parse_initiate(response.data)
        return {"UploadId": upload_id, "ResponseMetadata": self._metadata(response)}

    def upload_part(
        self,
        *,
        Bucket: str,  # noqa: N803
        Key: str,  # noqa: N803
        UploadId: str,  # noqa: N803
        PartNumber: int,  # noqa: N803
        Body: Any,  # noqa: N803
        ContentLength: int | None = None,  # noqa: N803 - the body's length, which content-length is counted from
        **kwargs: Any,
    ) -> dict[str, Any]:
        headers = wire_headers("UploadPart", kwargs)
        response = self._send(
            "UploadPart",
            "PUT",
            Bucket,
            Key,
            query={"partNumber": str(PartNumber), "uploadId": UploadId},
            headers=headers,
            body=self._pieces(Body),
        )
        return {"ETag": response.headers.get("etag"), "ResponseMetadata": self._metadata(response)}

    def complete_multipart_upload(
        self,
        *,
        Bucket: str,  # noqa: N803
        Key: str,  # noqa: N803
        UploadId: str,  # noqa: N803
        MultipartUpload: dict[str, Any],  # noqa: N803
        **kwargs: Any,
    ) -> dict[str, Any]:
        parts = []
        for part in MultipartUpload.get("Parts", ()):
            crc = part.get("ChecksumCRC32C")
            extra = f"<ChecksumCRC32C>{escape(crc)}</ChecksumCRC32C>" if crc else ""
            number, etag = int(part["PartNumber"]), escape(part["ETag"])
            parts.append(f"<Part><PartNumber>{number}</PartNumber><ETag>{etag}</ETag>{extra}</Part>")
        body = f"<CompleteMultipartUpload {_XMLNS}>{''.join(parts)}</CompleteMultipartUpload>".encode()
        headers = wire_headers("CompleteMultipartUpload", kwargs)
        response = self._send(
            "CompleteMultipartUpload", "POST", Bucket, Key, query={"uploadId": UploadId}, headers=headers, body=[body]
        )
        answer = parse_complete(response.data)
        if "Error" in answer:  # S3 may fail a completion with a 200
            from botocore.exceptions import ClientError

            raise ClientError(
                {"Error": answer["Error"], "ResponseMetadata": self._metadata(response)}, "CompleteMultipartUpload"
            )
        return {"ETag": answer["ETag"], "ResponseMetadata": self._metadata(response)}

    def abort_multipart_upload(self, *, Bucket: str, Key: str, UploadId: str, **kwargs: Any) -> dict[str, Any]:  # noqa: N803
        headers = wire_headers("AbortMultipartUpload", kwargs)
        response = self._send(
            "AbortMultipartUpload", "DELETE", Bucket, Key, query={"uploadId": UploadId}, headers=headers
        )
        return {"ResponseMetadata": self._metadata(response)}

    def delete_objects(self, *, Bucket: str, Delete: dict[str, Any], **kwargs: Any) -> dict[str, Any]:  # noqa: N803
        keys = "".join(f"<Object><Key>{escape(o['Key'])}</Key></Object>" for o in Delete.get("Objects", ()))
        quiet = "<Quiet>true</Quiet>" if Delete.get("Quiet") else ""
        body = f"<Delete {_XMLNS}>{quiet}{keys}</Delete>".encode()
        md5 = base64.b64encode(hashlib.md5(body, usedforsecurity=False).digest()).decode()
        headers = {"content-md5": md5, **wire_headers("DeleteObjects", kwargs)}
        response = self._send("DeleteObjects", "POST", Bucket, query={"delete": ""}, headers=headers, body=[body])
        errors = parse_delete(response.data)
        return {"Errors": errors, "ResponseMetadata": self._metadata(response)}

    def list_objects_v2(
        self,
        *,
        Bucket: str,  # noqa: N803
        Prefix: str = "",  # noqa: N803
        MaxKeys: int = 1000,  # noqa: N803
        ContinuationToken: str | None = None,  # noqa: N803
        **kwargs: Any,
    ) -> dict[str, Any]:
        query = {"list-type": "2", "prefix": Prefix, "max-keys": str(MaxKeys)}
        if ContinuationToken:
            query["continuation-token"] = ContinuationToken
        response = self._send(
            "ListObjectsV2", "GET", Bucket, query=query, headers=wire_headers("ListObjectsV2", kwargs)
        )
        page = parse_list_v2(response.data)
        page["ResponseMetadata"] = self._metadata(response)
        return page


def _default_ca_bundle() -> str | None:
    """The CA file botocore would use (certifi's when installed, else botocore's own), or the system's."""
    try:
        import certifi

        return certifi.where()
    except ImportError:
        return None
