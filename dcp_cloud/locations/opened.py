"""A location opened: its store (behind the one retry loop), the transfer and retry settings it was opened
with, and the backend it came from. What the maintenance functions, the run layer and safetensors export
work on."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ..config import RetryConfig, TransferConfig
from ..errors import ConfigError
from ..store.protocol import ObjectStore
from ..store.retry import RetryingStore
from ..uri import CheckpointURI, parse_uri
from .backends import Backend
from .locate import StoreConfig, locate, parse_root


@dataclass
class OpenedLocation:
    scheme: str
    bucket: str
    #: Key prefix without trailing slash ("" for a whole bucket).
    prefix: str
    store: RetryingStore
    raw: ObjectStore
    transfer: TransferConfig
    retry: RetryConfig
    #: Whether :func:`open_location` opened the store (and so :meth:`close` closes it).
    owned: bool
    #: The recipe the store was opened with (None for an explicit store=): equal backends reach the same
    #: service with the same credentials, so objects can be copied between them server-side.
    backend: Backend | None = None

    def close(self) -> None:
        if self.owned:
            self.raw.close()

    def list_prefix(self) -> str:
        return f"{self.prefix}/" if self.prefix else ""

    def url(self, key: str) -> str:
        return self.raw.url(key)

    def checkpoint_uri(self, prefix: str) -> str:
        return str(CheckpointURI(self.scheme, self.bucket, prefix))


def open_location(
    uri: str | os.PathLike[str],
    config: StoreConfig | None = None,
    *,
    credentials: Any = None,
    transfer: TransferConfig | None = None,
    retry: RetryConfig | None = None,
    whole_bucket: bool = False,
    store: ObjectStore | None = None,
) -> OpenedLocation:
    """Open the store of ``uri`` with its cloud's ``config`` and ``credentials`` (see
    :func:`~dcp_cloud.locations.locate`), or wrap an explicit ``store`` bound to the URI's bucket (which
    takes no options). The caller closes it."""
    transfer = transfer or TransferConfig()
    retry = retry or RetryConfig()
    if store is not None:
        if config is not None or credentials is not None:
            raise ConfigError("store options (config=, credentials=) cannot be combined with an explicit store=")
        schemes = (store.scheme,)
        parsed = parse_root(uri, schemes) if whole_bucket else parse_uri(uri, schemes)
        if parsed.bucket != store.bucket:
            raise ConfigError(f"{str(uri)!r} names bucket {parsed.bucket!r} but store= is bound to {store.bucket!r}")
        return OpenedLocation(
            parsed.scheme, parsed.bucket, parsed.prefix, RetryingStore(store, retry), store, transfer, retry, False
        )
    where = locate(uri, config, credentials=credentials, whole_bucket=whole_bucket)
    raw = where.backend.open_store(where.uri.bucket, transfer, retry)
    return OpenedLocation(
        where.scheme,
        where.uri.bucket,
        where.uri.prefix,
        RetryingStore(raw, retry),
        raw,
        transfer,
        retry,
        True,
        where.backend,
    )
