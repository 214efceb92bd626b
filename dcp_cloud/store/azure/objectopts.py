"""AzureObjectOptions: how a production container wants its blobs written and read (encryption scope,
customer-provided key, access tier, index tags), and the one function that turns them into the headers of
each Blob service request the store makes (:func:`option_headers`).
"""

from __future__ import annotations

import base64
import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import quote

from ..optioncheck import check_customer_key, check_key_endpoint, check_tags, require

_TIERS = ("Hot", "Cool", "Cold", "Archive")
#: Encryption scope names: 3-63 letters and digits.
_SCOPE_RE = re.compile(r"^[A-Za-z0-9]{3,63}$")
#: What Azure allows in blob index tag keys and values: ASCII letters, digits, spaces and + - . / : = _
_TAG_RE = re.compile(r"^[A-Za-z0-9 +\-./:=_]*$")

#: The requests of the store (Blob service operation names).
PUT_BLOB = "PutBlob"
PUT_BLOCK = "PutBlock"
PUT_BLOCK_LIST = "PutBlockList"
GET_BLOB = "GetBlob"
GET_BLOB_PROPERTIES = "GetBlobProperties"
COPY_BLOB = "CopyBlob"

_WRITES = (PUT_BLOB, PUT_BLOCK, PUT_BLOCK_LIST)
_NEW_BLOB = (PUT_BLOB, PUT_BLOCK_LIST)
#: Per header, the operations that take it. Copy Blob (asynchronous, within the account) takes the tier and
#: the tags of the copy, but neither an encryption scope nor a customer-provided key: the store copies such
#: blobs through itself (see ``AzureStore.copy``).
OPERATIONS: Mapping[str, tuple[str, ...]] = {
    "x-ms-encryption-scope": _WRITES,
    "x-ms-encryption-key": (*_WRITES, GET_BLOB, GET_BLOB_PROPERTIES),
    "x-ms-encryption-key-sha256": (*_WRITES, GET_BLOB, GET_BLOB_PROPERTIES),
    "x-ms-encryption-algorithm": (*_WRITES, GET_BLOB, GET_BLOB_PROPERTIES),
    "x-ms-access-tier": (*_NEW_BLOB, COPY_BLOB),
    "x-ms-tags": (*_NEW_BLOB, COPY_BLOB),
}


@dataclass(frozen=True)
class AzureObjectOptions:
    """What every blob a store writes carries, and every request it makes. ``None``: the container's default.

    The store sends every option on every request that takes it: see :data:`OPERATIONS`.
    """

    #: Encryption scope of new blobs (``x-ms-encryption-scope`` on Put Blob, Put Block and Put Block List):
    #: a scope of the storage account, 3-63 letters and digits. ``None``: the container's default scope.
    #: Not together with ``customer_provided_key``.
    encryption_scope: str | None = None
    #: A 32-byte AES-256 key the service encrypts every blob with (sent with its SHA-256 on every write, read
    #: and Get Blob Properties). Azure keeps no copy: blobs written with it can be read only with it. Never
    #: shown in repr, logs or errors.
    customer_provided_key: bytes | None = field(default=None, repr=False)
    #: Allow ``customer_provided_key`` over plain ``http://`` (emulators only: the key would cross the
    #: network in the clear). Azure itself refuses customer-provided keys over http.
    allow_customer_provided_key_over_http: bool = False
    #: Access tier of new blobs (``x-ms-access-tier``): ``"Hot"``, ``"Cool"``, ``"Cold"`` or ``"Archive"``.
    #: An archived blob cannot be read until it is rehydrated: a checkpoint saved to ``"Archive"`` does not
    #: load. ``None``: the account's default tier.
    access_tier: Literal["Hot", "Cool", "Cold", "Archive"] | None = None
    #: Blob index tags of every new blob, ``{key: value}`` (at most 10; sent url-encoded in ``x-ms-tags``).
    tags: Mapping[str, str] | None = None

    def __post_init__(self) -> None:
        if self.encryption_scope is not None:
            require(
                isinstance(self.encryption_scope, str) and bool(_SCOPE_RE.match(self.encryption_scope)),
                f"encryption_scope must name an encryption scope of the account (3-63 letters and digits), "
                f"got {self.encryption_scope!r}",
            )
        if self.customer_provided_key is not None:
            # Never echo the key itself.
            check_customer_key(self.customer_provided_key, "customer_provided_key")
            require(
                self.encryption_scope is None,
                "customer_provided_key cannot be combined with encryption_scope: choose one",
            )
        require(
            isinstance(self.allow_customer_provided_key_over_http, bool),
            "allow_customer_provided_key_over_http must be a bool",
        )
        require(
            self.access_tier is None or self.access_tier in _TIERS,
            f"access_tier must be one of {_TIERS} or None (the names are case-sensitive), got {self.access_tier!r}",
        )
        if self.tags is not None:
            tags = check_tags(self.tags, "Azure", "blob", _TAG_RE, "ASCII letters, digits, spaces and + - . / : = _")
            object.__setattr__(self, "tags", tags)

    def __hash__(self) -> int:  # tags is a dict: hash what it holds (and never the key itself)
        return hash(
            (tuple(sorted((self.tags or {}).items())), self.encryption_scope, self.access_tier)
            + (self.customer_provided_key is not None, self.allow_customer_provided_key_over_http)
        )

    def check_endpoint(self, endpoint: str | None) -> None:
        """ConfigError where a customer-provided key would go over plain http without the explicit allowance."""
        if self.customer_provided_key is None or self.allow_customer_provided_key_over_http:
            return
        check_key_endpoint(
            endpoint, "customer_provided_key", "AzureObjectOptions(allow_customer_provided_key_over_http=True)"
        )

    @property
    def copies_in_service(self) -> bool:
        """Whether Copy Blob can give a copy these options (it takes no encryption scope nor key)."""
        return self.encryption_scope is None and self.customer_provided_key is None


def _all_headers(options: AzureObjectOptions) -> dict[str, str]:
    values: dict[str, str] = {}
    if options.encryption_scope is not None:
        values["x-ms-encryption-scope"] = options.encryption_scope
    key = options.customer_provided_key
    if key is not None:
        values["x-ms-encryption-key"] = base64.b64encode(key).decode("ascii")
        values["x-ms-encryption-key-sha256"] = base64.b64encode(hashlib.sha256(key).digest()).decode("ascii")
        values["x-ms-encryption-algorithm"] = "AES256"
    if options.access_tier is not None:
        values["x-ms-access-tier"] = options.access_tier
    if options.tags:
        values["x-ms-tags"] = "&".join(f"{quote(k, safe='')}={quote(v, safe='')}" for k, v in options.tags.items())
    return values


def option_headers(options: AzureObjectOptions | None, op: str) -> dict[str, str]:
    """The headers of ``options`` that the request ``op`` (one of the operation names above) takes; empty
    where none are set."""
    if options is None:
        return {}
    if op not in (*_WRITES, GET_BLOB, GET_BLOB_PROPERTIES, COPY_BLOB):
        raise ValueError(f"unknown Blob operation {op!r}")
    return {name: value for name, value in _all_headers(options).items() if op in OPERATIONS[name]}


__all__ = [
    "COPY_BLOB",
    "GET_BLOB",
    "GET_BLOB_PROPERTIES",
    "OPERATIONS",
    "PUT_BLOB",
    "PUT_BLOCK",
    "PUT_BLOCK_LIST",
    "AzureObjectOptions",
    "option_headers",
]
