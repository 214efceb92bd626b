"""The public writer/reader classes: thin constructors over CloudWriter / CloudReader."""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any

from ..config import RetryConfig, TransferConfig
from ..errors import ConfigError, InvalidURIError
from ..locations import Backend, LocalBackend, S3Backend, azure_endpoint, backend_of, config_with, scheme_of
from ..store.protocol import PartLimits
from .device.stagingconfig import StagingConfig
from .load.reader import CloudReader
from .save.writer import CloudWriter

if TYPE_CHECKING:
    from ..store.azure.config import AzureConfig
    from ..store.gcs.config import GCSConfig
    from ..store.s3.config import S3Config


def _s3_backend(
    endpoint_url: str | None, region: str | None, config: S3Config | None, limits: PartLimits | None
) -> S3Backend:
    config = config_with("s3", config, endpoint_url=endpoint_url, region=region)
    if limits is not None:
        from ..store.s3.config import S3Config

        config = config or S3Config()
        if config.part_limits is not None and config.part_limits != limits:
            raise ConfigError("pass part_limits either as a keyword or inside config=S3Config(...), not both")
        config = dataclasses.replace(config, part_limits=limits)
    return backend_of("s3", config)  # type: ignore[return-value]


def _azure_location(
    checkpoint_id: str | os.PathLike[str] | None,
    account: str | None,
    endpoint: str | None,
    credential: Any,
    config: AzureConfig | None,
) -> tuple[Any, Backend]:
    """(checkpoint id, backend): an Azure blob URL id becomes ``az://...`` and its account's endpoint goes
    into the config."""
    config = config_with("az", config, account=account, endpoint=endpoint)  # type: ignore[assignment]
    if checkpoint_id is not None:
        checkpoint_id, config = azure_endpoint(checkpoint_id, config)
    return checkpoint_id, backend_of("az", config, credentials=credential)


def _is_azure_id(checkpoint_id: str | os.PathLike[str]) -> bool:
    try:
        return scheme_of(checkpoint_id) == "az"
    except InvalidURIError:
        return True  # ours to refuse, with the reason


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


class GCSWriter(CloudWriter):
    """Save to ``gs://bucket/prefix``.

    Credentials and project come from Application Default Credentials and
    ``GOOGLE_CLOUD_PROJECT``; ``STORAGE_EMULATOR_HOST`` is honoured. ``project``,
    ``endpoint`` and ``credentials`` override them (an explicit credentials
    object is never pickled: use ``GCSConfig(credentials_file=...)`` with the
    process-based ``async_save``).

    ``base=`` saves incrementally and ``hashes=False`` opts out of recording content hashes, as for
    :class:`S3Writer`.
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


class AzureWriter(CloudWriter):
    """Save to ``az://container/prefix`` (or ``https://<account>.blob.core.windows.net/container/prefix``).

    Credentials come from the environment (``AZURE_STORAGE_CONNECTION_STRING``, ``AZURE_STORAGE_KEY`` with
    ``AZURE_STORAGE_ACCOUNT``, ``AZURE_STORAGE_SAS_TOKEN``), else azure-identity's ``DefaultAzureCredential``
    (managed identity, AKS workload identity, ``az login``). ``account`` and ``endpoint`` (an emulator, a
    private endpoint) override the environment's; an explicit ``credential`` (a SAS token, an
    ``AzureNamedKeyCredential``, ``AzureSasCredential`` or token credential) is never pickled: use the
    environment with the process-based ``async_save``. See :mod:`dcp_cloud.store.azure`.

    ``base=`` saves incrementally and ``hashes=False`` opts out of recording content hashes, as for
    :class:`S3Writer`.
    """

    def __init__(
        self,
        checkpoint_id: str | os.PathLike[str],
        *,
        account: str | None = None,
        endpoint: str | None = None,
        credential: Any = None,
        config: AzureConfig | None = None,
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
        checkpoint_id, backend = _azure_location(checkpoint_id, account, endpoint, credential, config)
        super().__init__(
            checkpoint_id,
            backend,
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
        return _is_azure_id(checkpoint_id)


class AzureReader(CloudReader):
    """Load from ``az://container/prefix`` or an Azure blob URL (same configuration as :class:`AzureWriter`)."""

    def __init__(
        self,
        checkpoint_id: str | os.PathLike[str],
        *,
        account: str | None = None,
        endpoint: str | None = None,
        credential: Any = None,
        config: AzureConfig | None = None,
        transfer: TransferConfig | None = None,
        retry: RetryConfig | None = None,
        process_group: Any = None,
        share_metadata: bool = True,
        share_reads: bool = True,
        staging: StagingConfig | None = None,
    ) -> None:
        checkpoint_id, backend = _azure_location(checkpoint_id, account, endpoint, credential, config)
        super().__init__(
            checkpoint_id,
            backend,
            transfer=transfer,
            retry=retry,
            process_group=process_group,
            share_metadata=share_metadata,
            share_reads=share_reads,
            staging=staging,
        )

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return _is_azure_id(checkpoint_id)


class LocalWriter(CloudWriter):
    """Save to a directory (``file:///dir``, or a plain path as stock FileSystemWriter takes) through the engine.

    ``base=`` (a committed checkpoint directory beside this one, in the same parent) saves incrementally and
    ``hashes=False`` opts out of recording content hashes, as for :class:`S3Writer`.
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
