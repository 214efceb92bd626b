"""GCSWriter and GCSReader: the constructors for ``gs://`` (Google Cloud Storage)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from ...config import RetryConfig, TransferConfig
from ...locations import backend_of, config_with
from ..device.stagingconfig import StagingConfig
from ..load.reader import CloudReader
from ..save.writer import CloudWriter

if TYPE_CHECKING:
    from ...store.gcs.config import GCSConfig


class GCSWriter(CloudWriter):
    """Save to ``gs://bucket/prefix``.

    Credentials and project come from Application Default Credentials and
    ``GOOGLE_CLOUD_PROJECT``; ``STORAGE_EMULATOR_HOST`` is honoured. ``project``,
    ``endpoint`` and ``credentials`` override them (an explicit credentials
    object is never pickled: use ``GCSConfig(credentials_file=...)`` with the
    process-based ``async_save``).

    ``base=`` saves incrementally and ``hashes=False`` opts out of recording content hashes, as for
    :class:`~dcp_cloud.S3Writer`.
    """

    def __init__(
        self,
        checkpoint_id: str | os.PathLike[str],
        *,
        project: str | None = None,
        endpoint: str | None = None,
        credentials: Any = None,
        config: GCSConfig | None = None,
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
    ) -> None:
        super().__init__(
            checkpoint_id,
            backend_of("gs", config_with("gs", config, project=project, endpoint=endpoint), credentials=credentials),
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

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return str(checkpoint_id).startswith("gs://")


class GCSReader(CloudReader):
    """Load from ``gs://bucket/prefix`` (same configuration as :class:`GCSWriter`)."""

    def __init__(
        self,
        checkpoint_id: str | os.PathLike[str],
        *,
        project: str | None = None,
        endpoint: str | None = None,
        credentials: Any = None,
        config: GCSConfig | None = None,
        transfer: TransferConfig | None = None,
        retry: RetryConfig | None = None,
        process_group: Any = None,
        share_metadata: bool = True,
        share_reads: bool = True,
        staging: StagingConfig | None = None,
    ) -> None:
        super().__init__(
            checkpoint_id,
            backend_of("gs", config_with("gs", config, project=project, endpoint=endpoint), credentials=credentials),
            transfer=transfer,
            retry=retry,
            process_group=process_group,
            share_metadata=share_metadata,
            share_reads=share_reads,
            staging=staging,
        )

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return str(checkpoint_id).startswith("gs://")
