"""AzureWriter and AzureReader: the constructors for ``az://`` and Azure blob URLs (Azure Blob Storage)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from ...config import RetryConfig, TransferConfig
from ...errors import InvalidURIError
from ...locations import Backend, azure_endpoint, backend_of, config_with, scheme_of
from ..device.stagingconfig import StagingConfig
from ..load.reader import CloudReader
from ..save.writer import CloudWriter

if TYPE_CHECKING:
    from ...store.azure.config import AzureConfig


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


class AzureWriter(CloudWriter):
    """Save to ``az://container/prefix`` (or ``https://<account>.blob.core.windows.net/container/prefix``).

    Credentials come from the environment (``AZURE_STORAGE_CONNECTION_STRING``, ``AZURE_STORAGE_KEY`` with
    ``AZURE_STORAGE_ACCOUNT``, ``AZURE_STORAGE_SAS_TOKEN``), else azure-identity's ``DefaultAzureCredential``
    (managed identity, AKS workload identity, ``az login``). ``account`` and ``endpoint`` (an emulator, a
    private endpoint) override the environment's; an explicit ``credential`` (a SAS token, an
    ``AzureNamedKeyCredential``, ``AzureSasCredential`` or token credential) is never pickled: use the
    environment with the process-based ``async_save``. See :mod:`dcp_cloud.store.azure`.

    ``base=`` saves incrementally and ``hashes=False`` opts out of recording content hashes, as for
    :class:`~dcp_cloud.S3Writer`.
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
