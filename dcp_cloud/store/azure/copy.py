"""Copies on Azure Blob Storage: Copy Blob inside the service, or through this process where the copy must be
encrypted with an encryption scope or a customer-provided key.

Copy Blob (asynchronous, within the account) takes the copy's access tier and index tags, but neither an
encryption scope nor a customer-provided key; Copy Blob From URL takes a scope but no key, and needs the
source authorized by URL. So with either encryption option the bytes go through this process instead:
ranged Get Blob reads of the source (with the store's options: the source is a blob written with them),
staged as blocks of the copy and committed, every request carrying the options. Both run inside one
:meth:`AzureStore.copy` call; a failed copy through this process aborts its blocks, and the retry loop may
run the whole copy again (copies are idempotent).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

from ...errors import DcpCloudError, ObjectNotFoundError, StoreError, TransientStoreError
from ..protocol import ObjectInfo, PartInfo
from .config import MAX_BLOCKS
from .errors import AzureHTTPError, _url
from .objectopts import COPY_BLOB, GET_BLOB_PROPERTIES

#: Longest a server-side copy may stay pending before it is given up (seconds).
_COPY_WAIT = 600.0
#: Smallest block of a copy through this process (larger where the blob would need more than MAX_BLOCKS).
COPY_BLOCK = 8 * 1024 * 1024


class AzureStore(Protocol):
    """What a copy needs of :class:`~dcp_cloud.store.azure.store.AzureStore` (which calls it; no import back)."""

    bucket: str

    def _client(self) -> Any: ...

    def _options(self, op: str) -> dict[str, str]: ...

    def _fail(self, exc: BaseException, key: str | None, *, missing: str = "either") -> DcpCloudError: ...

    def _info(self, key: str, size: int, headers: Any) -> ObjectInfo: ...

    def url(self, key: str) -> str: ...

    def head(self, key: str) -> ObjectInfo: ...

    def read_into(self, key: str, start: int, outs: Sequence[memoryview]) -> None: ...

    def create_multipart(self, key: str) -> str: ...

    def put_part(self, key: str, upload_id: str, number: int, data: Any, *, crc32c: int | None = None) -> PartInfo: ...

    def complete_multipart(
        self, key: str, upload_id: str, parts: Sequence[PartInfo], *, create_only: bool = False
    ) -> ObjectInfo: ...

    def abort_multipart(self, key: str, upload_id: str) -> None: ...


def copy_blob(store: AzureStore, source_key: str, key: str, source_bucket: str | None = None) -> ObjectInfo:
    """Copy Blob of ``source_bucket/source_key`` (default: the store's container) to ``key`` (authorized by the
    store's credentials); a copy the service runs in the background is waited for."""
    client = store._client()
    source = client.blob_url(source_bucket or store.bucket, source_key)
    props = store._options(GET_BLOB_PROPERTIES)
    try:
        headers = {"x-ms-copy-source": source, **store._options(COPY_BLOB)}
        response = client.request("PUT", store.bucket, key, headers=headers, ok=(202, 201))
        status = response.headers.get("x-ms-copy-status")
        delay, deadline = 0.05, time.monotonic() + _COPY_WAIT
        while status == "pending":
            if time.monotonic() > deadline:
                raise TransientStoreError(f"the copy to {store.url(key)} is still pending after {_COPY_WAIT:g}s")
            time.sleep(delay)
            delay = min(1.0, delay * 2)
            status = client.request("HEAD", store.bucket, key, headers=props).headers.get("x-ms-copy-status")
        if status not in (None, "success"):
            raise StoreError(f"the service copy of {source_key!r} to {store.url(key)} ended {status!r}")
        head = client.request("HEAD", store.bucket, key, headers=props)
    except AzureHTTPError as exc:
        if exc.status == 404 and exc.code != "ContainerNotFound":
            raise ObjectNotFoundError(
                f"{_url('', source_bucket or store.bucket, source_key)} does not exist (copy source)"
            ) from exc
        raise store._fail(exc, key) from exc
    except DcpCloudError:
        raise
    except Exception as exc:
        raise store._fail(exc, key) from exc
    return store._info(key, int(head.headers.get("Content-Length") or 0), head.headers)


def copy_through(source: AzureStore, store: AzureStore, source_key: str, key: str) -> ObjectInfo:
    """Copy ``source_key`` of ``source`` to ``key`` of ``store`` through this process, block by block."""
    size = source.head(source_key).size
    block = max(COPY_BLOCK, -(-size // MAX_BLOCKS))
    upload_id = store.create_multipart(key)
    try:
        parts = []
        buffer = bytearray(min(block, size))
        for number, start in enumerate(range(0, size, block), 1):
            view = memoryview(buffer)[: min(block, size - start)]
            source.read_into(source_key, start, [view])
            parts.append(store.put_part(key, upload_id, number, view))
        return store.complete_multipart(key, upload_id, parts)
    except Exception:
        try:
            store.abort_multipart(key, upload_id)
        except DcpCloudError:
            pass  # the copy's error says more; Azure discards uncommitted blocks after seven days
        raise
