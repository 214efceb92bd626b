"""S3Store: one S3 bucket behind the object-store protocol, over botocore (see the package docstring)."""

from __future__ import annotations

import base64
import os
import threading
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from ...errors import CorruptCheckpointError, DcpCloudError, StoreError
from ..clients import shared_client
from ..payload import Payload, ScatterReader, payload_crc32c, payload_size, payload_views
from ..payload import out_view as _out_view
from ..protocol import ObjectInfo, PartInfo, PartLimits, StoreCapabilities
from ..rawbody import read_ranged_body
from .clientsetup import lean_settings, make_botocore_client
from .config import S3Config, _require
from .copy import copy_object
from .errors import _s3_url, _translate
from .headers import RequestOptions
from .lean import LeanS3Client
from .listing import _S3Listings
from .objectopts import option_params
from .responses import _etag, _server_time, _timestamp

MiB = 1024 * 1024
GiB = 1024 * MiB

#: S3's own multipart rules.
S3_PART_LIMITS = PartLimits(min_part_size=5 * MiB, max_part_size=5 * GiB, max_parts=10_000)

#: Most keys one DeleteObjects request may name.
_DELETE_BATCH = 1000


def _body(data: Payload) -> tuple[Any, list[memoryview]]:
    """What to hand boto3 as a body, and the body's views.

    bytes/bytearray go as they are (sent straight to the socket); anything
    else, and bodies in several pieces, as a ScatterReader over the pieces, so
    nothing is copied up front.
    """
    views = payload_views(data)
    if isinstance(data, (bytes, bytearray)):
        return data, views
    return ScatterReader(views), views


def _crc_b64(crc: int) -> str:
    return base64.b64encode((crc & 0xFFFFFFFF).to_bytes(4, "big")).decode("ascii")


class S3Store(_S3Listings):
    """One S3 bucket. Thread-safe, picklable (the client is rebuilt per process).

    ``request_timeout`` bounds connecting and each socket read (seconds);
    ``max_connections`` sizes the connection pool (match it to the number of
    threads using the store); ``limits`` overrides S3's multipart rules for
    S3-compatible servers with other ones.
    """

    scheme = "s3"
    #: Largest object copied with one CopyObject, and the part size of larger copies (S3's limit).
    copy_part_size = 5 * 1024 * 1024 * 1024
    #: CompleteMultipartUpload consumes the parts: no abort needs to follow it (it would cost a request).
    capabilities = StoreCapabilities(sweeps_after_complete=False)
    #: Reads wait on round trips: a load's concurrency stands.
    read_workers: int | None = None
    #: Keys asked for per ListObjectsV2 / ListMultipartUploads page.
    _list_page_size = 1000

    def __init__(
        self,
        bucket: str,
        config: S3Config = S3Config(),  # noqa: B008 - a frozen dataclass
        *,
        request_timeout: float = 60.0,
        max_connections: int = 16,
        limits: PartLimits | None = None,
    ) -> None:
        _require(
            isinstance(bucket, str) and bool(bucket) and "/" not in bucket,
            f"bucket must be a bucket name without '/', got {bucket!r}",
        )
        _require(isinstance(config, S3Config), f"config must be an S3Config, got {type(config).__name__}")
        _require(request_timeout > 0, f"request_timeout must be positive, got {request_timeout}")
        _require(
            isinstance(max_connections, int) and max_connections >= 1,
            f"max_connections must be >= 1, got {max_connections}",
        )
        if limits is not None:
            _require(isinstance(limits, PartLimits), f"limits must be a PartLimits, got {type(limits).__name__}")
            _require(
                1 <= limits.min_part_size <= limits.max_part_size and limits.max_parts >= 1,
                f"limits must satisfy 1 <= min_part_size <= max_part_size and max_parts >= 1, got {limits}",
            )
        self.bucket = bucket
        self.config = config
        self.request_timeout = float(request_timeout)
        self.max_connections = max_connections
        self.limits = limits or S3_PART_LIMITS
        self._init_client_state()

    # -- client lifecycle ----------------------------------------------------

    def _init_client_state(self) -> None:
        self._lock = threading.Lock()
        self._lock_pid = os.getpid()
        self._client_obj: Any = None
        self._client_pid: int | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {
            "bucket": self.bucket,
            "config": self.config,
            "request_timeout": self.request_timeout,
            "max_connections": self.max_connections,
            "limits": self.limits,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_client_state()

    def __repr__(self) -> str:
        return (
            f"S3Store(bucket={self.bucket!r}, config={self.config!r}, "
            f"request_timeout={self.request_timeout}, max_connections={self.max_connections}, limits={self.limits!r})"
        )

    def _make_client(self) -> Any:
        """The lean client where :func:`lean_settings` allows it (see S3Config.client), else botocore's."""
        settings = lean_settings(self.config)
        options = self.config.object_options
        if settings is None:
            client = self._make_botocore_client()
            if options is not None:
                options.check_endpoint(client.meta.endpoint_url)
            return client
        if options is not None:
            options.check_endpoint(settings.endpoint_url)
        return LeanS3Client(
            settings,
            profile=self.config.profile,
            timeout=self.request_timeout,
            max_connections=self.max_connections,
            unsigned_payload_over_tls=self.config.transport_checksums,
            fallback=self._make_botocore_client,
        )

    def _make_botocore_client(self) -> Any:
        return make_botocore_client(self.config, self.request_timeout, self.max_connections)

    def _client_key(self) -> tuple[Any, ...]:
        return ("s3", self.config, self.request_timeout, self.max_connections)

    def _client(self) -> Any:
        pid = os.getpid()
        client = self._client_obj
        if client is not None and self._client_pid == pid:
            return client
        with self._process_lock():
            if self._client_obj is None or self._client_pid != pid:
                try:
                    # The parent's client (if forked) is dropped, not closed: its sockets
                    # belong to the parent. One client per configuration and process.
                    self._client_obj = shared_client(self._client_key(), self._make_client)
                except Exception as exc:
                    raise _translate(exc, self.bucket, None, "connect to") from exc
                self._client_pid = pid
            return self._client_obj

    def _full_client(self) -> Any:
        """botocore's client, for what the lean client does not implement (copies, upload listings)."""
        client = self._client()
        return client.botocore() if isinstance(client, LeanS3Client) else client

    def _process_lock(self) -> threading.Lock:
        pid = os.getpid()
        if self._lock_pid != pid:  # forked: the parent's lock may have been held at the fork
            self._lock = threading.Lock()
            self._lock_pid = pid
        return self._lock

    def close(self) -> None:
        """Let go of the client; it is shared with the process's other stores (``dcp_cloud.close_clients()``
        closes them)."""
        with self._process_lock():
            self._client_obj, self._client_pid = None, None

    def warm(self, connections: int) -> None:
        """Open up to ``connections`` connections in the background, ready for a load's or save's first
        parallel requests (the lean client's pool; botocore's client is left as it is)."""
        try:
            client = self._client()
        except DcpCloudError:
            return  # the first request reports it
        if isinstance(client, LeanS3Client):
            client.warm(self.bucket, min(connections, self.max_connections))

    def trusts_create_only(self) -> bool:
        """Whether the endpoint is AWS S3 itself, which refuses a create-only write of an existing key
        (``If-None-Match: *``). S3-compatible servers vary; :mod:`dcp_cloud.format.createonly` probes them."""
        try:
            endpoint = self._client().meta.endpoint_url
        except DcpCloudError:
            return False
        host = (urlsplit(endpoint).hostname or "").lower()
        return host.endswith((".amazonaws.com", ".amazonaws.com.cn"))

    # -- helpers -------------------------------------------------------------

    def url(self, key: str) -> str:
        return _s3_url(self.bucket, key)

    def _fail(self, exc: BaseException, key: str | None, action: str) -> DcpCloudError:
        return _translate(exc, self.bucket, key, action)

    def _opts(self, op: str) -> dict[str, Any]:
        """The bucket options (S3Config.object_options) that request ``op`` carries, as botocore keywords."""
        return option_params(self.config.object_options, op)

    def _body_options(self, crc32c: int | None, create_only: bool = False) -> RequestOptions:
        """A body's CRC32C (where transport checksums are on) and the create-only precondition."""
        precondition = "*" if create_only else None
        if crc32c is None or not self.config.transport_checksums:
            return RequestOptions(if_none_match=precondition)
        return RequestOptions(crc32c=_crc_b64(crc32c), checksum_algorithm="CRC32C", if_none_match=precondition)

    # -- protocol ------------------------------------------------------------

    def check_bucket(self) -> None:
        try:
            self._client().head_bucket(Bucket=self.bucket, **self._opts("HeadBucket"))
        except Exception as exc:
            raise self._fail(exc, None, "use the bucket") from exc

    def put(self, key: str, data: Payload, *, create_only: bool = False, crc32c: int | None = None) -> ObjectInfo:
        body, views = _body(data)
        size = payload_size(views)
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": key, "Body": body, "ContentLength": size}
        if self.config.transport_checksums and crc32c is None:
            crc32c = payload_crc32c(views)
        kwargs.update(self._body_options(crc32c, create_only).params("PutObject"), **self._opts("PutObject"))
        try:
            response = self._client().put_object(**kwargs)
        except Exception as exc:
            raise self._fail(exc, key, "write") from exc
        return ObjectInfo(key, size, _etag(response.get("ETag")), _server_time(response))

    def read_into(self, key: str, start: int, outs: Sequence[memoryview]) -> None:
        views = [_out_view(o) for o in outs]
        total = sum(len(v) for v in views)
        if total == 0:
            return
        if start < 0:
            raise CorruptCheckpointError(f"{self.url(key)}: negative read offset {start}")
        try:
            response = self._client().get_object(
                Bucket=self.bucket, Key=key, Range=f"bytes={start}-{start + total - 1}", **self._opts("GetObject")
            )
        except Exception as exc:
            raise self._fail(exc, key, "read") from exc
        try:
            read_ranged_body(
                response["Body"]._raw_stream,
                views,
                url=self.url(key),
                service="S3",
                status=response.get("ResponseMetadata", {}).get("HTTPStatusCode"),
                length=int(response.get("ContentLength", 0)),
                content_range=response.get("ContentRange"),
                start=start,
            )
        except DcpCloudError:
            raise
        except Exception as exc:
            raise self._fail(exc, key, "read") from exc

    def get(self, key: str) -> bytes:
        try:
            response = self._client().get_object(Bucket=self.bucket, Key=key, **self._opts("GetObject"))
            return response["Body"].read()
        except Exception as exc:
            raise self._fail(exc, key, "read") from exc

    def head(self, key: str) -> ObjectInfo:
        try:
            response = self._client().head_object(Bucket=self.bucket, Key=key, **self._opts("HeadObject"))
        except Exception as exc:
            raise self._fail(exc, key, "read") from exc
        return ObjectInfo(
            key, int(response["ContentLength"]), _etag(response.get("ETag")), _timestamp(response.get("LastModified"))
        )

    def delete(self, keys: Sequence[str]) -> None:
        keys = list(keys)
        for i in range(0, len(keys), _DELETE_BATCH):
            batch = keys[i : i + _DELETE_BATCH]
            try:
                response = self._client().delete_objects(
                    Bucket=self.bucket,
                    Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True},
                    **self._opts("DeleteObjects"),
                )
            except Exception as exc:
                raise self._fail(exc, batch[0], "delete") from exc
            for err in response.get("Errors", ()):
                if err.get("Code") == "NoSuchKey":
                    continue
                from botocore.exceptions import ClientError

                cause = ClientError(
                    {"Error": {"Code": err.get("Code"), "Message": err.get("Message")}}, "DeleteObjects"
                )
                raise self._fail(cause, err.get("Key"), "delete") from cause

    def copy(self, source_key: str, key: str, *, source_bucket: str | None = None) -> ObjectInfo:
        return copy_object(self, source_key, key, source_bucket)

    def create_multipart(self, key: str) -> str:
        # Declared up front: S3 rejects part checksums of an upload created without one.
        declared = RequestOptions(checksum_algorithm="CRC32C" if self.config.transport_checksums else None)
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": key, **declared.params("CreateMultipartUpload")}
        kwargs.update(self._opts("CreateMultipartUpload"))
        try:
            return self._client().create_multipart_upload(**kwargs)["UploadId"]
        except Exception as exc:
            raise self._fail(exc, key, "start an upload of") from exc

    def put_part(self, key: str, upload_id: str, number: int, data: Payload, *, crc32c: int | None = None) -> PartInfo:
        if not 1 <= number <= self.limits.max_parts:
            raise StoreError(f"part number {number} of {self.url(key)} is outside 1..{self.limits.max_parts}")
        body, views = _body(data)
        size = payload_size(views)
        if self.config.transport_checksums and crc32c is None:
            # The upload was declared CRC32C, so every part must carry one.
            crc32c = payload_crc32c(views)
        checksum = self._body_options(crc32c).params("UploadPart")
        try:
            response = self._client().upload_part(
                Bucket=self.bucket,
                Key=key,
                UploadId=upload_id,
                PartNumber=number,
                Body=body,
                ContentLength=size,
                **checksum,
                **self._opts("UploadPart"),
            )
        except Exception as exc:
            raise self._fail(exc, key, f"upload part {number} of") from exc
        token = _etag(response.get("ETag")) or ""
        if checksum:
            token = f"{token}|{checksum['ChecksumCRC32C']}"
        return PartInfo(number, token, size)

    def complete_multipart(
        self, key: str, upload_id: str, parts: Sequence[PartInfo], *, create_only: bool = False
    ) -> ObjectInfo:
        listed = []
        for part in parts:
            etag, _, crc = part.token.partition("|")
            entry = {"PartNumber": part.number, "ETag": f'"{etag}"'}
            if crc:
                entry["ChecksumCRC32C"] = crc
            listed.append(entry)
        kwargs: dict[str, Any] = {
            "Bucket": self.bucket,
            "Key": key,
            "UploadId": upload_id,
            "MultipartUpload": {"Parts": listed},
            **RequestOptions(if_none_match="*" if create_only else None).params("CompleteMultipartUpload"),
            **self._opts("CompleteMultipartUpload"),
        }
        try:
            response = self._client().complete_multipart_upload(**kwargs)
        except Exception as exc:
            raise self._fail(exc, key, "complete the upload of") from exc
        return ObjectInfo(key, sum(p.size for p in parts), _etag(response.get("ETag")), _server_time(response))

    def abort_multipart(self, key: str, upload_id: str) -> None:
        from botocore.exceptions import ClientError

        try:
            self._client().abort_multipart_upload(
                Bucket=self.bucket, Key=key, UploadId=upload_id, **self._opts("AbortMultipartUpload")
            )
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") == "NoSuchUpload":
                return
            raise self._fail(exc, key, "abort the upload of") from exc
        except Exception as exc:
            raise self._fail(exc, key, "abort the upload of") from exc
