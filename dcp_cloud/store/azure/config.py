"""AzureConfig: where and how to reach Azure Blob Storage (no secrets), and Azure's naming and size rules."""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from ...errors import ConfigError
from .objectopts import AzureObjectOptions

MiB = 1024 * 1024

#: Largest block of a block blob (Put Block, service version 2019-12-12 and later).
MAX_BLOCK_SIZE = 4000 * MiB
#: Most committed blocks of one block blob.
MAX_BLOCKS = 50_000
#: Largest blob written by one Put Blob request (service version 2019-12-12 and later).
MAX_PUT_BLOB_SIZE = 5000 * MiB

_ACCOUNT_RE = re.compile(r"^[a-z0-9]{3,24}$")
#: Container names: 3-63 characters, lowercase letters, digits and single hyphens, starting and ending with a
#: letter or digit (``$root`` and ``$web`` are Azure's special containers).
_CONTAINER_RE = re.compile(r"^[a-z0-9](?!.*--)[a-z0-9-]{1,61}[a-z0-9]$")
_SPECIAL_CONTAINERS = ("$root", "$web")


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def container_problem(name: str) -> str | None:
    """Why Azure would refuse ``name`` as a container name, or None if it is valid."""
    if name in _SPECIAL_CONTAINERS:
        return None
    if not isinstance(name, str) or not name:
        return "it is empty"
    if not 3 <= len(name) <= 63:
        return f"it has {len(name)} characters (Azure takes 3-63)"
    if name != name.lower():
        return "it has uppercase letters (Azure takes lowercase letters, digits and '-')"
    if not _CONTAINER_RE.match(name):
        return "Azure takes lowercase letters, digits and single '-' only, starting and ending with a letter or digit"
    return None


def check_container(name: str) -> None:
    """Raise ConfigError, saying what to change, unless Azure accepts ``name`` as a container name."""
    problem = container_problem(name)
    if problem is not None:
        raise ConfigError(f"{name!r} is not a valid Azure container name: {problem}; e.g. 'checkpoints' or 'run-7'")


@dataclass(frozen=True)
class AzureConfig:
    """How to reach Azure Blob Storage. Everything here is picklable and free of credentials.

    Credentials are never part of the config: they come from the environment in
    each process that uses the store (see :mod:`dcp_cloud.store.azure`), or from
    an in-process ``credential=`` object. The one secret it may hold is a
    customer-provided encryption key in :attr:`object_options` (never shown).
    """

    #: Storage account name (3-24 lowercase letters and digits). ``None``: ``AZURE_STORAGE_ACCOUNT``, the
    #: connection string's ``AccountName``, or the account in :attr:`endpoint`.
    account: str | None = None
    #: Blob service endpoint, e.g. ``"https://myaccount.blob.core.windows.net"``, a private endpoint, or an
    #: emulator's ``"http://127.0.0.1:10000/devstoreaccount1"`` (path-style: the account is the first path
    #: segment). ``None``: the connection string's ``BlobEndpoint``, else
    #: ``https://<account>.blob.core.windows.net``.
    endpoint: str | None = None
    #: Send an MD5 of every uploaded body (Put Blob, Put Block: ``Content-MD5``), so the service refuses
    #: bytes damaged between this process and its disks. ``None`` (default): on ``http://`` endpoints only,
    #: where nothing else checks the bytes in flight; over ``https://`` TLS authenticates every record, and
    #: the CRC32C that every save records per item catches damage at rest on load and ``verify``. MD5 costs
    #: about 1.7 s of CPU per GiB uploaded.
    transport_checksums: bool | None = None
    #: Encryption scope or customer-provided key, access tier and index tags of every blob and request: see
    #: :class:`~dcp_cloud.store.azure.objectopts.AzureObjectOptions`. ``None``: the container's defaults.
    object_options: AzureObjectOptions | None = None

    def __post_init__(self) -> None:
        if self.account is not None:
            _require(
                isinstance(self.account, str) and bool(_ACCOUNT_RE.match(self.account)),
                f"AzureConfig.account must be a storage account name (3-24 lowercase letters and digits), "
                f"got {self.account!r}",
            )
        if self.endpoint is not None:
            _require(
                isinstance(self.endpoint, str) and bool(self.endpoint),
                f"AzureConfig.endpoint must be a non-empty string, got {self.endpoint!r}",
            )
            parts = urlsplit(self.endpoint)
            _require(
                parts.scheme in ("http", "https") and bool(parts.hostname),
                "AzureConfig.endpoint must look like https://<account>.blob.core.windows.net "
                "(or http://host:port/<account> for an emulator)",
            )
            # Never echo it here: a pasted SAS URL carries a secret in its query.
            _require(
                not parts.query and not parts.fragment and parts.username is None and parts.password is None,
                "AzureConfig.endpoint must not carry a query (a SAS token), a fragment or user:password@; "
                "put a SAS token in AZURE_STORAGE_SAS_TOKEN",
            )
            object.__setattr__(self, "endpoint", self.endpoint.rstrip("/"))
        _require(
            self.transport_checksums is None or isinstance(self.transport_checksums, bool),
            f"AzureConfig.transport_checksums must be True, False or None, got {self.transport_checksums!r}",
        )
        _require(
            self.object_options is None or isinstance(self.object_options, AzureObjectOptions),
            "AzureConfig.object_options must be an AzureObjectOptions or None, "
            f"got {type(self.object_options).__name__}",
        )
        if self.object_options is not None:
            self.object_options.check_endpoint(self.endpoint)
