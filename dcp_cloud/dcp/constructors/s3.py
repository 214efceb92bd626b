"""S3Writer and S3Reader: the constructors for ``s3://`` (AWS S3 and S3-compatible stores)."""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any

from ...config import RetryConfig, TransferConfig
from ...errors import ConfigError
from ...locations import S3Backend, backend_of, config_with
from ...store.protocol import PartLimits
from ..device.stagingconfig import StagingConfig
from ..load.reader import CloudReader
from ..save.writer import CloudWriter

if TYPE_CHECKING:
    from ...store.s3.config import S3Config


def _s3_backend(
    endpoint_url: str | None, region: str | None, config: S3Config | None, limits: PartLimits | None
) -> S3Backend:
    config = config_with("s3", config, endpoint_url=endpoint_url, region=region)
    if limits is not None:
        from ...store.s3.config import S3Config

        config = config or S3Config()
        if config.part_limits is not None and config.part_limits != limits:
            raise ConfigError("pass part_limits either as a keyword or inside config=S3Config(...), not both")
        config = dataclasses.replace(config, part_limits=limits)
    return backend_of("s3", config)  # type: ignore[return-value]


class S3Writer(CloudWriter):
    """Save to ``s3://bucket/prefix``.

    Credentials, region and endpoint come from the standard AWS chain
    (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``,
    ``AWS_REGION``, ``AWS_ENDPOINT_URL[_S3]``, instance roles); ``endpoint_url``
    and ``region`` override them for S3-compatible stores (MinIO, Ceph, R2).

    ``compression="zstd"`` stores every item zstd-compressed (at
    ``compression_level``) exactly as torch's ``ZStandard`` extension does, so
    stock ``FileSystemReader`` loads a downloaded copy (with ``zstandard``
    installed); checksums cover the stored bytes. Compressed items are read
    whole: resharding loads cannot fetch byte ranges of them.

    ``base="s3://bucket/run/step-1000"`` makes the save incremental: items
    whose fqn, chunk, dtype and content hash (XXH3-128) equal an item of that
    committed checkpoint (same bucket) are not uploaded; the new checkpoint's
    records point at the base's bytes (``../step-1000/...``), and loading it
    needs only its own URI. Every save records each item's hash in its
    object's index footer (about 1-2% of a save's CPU), so any checkpoint
    saved with the defaults can be a base; ``hashes=False`` opts out, and
    items of a base saved so are uploaded, not compared (with one warning).
    See :mod:`dcp_cloud.dcp.save.incremental`.

    ``spread_prefixes=True`` puts each rank's object under a short hashed
    sub-prefix of the checkpoint (``step-100/7f/__3_<token>.distcp``), so S3
    can split a checkpoint's requests over 256 key prefixes (it scales about
    3,500 PUT and 5,500 GET per second per prefix). Turn it on when
    hundreds of ranks or more save or load one checkpoint at once; stock
    ``FileSystemReader`` still loads a downloaded copy.
    """

    def __init__(
        self,
        checkpoint_id: str | os.PathLike[str],
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        config: S3Config | None = None,
        transfer: TransferConfig | None = None,
        retry: RetryConfig | None = None,
        overwrite: bool = False,
        checksums: bool = True,
        part_limits: PartLimits | None = None,
        staging: StagingConfig | None = None,
        compression: str | None = None,
        compression_level: int = 3,
        base: str | os.PathLike[str] | None = None,
        hashes: bool = True,
        spread_prefixes: bool = False,
    ) -> None:
        super().__init__(
            checkpoint_id,
            _s3_backend(endpoint_url, region, config, part_limits),
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
        return str(checkpoint_id).startswith("s3://")


class S3Reader(CloudReader):
    """Load from ``s3://bucket/prefix`` (same configuration as :class:`S3Writer`).

    ``.metadata`` is fetched when the reader is built, for its first load
    (a load with ``checkpoint_id=`` fetches it anew, and so does every
    later load with the same reader: a checkpoint saved again at the URI
    is read as committed then). In a process group, the group's rank 0
    fetches it and broadcasts it (one GET per load job instead of one per
    rank). Pass
    ``process_group=`` when ``dcp.load`` runs in a group other than the
    default one, and ``share_metadata=False`` when only some ranks of the
    group load (``dcp.load(..., no_dist=True)`` on a subset).

    Stored items that several ranks want (DDP replicas, HSDP replica
    groups) are fetched once per load job, by one of those ranks, and sent
    to the others over the process group (``share_reads=False``: every rank
    reads everything it wants itself, as stock readers do).
    """

    def __init__(
        self,
        checkpoint_id: str | os.PathLike[str],
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        config: S3Config | None = None,
        transfer: TransferConfig | None = None,
        retry: RetryConfig | None = None,
        process_group: Any = None,
        share_metadata: bool = True,
        share_reads: bool = True,
        staging: StagingConfig | None = None,
    ) -> None:
        super().__init__(
            checkpoint_id,
            _s3_backend(endpoint_url, region, config, None),
            transfer=transfer,
            retry=retry,
            process_group=process_group,
            share_metadata=share_metadata,
            share_reads=share_reads,
            staging=staging,
        )

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return str(checkpoint_id).startswith("s3://")
