"""The GCS store's own uploads: one JSON-API POST whose body is the caller's buffers themselves (never copied).

``uploadType=media`` where the object needs no resource fields of ours (the default), ``uploadType=multipart``
where it does (a storage class: :func:`~dcp_cloud.store.gcs.objectopts.object_resource`): then the body is
the ``multipart/related`` framing around the same views, sent as a :class:`~dcp_cloud.store.payload.ScatterReader`,
so it is not copied either. Query parameters and headers of the bucket's options come from
:mod:`dcp_cloud.store.gcs.objectopts`. Errors are raised untranslated (the store translates them).
"""

from __future__ import annotations

import json
import secrets
import urllib.parse
from typing import Any, Protocol

from ..payload import ScatterReader
from .objectopts import GCSObjectOptions, object_resource, request_headers, request_params


class GCSStore(Protocol):
    """What an upload needs of :class:`~dcp_cloud.store.gcs.store.GCSStore` (which calls it; no import back)."""

    bucket: str
    request_timeout: float

    def _client_(self) -> Any: ...


def upload_views(
    store: GCSStore,
    options: GCSObjectOptions | None,
    name: str,
    views: list[memoryview],
    *,
    create_only: bool,
    checksum_b64: str | None,
    api_base: str,
) -> dict[str, Any]:
    """POST ``views`` as object ``name``; the object resource the server answers with."""
    from google.api_core import exceptions as api_exceptions

    client = store._client_()
    resource = object_resource(options)
    params = [("uploadType", "multipart" if resource else "media")]
    if not resource:
        params.append(("name", name))
    if create_only:
        params.append(("ifGenerationMatch", "0"))
    params.extend(request_params(options, "upload"))
    query = urllib.parse.urlencode(params, quote_via=urllib.parse.quote)
    url = f"{api_base}/upload/storage/v1/b/{urllib.parse.quote(store.bucket, safe='')}/o?{query}"
    headers = {
        **getattr(client, "_extra_headers", {}),
        "Content-Type": "application/octet-stream",
        "User-Agent": client._connection.user_agent,
        **request_headers(options, "upload"),
    }
    if checksum_b64 is not None:
        headers["x-goog-hash"] = f"crc32c={checksum_b64}"  # the server rejects a mismatch (HTTP 400)
    # requests / urllib3 / http.client hand a bytes-like body to the socket
    # as is (Content-Length from len()); a body in pieces goes as a
    # ScatterReader (Content-Length from its len(), pieces sent as views);
    # an empty body must be b"" (an empty memoryview would be sent chunked).
    body: Any
    if resource:
        metadata: dict[str, Any] = {"name": name, "contentType": "application/octet-stream", **resource}
        if checksum_b64 is not None:
            metadata["crc32c"] = checksum_b64
        boundary = f"dcp-cloud-{secrets.token_hex(16)}"
        head = (
            f"--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n{json.dumps(metadata)}\r\n"
            f"--{boundary}\r\nContent-Type: application/octet-stream\r\n\r\n"
        ).encode()
        tail = f"\r\n--{boundary}--\r\n".encode()
        body = ScatterReader([memoryview(head), *views, memoryview(tail)])
        headers["Content-Type"] = f'multipart/related; boundary="{boundary}"'
    else:
        body = b"" if not views else views[0] if len(views) == 1 else ScatterReader(views)
    response = client._http.request("POST", url, data=body, headers=headers, timeout=store.request_timeout)
    if not 200 <= response.status_code < 300:
        raise api_exceptions.from_http_response(response)
    result: dict[str, Any] = response.json()
    return result
