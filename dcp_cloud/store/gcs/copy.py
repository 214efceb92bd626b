"""Server-side copies on GCS: ``objects.rewrite``, repeated with its token until done.

GCS may answer a rewrite of a large object (or one that changes location or
storage class) in several round trips; each returns a token to continue
with. The bytes never leave the service.
"""

from __future__ import annotations

from typing import Any, Protocol

from ...errors import DcpCloudError
from ..protocol import ObjectInfo
from .compose import _epoch
from .objectopts import blob_kwargs


class GCSStore(Protocol):
    """What a rewrite needs of :class:`~dcp_cloud.store.gcs.store.GCSStore` (which calls it; no import back)."""

    bucket: str
    request_timeout: float
    config: Any  # GCSConfig (its object_options)

    def _check_key(self, key: str) -> None: ...

    def _client_(self) -> Any: ...

    def _blob(self, key: str) -> Any: ...

    def _error(self, exc: BaseException, key: str) -> DcpCloudError: ...


def rewrite_object(store: GCSStore, source_key: str, key: str, source_bucket: str | None = None) -> ObjectInfo:
    """Copy ``source_bucket/source_key`` (default: the store's bucket) to ``key`` of the store's bucket.

    The store's object options apply to both ends: the request is billed to its ``user_project``, the source
    is read with its customer key (``x-goog-copy-source-encryption-*``) and the copy is written with the key,
    ``destinationKmsKeyName`` and storage class (the library sends them from the two blobs' settings)."""
    store._check_key(key)
    client = store._client_()
    options = store.config.object_options
    # The rewrite's userProject, destination key and storage class come from the target (store._blob); of the
    # source the library sends only its key (x-goog-copy-source-encryption-*).
    source = client.bucket(source_bucket or store.bucket).blob(source_key, **blob_kwargs(options))
    target = store._blob(key)
    try:
        token, _, _ = target.rewrite(source, retry=None, timeout=store.request_timeout)
        while token is not None:
            token, _, _ = target.rewrite(source, token=token, retry=None, timeout=store.request_timeout)
    except Exception as exc:
        raise store._error(exc, source_key) from exc
    return ObjectInfo(key, int(target.size or 0), str(target.generation), _epoch(target.updated))
