"""Backends: picklable recipes that open an ObjectStore for a bucket in the current process, one per cloud
(S3, GCS, Azure) and one for local directories.

Writers, readers, the run layer and the maintenance functions carry a backend (configuration only); the
store and its SDK client are made lazily in whichever process uses them, which is what lets
``dcp.async_save`` pickle a writer into a worker process. :func:`dcp_cloud.locations.locate` is where a
URI and its options become one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ..config import RetryConfig, TransferConfig
from ..store.protocol import ObjectStore
from ..transfer.engine import READ_BURST

if TYPE_CHECKING:
    from ..store.azure.config import AzureConfig
    from ..store.gcs.config import GCSConfig
    from ..store.s3.config import S3Config


class Backend(Protocol):
    #: URI schemes this backend serves.
    schemes: tuple[str, ...]

    def open_store(self, bucket: str, transfer: TransferConfig, retry: RetryConfig) -> ObjectStore: ...


@dataclass(frozen=True)
class S3Backend:
    """Amazon S3 and S3-compatible stores (MinIO, Ceph, R2) through the lean client or botocore."""

    config: S3Config | None = None
    schemes: tuple[str, ...] = ("s3",)

    def open_store(self, bucket: str, transfer: TransferConfig, retry: RetryConfig) -> ObjectStore:
        from ..store.s3 import S3Config, S3Store

        return S3Store(
            bucket,
            self.config or S3Config(),
            request_timeout=retry.request_timeout,
            max_connections=transfer.concurrency * READ_BURST + 2,
            limits=self.config.part_limits if self.config is not None else None,
        )


@dataclass(frozen=True)
class GCSBackend:
    """Google Cloud Storage through google-cloud-storage."""

    config: GCSConfig | None = None
    #: An explicit google.auth credentials object: usable in-process only, never pickled.
    credentials: Any = field(default=None, repr=False, compare=False)
    schemes: tuple[str, ...] = ("gs",)

    def open_store(self, bucket: str, transfer: TransferConfig, retry: RetryConfig) -> ObjectStore:
        from ..store.gcs import GCSConfig, GCSStore

        return GCSStore(
            bucket,
            self.config or GCSConfig(),
            credentials=self.credentials,
            request_timeout=retry.request_timeout,
            max_connections=transfer.concurrency * READ_BURST + 2,
        )

    def __getstate__(self) -> dict[str, Any]:
        if self.credentials is not None:
            from ..errors import ConfigError

            raise ConfigError(
                "a GCS writer/reader built with an explicit credentials= object cannot be sent to another "
                "process (the object may hold a private key); use GCSConfig(credentials_file=...) or "
                "Application Default Credentials for process-based async_save"
            )
        return {"config": self.config, "credentials": None, "schemes": self.schemes}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            object.__setattr__(self, key, value)


@dataclass(frozen=True)
class AzureBackend:
    """Azure Blob Storage (block blobs) through dcp_cloud's own client."""

    config: AzureConfig | None = None
    #: An explicit credential object (key, SAS or token credential): usable in-process only, never pickled.
    credential: Any = field(default=None, repr=False, compare=False)
    schemes: tuple[str, ...] = ("az",)

    def open_store(self, bucket: str, transfer: TransferConfig, retry: RetryConfig) -> ObjectStore:
        from ..store.azure import AzureConfig, AzureStore

        return AzureStore(
            bucket,
            self.config or AzureConfig(),
            credential=self.credential,
            request_timeout=retry.request_timeout,
            max_connections=transfer.concurrency * READ_BURST + 2,
        )

    def __getstate__(self) -> dict[str, Any]:
        if self.credential is not None:
            from ..errors import ConfigError

            raise ConfigError(
                "an Azure writer/reader built with an explicit credential= object cannot be sent to another "
                "process (it may hold a key or token); put the credentials in the environment "
                "(AZURE_STORAGE_CONNECTION_STRING, AZURE_STORAGE_KEY, AZURE_STORAGE_SAS_TOKEN) or rely on "
                "DefaultAzureCredential for process-based async_save"
            )
        return {"config": self.config, "credential": None, "schemes": self.schemes}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            object.__setattr__(self, key, value)


@dataclass(frozen=True)
class LocalBackend:
    """A local or shared filesystem directory (``file://`` URIs)."""

    schemes: tuple[str, ...] = ("file",)

    def open_store(self, bucket: str, transfer: TransferConfig, retry: RetryConfig) -> ObjectStore:
        from ..store.local import LocalStore

        return LocalStore(bucket)
