"""LocalWriter and LocalReader: the constructors for ``file://`` and plain paths (a local directory)."""

from __future__ import annotations

import os
from typing import Any

from ...config import RetryConfig, TransferConfig
from ...locations import LocalBackend
from ..device.stagingconfig import StagingConfig
from ..load.reader import CloudReader
from ..save.writer import CloudWriter


class LocalWriter(CloudWriter):
    """Save to a directory (``file:///dir``, or a plain path as stock FileSystemWriter takes) through the engine.

    ``base=`` (a committed checkpoint directory beside this one, in the same parent) saves incrementally and
    ``hashes=False`` opts out of recording content hashes, as for :class:`~dcp_cloud.S3Writer`.
    """

    def __init__(
        self,
        checkpoint_id: str | os.PathLike[str],
        *,
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
            LocalBackend(),
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


class LocalReader(CloudReader):
    """Load from a directory (``file:///dir`` or a plain path) through the same engine."""

    def __init__(
        self,
        checkpoint_id: str | os.PathLike[str],
        *,
        transfer: TransferConfig | None = None,
        retry: RetryConfig | None = None,
        process_group: Any = None,
        share_metadata: bool = True,
        share_reads: bool = True,
        staging: StagingConfig | None = None,
    ) -> None:
        super().__init__(
            checkpoint_id,
            LocalBackend(),
            transfer=transfer,
            retry=retry,
            process_group=process_group,
            share_metadata=share_metadata,
            share_reads=share_reads,
            staging=staging,
        )
