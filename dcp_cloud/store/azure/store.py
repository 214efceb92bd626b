"""AzureStore: one Azure Blob Storage container behind the object-store protocol (see the package docstring)."""

from __future__ import annotations

import base64
import concurrent.futures
import email.utils
import hashlib
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from ...errors import (
    ConfigError,
    CorruptCheckpointError,
    DcpCloudError,
    StoreError,
    TransientStoreError,
)
from ..clients import shared_client
from ..payload import Payload, payload_size, payload_views
from ..payload import out_view as _out_view
from ..protocol import ObjectInfo, PartLimits, StoreCapabilities
from ..rawbody import read_ranged_body
from .auth import resolve
from .blocks import _BlockUploads
from .client import AzureBlobClient, parse_xml
from .config import MAX_BLOCK_SIZE, MAX_BLOCKS, MAX_PUT_BLOB_SIZE, AzureConfig, _require, check_container
from .copy import copy_blob, copy_through
from .errors import AzureHTTPError, _translate, _url
from .objectopts import GET_BLOB, GET_BLOB_PROPERTIES, PUT_BLOB, option_headers

_T = TypeVar("_T")
_R = TypeVar("_R")

#: Azure's block blob rules: blocks of 1 byte to 4000 MiB, at most 50,000 of them.
AZURE_PART_LIMITS = PartLimits(min_part_size=1, max_part_size=MAX_BLOCK_SIZE, max_parts=MAX_BLOCKS)
#: Names asked for per List Blobs page (Azure's maximum).
_LIST_PAGE = 5000


def _epoch(headers_value: str | None) -> float | None:
    if not headers_value:
        return None
    try:
        return email.utils.parsedate_to_datetime(headers_value).timestamp()
    except (TypeError, ValueError):
        return None


def _etag(value: str | None) -> str | None:
    return value.strip('"') if value else None


class AzureStore(_BlockUploads):
    """One Azure Blob Storage container. Thread-safe, picklable (the client is rebuilt per process).

    ``credential`` (in-process only, never pickled) overrides the environment's credentials; see
    :mod:`dcp_cloud.store.azure`. ``request_timeout`` bounds connecting and each socket read (seconds);
    ``max_connections`` sizes the connection pool.
    """

    scheme = "az"
    #: A committed block list discards the blob's other uncommitted blocks: nothing to sweep after it.
    capabilities = StoreCapabilities(sweeps_after_complete=False)
    #: Reads wait on round trips: a load's concurrency stands.
    read_workers: int | None = None

    def __init__(
        self,
        container: str,
        config: AzureConfig = AzureConfig(),  # noqa: B008 - a frozen dataclass
        *,
        credential: Any = None,
        request_timeout: float = 60.0,
        max_connections: int = 16,
    ) -> None:
        _require(isinstance(container, str), f"container must be a string, got {type(container).__name__}")
        check_container(container)
        _require(isinstance(config, AzureConfig), f"config must be an AzureConfig, got {type(config).__name__}")
        _require(request_timeout > 0, f"request_timeout must be positive, got {request_timeout}")
        _require(
            isinstance(max_connections, int) and max_connections >= 1,
            f"max_connections must be an int >= 1, got {max_connections!r}",
        )
        self.bucket = container
        self.config = config
        self.request_timeout = float(request_timeout)
        self.max_connections = max_connections
        self.limits = AZURE_PART_LIMITS
        self._credential = credential
        self._init_client_state()

    # -- plumbing -------------------------------------------------------------

    def _init_client_state(self) -> None:
        self._lock = threading.Lock()
        self._lock_pid = os.getpid()
        self._client_obj: AzureBlobClient | None = None
        self._client_pid: int | None = None

    def __getstate__(self) -> dict[str, Any]:
        if self._credential is not None:
            raise ConfigError(
                f"AzureStore for az://{self.bucket} holds an explicit credential object, which is not pickled "
                "(it may hold a key or token). For process-based async_save put the credentials in the "
                "environment (AZURE_STORAGE_CONNECTION_STRING, AZURE_STORAGE_KEY, AZURE_STORAGE_SAS_TOKEN) or "
                "use DefaultAzureCredential (the default)"
            )
        return {
            "bucket": self.bucket,
            "config": self.config,
            "request_timeout": self.request_timeout,
            "max_connections": self.max_connections,
            "limits": self.limits,
            "_credential": None,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_client_state()

    def __repr__(self) -> str:
        parts = [repr(self.bucket)]
        if self.config.account:
            parts.append(f"account={self.config.account!r}")
        if self.config.endpoint:
            parts.append(f"endpoint={self.config.endpoint!r}")
        if self._credential is not None:
            parts.append("credential=<explicit>")
        return f"AzureStore({', '.join(parts)})"

    def _sibling(self, container: str) -> AzureStore:
        """A store of another container with this one's config and credential (it shares the client)."""
        return AzureStore(
            container,
            self.config,
            credential=self._credential,
            request_timeout=self.request_timeout,
            max_connections=self.max_connections,
        )

    def url(self, key: str) -> str:
        return _url("", self.bucket, key)

    def _make_client(self) -> AzureBlobClient:
        resolved = resolve(self.config, self._credential)
        if self.config.object_options is not None:  # the endpoint may have come from the environment
            self.config.object_options.check_endpoint(resolved.endpoint)
        return AzureBlobClient(resolved, timeout=self.request_timeout, max_connections=self.max_connections)

    def _client(self) -> AzureBlobClient:
        pid = os.getpid()
        client = self._client_obj
        if client is not None and self._client_pid == pid:
            return client
        if self._lock_pid != pid:  # forked: the parent's lock may have been held at the fork
            self._lock = threading.Lock()
            self._lock_pid = pid
        with self._lock:
            if self._client_obj is None or self._client_pid != pid:
                key = ("azure", self.config, self.request_timeout, self.max_connections, id(self._credential))
                self._client_obj = shared_client(key, self._make_client)
                self._client_pid = pid
            return self._client_obj

    def close(self) -> None:
        """Let go of the client; it is shared with the process's other stores (``dcp_cloud.close_clients()``
        closes them)."""
        with self._lock:
            self._client_obj, self._client_pid = None, None

    def warm(self, connections: int) -> None:
        """Open up to ``connections`` connections in the background, ready for a load's or save's first
        parallel requests."""
        try:
            client = self._client()
        except DcpCloudError:
            return  # the first request reports it
        client.warm(min(connections, self.max_connections))

    def trusts_create_only(self) -> bool:
        """Not probed: Azure Blob Storage evaluates ``If-None-Match: *`` itself."""
        return True

    def _account(self) -> str:
        client = self._client_obj
        return client.account if client is not None else (self.config.account or "")

    def _fail(self, exc: BaseException, key: str | None, *, missing: str = "either") -> DcpCloudError:
        return _translate(exc, self._account(), self.bucket, key, missing=missing)

    def _check_key(self, key: str) -> None:
        if not isinstance(key, str) or not key:
            raise StoreError(f"blob names must be non-empty strings, got {key!r}")
        if len(key) > 1024:
            raise StoreError(f"blob name {key[:60]!r}... has {len(key)} characters; Azure takes at most 1024")

    def _options(self, op: str) -> dict[str, str]:
        """The headers of ``AzureConfig.object_options`` that the request ``op`` takes (see objectopts)."""
        return option_headers(self.config.object_options, op)

    def _md5s(self) -> bool:
        """Whether uploads carry Content-MD5 (see AzureConfig.transport_checksums)."""
        wanted = self.config.transport_checksums
        return not self._client().tls if wanted is None else wanted

    def _md5_header(self, views: Sequence[memoryview]) -> dict[str, str]:
        if not self._md5s():
            return {}
        digest = hashlib.md5(usedforsecurity=False)
        for view in views:
            digest.update(view)
        return {"Content-MD5": base64.b64encode(digest.digest()).decode("ascii")}

    def _info(self, key: str, size: int, headers: Mapping[str, str]) -> ObjectInfo:
        return ObjectInfo(key, size, _etag(headers.get("ETag")), _epoch(headers.get("Last-Modified")))

    def _parallel(self, fn: Callable[[_T], _R], items: Sequence[_T]) -> list[_R]:
        """``[fn(x) for x in items]`` on up to ``max_connections`` threads; all finish before any error is raised."""
        if len(items) <= 1 or self.max_connections == 1:
            return [fn(x) for x in items]
        with concurrent.futures.ThreadPoolExecutor(min(self.max_connections, len(items))) as pool:
            futures = [pool.submit(fn, x) for x in items]
            concurrent.futures.wait(futures)
        return [f.result() for f in futures]

    # -- objects ------------------------------------------------------------------

    def check_bucket(self) -> None:
        try:
            self._client().request("GET", self.bucket, query={"restype": "container"})
        except Exception as exc:
            raise self._fail(exc, None, missing="bucket") from exc

    def put(self, key: str, data: Payload, *, create_only: bool = False, crc32c: int | None = None) -> ObjectInfo:
        self._check_key(key)
        views = payload_views(data)
        size = payload_size(views)
        if size > MAX_PUT_BLOB_SIZE:
            raise StoreError(
                f"{self.url(key)}: one Put Blob takes at most {MAX_PUT_BLOB_SIZE} bytes (5000 MiB), got {size}; "
                "larger blobs are uploaded in blocks (lower TransferConfig.part_size)"
            )
        headers = {"x-ms-blob-type": "BlockBlob", "Content-Type": "application/octet-stream", **self._md5_header(views)}
        headers.update(self._options(PUT_BLOB))
        if create_only:
            headers["If-None-Match"] = "*"
        try:
            response = self._client().request("PUT", self.bucket, key, headers=headers, body=views or [b""], ok=(201,))
        except Exception as exc:
            raise self._fail(exc, key, missing="bucket") from exc
        return self._info(key, size, response.headers)

    def read_into(self, key: str, start: int, outs: Sequence[memoryview]) -> None:
        views = [_out_view(o) for o in outs]
        total = sum(len(v) for v in views)
        if total == 0:
            return
        if start < 0:
            raise CorruptCheckpointError(f"{self.url(key)}: negative read offset {start}")
        try:
            response = self._client().request(
                "GET",
                self.bucket,
                key,
                headers={"x-ms-range": f"bytes={start}-{start + total - 1}", **self._options(GET_BLOB)},
                stream=True,
            )
        except Exception as exc:
            raise self._fail(exc, key) from exc
        try:
            length = response.headers.get("Content-Length")
            read_ranged_body(
                response,
                views,
                url=self.url(key),
                service="Azure",
                status=response.status,
                length=int(length) if length is not None else None,
                content_range=response.headers.get("Content-Range"),
                start=start,
            )
        except DcpCloudError:
            raise
        except Exception as exc:
            raise self._fail(exc, key) from exc

    def get(self, key: str) -> bytes:
        try:
            response = self._client().request("GET", self.bucket, key, headers=self._options(GET_BLOB))
        except Exception as exc:
            raise self._fail(exc, key) from exc
        data = response.data
        length = response.headers.get("Content-Length")
        if length is not None and int(length) != len(data):
            raise TransientStoreError(f"the body of {self.url(key)} ended early ({len(data)} of {length} bytes); retry")
        md5 = response.headers.get("Content-MD5")
        if md5 and self._md5s() and base64.b64encode(hashlib.md5(data, usedforsecurity=False).digest()).decode() != md5:
            raise TransientStoreError(f"bytes of {self.url(key)} were damaged in transit (MD5 mismatch); retry")
        return bytes(data)

    def head(self, key: str) -> ObjectInfo:
        try:
            response = self._client().request("HEAD", self.bucket, key, headers=self._options(GET_BLOB_PROPERTIES))
        except Exception as exc:
            raise self._fail(exc, key) from exc
        return self._info(key, int(response.headers.get("Content-Length") or 0), response.headers)

    def _list_page(self, prefix: str, marker: str | None, uncommitted: bool) -> tuple[list[Any], str | None]:
        query = {"restype": "container", "comp": "list", "maxresults": str(_LIST_PAGE)}
        if prefix:
            query["prefix"] = prefix
        if marker:
            query["marker"] = marker
        if uncommitted:
            query["include"] = "uncommittedblobs"
        response = self._client().request("GET", self.bucket, query=query)
        root = parse_xml(response.data, f"List Blobs of {self.url(prefix)}*")
        if root.tag != "EnumerationResults":
            from .errors import MalformedResponseError

            raise MalformedResponseError(f"a listing answered with <{root.tag}>")
        return list(root.iterfind("./Blobs/Blob")), (root.findtext("NextMarker") or None)

    def _iter_blobs(self, prefix: str, uncommitted: bool = False) -> Iterator[Any]:
        marker: str | None = None
        try:
            while True:
                blobs, marker = self._list_page(prefix, marker, uncommitted)
                yield from blobs
                if not marker:
                    return
        except DcpCloudError:
            raise
        except Exception as exc:
            raise self._fail(exc, prefix, missing="bucket") from exc

    def _list_names(self, prefix: str, uncommitted: bool = False) -> list[str]:
        return [blob.findtext("Name") or "" for blob in self._iter_blobs(prefix, uncommitted)]

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        for blob in self._iter_blobs(prefix):
            props = blob.find("Properties")
            get = props.findtext if props is not None else (lambda name: None)
            yield ObjectInfo(
                blob.findtext("Name") or "",
                int(get("Content-Length") or 0),
                _etag(get("Etag")),
                _epoch(get("Last-Modified")),
            )

    def _delete_one(self, key: str, if_match: str | None = None) -> None:
        headers = {"x-ms-delete-snapshots": "include"}
        if if_match:
            headers["If-Match"] = f'"{if_match}"'
        try:
            self._client().request("DELETE", self.bucket, key, headers=headers, ok=(202,))
        except AzureHTTPError as exc:
            if exc.status == 404 and exc.code != "ContainerNotFound":
                return
            if if_match and exc.status == 412:
                return  # replaced meanwhile: not ours to delete
            raise self._fail(exc, key) from exc
        except Exception as exc:
            raise self._fail(exc, key) from exc

    def delete(self, keys: Sequence[str]) -> None:
        # Individual DELETEs in parallel (Azurite does not implement the batch endpoint reliably).
        self._parallel(self._delete_one, list(dict.fromkeys(keys)))

    def copy(self, source_key: str, key: str, *, source_bucket: str | None = None) -> ObjectInfo:
        """Copy Blob inside the service, or through this process where ``object_options`` has an encryption
        scope or a customer-provided key, which Copy Blob does not take (see :mod:`.copy`)."""
        self._check_key(key)
        options = self.config.object_options
        if options is not None and not options.copies_in_service:
            bucket = source_bucket or self.bucket
            return copy_through(self if bucket == self.bucket else self._sibling(bucket), self, source_key, key)
        return copy_blob(self, source_key, key, source_bucket)
