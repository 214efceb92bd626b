"""The writer or reader of any checkpoint URI: :func:`writer_for` and :func:`reader_for` pick the class of the
URI's cloud (S3, GCS, Azure, a local directory) and give it the cloud's options object."""

from __future__ import annotations

import os
from typing import Any

from ..config import RetryConfig, TransferConfig
from ..locations import StoreConfig, backend_of, scheme_of
from .constructors.azure import AzureReader, AzureWriter
from .constructors.gcs import GCSReader, GCSWriter
from .constructors.local import LocalReader, LocalWriter
from .constructors.s3 import S3Reader, S3Writer
from .device.stagingconfig import StagingConfig
from .load.reader import CloudReader
from .save.writer import CloudWriter


def _store_options(uri: str | os.PathLike[str], config: StoreConfig | None, credentials: Any) -> dict[str, Any]:
    """The constructor keywords of ``uri``'s class for ``config`` and ``credentials``, checked here."""
    scheme = scheme_of(uri)
    backend_of(scheme, config, credentials=credentials)  # ConfigError for options of another cloud
    options: dict[str, Any] = {} if scheme == "file" else {"config": config}
    if credentials is not None:
        options["credentials" if scheme == "gs" else "credential"] = credentials
    return options


_WRITERS: dict[str, type[CloudWriter]] = {"s3": S3Writer, "gs": GCSWriter, "az": AzureWriter, "file": LocalWriter}
_READERS: dict[str, type[CloudReader]] = {"s3": S3Reader, "gs": GCSReader, "az": AzureReader, "file": LocalReader}


def writer_for(
    uri: str | os.PathLike[str],
    config: StoreConfig | None = None,
    *,
    credentials: Any = None,
    transfer: TransferConfig | None = None,
    retry: RetryConfig | None = None,
    overwrite: bool = False,
    checksums: bool = True,
    staging: StagingConfig | None = None,
    compression: str | None = None,
    compression_level: int = 3,
    base: str | os.PathLike[str] | None = None,
    hashes: bool = True,
    spread_prefixes: bool = False,
) -> CloudWriter:
    """The writer of ``uri``: an :class:`~dcp_cloud.S3Writer` for ``s3://``, a :class:`~dcp_cloud.GCSWriter`
    for ``gs://``, an :class:`~dcp_cloud.AzureWriter` for ``az://`` or an Azure blob URL, a
    :class:`~dcp_cloud.LocalWriter` for ``file://`` or a plain path.

    ``config`` is that cloud's options (``S3Config``, ``GCSConfig``, ``AzureConfig``; ConfigError for
    another cloud's), ``credentials`` an explicit GCS or Azure credentials object (never pickled); the other
    keywords are the writers' own (see :class:`~dcp_cloud.S3Writer`).
    """
    options = _store_options(uri, config, credentials)
    return _WRITERS[scheme_of(uri)](
        uri,
        **options,
        transfer=transfer,
        retry=retry,
        overwrite=overwrite,
        checksums=checksums,
        staging=staging,
        compression=compression,
        compression_level=compression_level,
        base=base,
        hashes=hashes,
        spread_prefixes=spread_prefixes,
    )


def reader_for(
    uri: str | os.PathLike[str],
    config: StoreConfig | None = None,
    *,
    credentials: Any = None,
    transfer: TransferConfig | None = None,
    retry: RetryConfig | None = None,
    process_group: Any = None,
    share_metadata: bool = True,
    share_reads: bool = True,
    staging: StagingConfig | None = None,
) -> CloudReader:
    """The reader of ``uri`` (the class of its cloud, as for :func:`writer_for`); the keywords after
    ``credentials`` are the readers' own (see :class:`~dcp_cloud.S3Reader`)."""
    options = _store_options(uri, config, credentials)
    return _READERS[scheme_of(uri)](
        uri,
        **options,
        transfer=transfer,
        retry=retry,
        process_group=process_group,
        share_metadata=share_metadata,
        share_reads=share_reads,
        staging=staging,
    )
