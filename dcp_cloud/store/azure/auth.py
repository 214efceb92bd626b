"""Credentials of the Azure store: where they come from, and how a request carries them.

Resolution, in the order Azure's own tools use (first match wins):

1. an explicit ``credential=`` object of the store (in-process only, never pickled): a SAS token string,
   ``azure.core.credentials.AzureNamedKeyCredential`` / ``AzureSasCredential``, or any token credential
   (an object with ``get_token``);
2. ``AZURE_STORAGE_CONNECTION_STRING`` (``AccountName`` + ``AccountKey``, or ``SharedAccessSignature``;
   ``BlobEndpoint`` / ``EndpointSuffix`` give the endpoint; ``UseDevelopmentStorage=true`` is Azurite);
3. ``AZURE_STORAGE_KEY`` (Shared Key of the account);
4. ``AZURE_STORAGE_SAS_TOKEN`` (a SAS token, with or without its leading ``?``);
5. azure-identity's ``DefaultAzureCredential``: environment service principal, workload identity (AKS),
   managed identity, Azure CLI login... Tokens are cached and refreshed five minutes before they expire,
   so jobs that run for days keep working.

Shared Key requests are signed here (:func:`shared_key_signature`, checked against azure-storage-blob's
signer in the tests, and by Azurite, which verifies every signature). Keys, SAS tokens and bearer tokens
never appear in a ``repr``, a log line or an error message.
"""

from __future__ import annotations

import base64
import binascii
import datetime as _dt
import hashlib
import hmac
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from ...errors import ConfigError
from .config import AzureConfig

#: The OAuth scope of Azure Storage.
STORAGE_SCOPE = "https://storage.azure.com/.default"
#: A token is refreshed this many seconds before it expires (azure-core's bearer policy does the same).
REFRESH_MARGIN = 300.0
#: Azurite's well-known development account and key (public, from Azurite's documentation).
DEV_ACCOUNT = "devstoreaccount1"
DEV_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
_DEV_ENDPOINT = "http://127.0.0.1:10000/devstoreaccount1"


@dataclass(frozen=True)
class SharedKey:
    """An account name and its key (decoded)."""

    account: str
    key: bytes = field(repr=False)

    def __repr__(self) -> str:
        return f"SharedKey(account={self.account!r}, key=***)"


@dataclass(frozen=True)
class Sas:
    """A SAS token (the query string, without ``?``)."""

    token: str = field(repr=False)

    def __repr__(self) -> str:
        return "Sas(token=***)"


class Bearer:
    """A token credential with a cached token, refreshed :data:`REFRESH_MARGIN` seconds before it expires."""

    def __init__(self, credential: Any, clock: Any = time.time) -> None:
        self._credential = credential
        self._clock = clock
        self._lock = threading.Lock()
        self._token: str | None = None
        self._expires = 0.0

    def __repr__(self) -> str:
        return f"Bearer({type(self._credential).__name__})"

    def token(self) -> str:
        if self._token is not None and self._clock() < self._expires - REFRESH_MARGIN:
            return self._token
        with self._lock:
            if self._token is None or self._clock() >= self._expires - REFRESH_MARGIN:
                got = self._credential.get_token(STORAGE_SCOPE)
                self._token, self._expires = got.token, float(got.expires_on)
            return self._token


Auth = SharedKey | Sas | Bearer


@dataclass(frozen=True)
class Resolved:
    """Where requests go and what authorizes them."""

    #: Blob service endpoint without a trailing slash (``https://acct.blob.core.windows.net`` or
    #: ``http://127.0.0.1:10000/devstoreaccount1``).
    endpoint: str
    account: str
    auth: Auth = field(repr=False)


def _decode_key(account: str, text: str, where: str) -> SharedKey:
    try:
        key = base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise ConfigError(
            f"the account key in {where} is not valid base64: copy it again from the storage account's "
            "'Access keys' page (or `az storage account keys list`)"
        ) from None
    if not key:
        raise ConfigError(f"the account key in {where} is empty")
    return SharedKey(account, key)


def parse_connection_string(text: str) -> dict[str, str]:
    """The ``Name=value`` pairs of a connection string (names as written; values may contain ``=``)."""
    pairs: dict[str, str] = {}
    for part in text.split(";"):
        if not part.strip():
            continue
        name, sep, value = part.partition("=")
        if not sep or not name.strip():
            raise ConfigError(
                "AZURE_STORAGE_CONNECTION_STRING is malformed: expected 'Name=value;Name=value;...' "
                "(copy it from the storage account's 'Access keys' page)"
            )
        pairs[name.strip()] = value.strip()
    return pairs


def _from_connection_string(text: str) -> tuple[str | None, str | None, Auth | None]:
    """(endpoint or None, account or None, auth or None) from a connection string."""
    pairs = {k.lower(): v for k, v in parse_connection_string(text).items()}
    if pairs.get("usedevelopmentstorage", "").lower() == "true":
        endpoint = pairs.get("developmentstorageproxyuri")
        return (endpoint or _DEV_ENDPOINT), DEV_ACCOUNT, _decode_key(DEV_ACCOUNT, DEV_KEY, "Azurite's key")
    account = pairs.get("accountname")
    endpoint = pairs.get("blobendpoint")
    if endpoint is None and account:
        protocol = pairs.get("defaultendpointsprotocol", "https")
        endpoint = f"{protocol}://{account}.blob.{pairs.get('endpointsuffix', 'core.windows.net')}"
    auth: Auth | None = None
    if pairs.get("accountkey"):
        if not account:
            raise ConfigError("AZURE_STORAGE_CONNECTION_STRING has an AccountKey but no AccountName")
        auth = _decode_key(account, pairs["accountkey"], "AZURE_STORAGE_CONNECTION_STRING")
    elif pairs.get("sharedaccesssignature"):
        auth = Sas(pairs["sharedaccesssignature"].lstrip("?"))
    return (endpoint.rstrip("/") if endpoint else None), account, auth


def _account_of(endpoint: str) -> str | None:
    """The account an endpoint names: ``acct.blob.core.windows.net``, or the first path segment (emulator)."""
    parts = urlsplit(endpoint)
    segment = parts.path.strip("/").split("/", 1)[0]
    if segment:
        return segment
    host = parts.hostname or ""
    if ".blob." in host:
        return host.split(".", 1)[0]
    return None


def _explicit(credential: Any, account: str | None) -> Auth:
    if isinstance(credential, str):
        return Sas(credential.lstrip("?"))
    named = getattr(credential, "named_key", None)  # AzureNamedKeyCredential
    if named is not None:
        name, key = named
        return _decode_key(name, key, "the AzureNamedKeyCredential")
    signature = getattr(credential, "signature", None)  # AzureSasCredential
    if isinstance(signature, str):
        return Sas(signature.lstrip("?"))
    if callable(getattr(credential, "get_token", None)):
        return Bearer(credential)
    raise ConfigError(
        f"credential= must be a SAS token string, an AzureNamedKeyCredential, an AzureSasCredential or a token "
        f"credential (e.g. azure.identity.DefaultAzureCredential()), got {type(credential).__name__}"
    )


def _default_credential() -> Bearer:
    try:
        from azure.identity import DefaultAzureCredential
    except ImportError:
        raise ConfigError(
            "no Azure credentials in the environment (AZURE_STORAGE_CONNECTION_STRING, AZURE_STORAGE_KEY, "
            "AZURE_STORAGE_SAS_TOKEN), and azure-identity, which would find a managed or workload identity or "
            "an `az login`, is not installed: pip install 'dcp_cloud[azure]'"
        ) from None
    return Bearer(DefaultAzureCredential())


def resolve(config: AzureConfig, credential: Any = None, env: Mapping[str, str] | None = None) -> Resolved:
    """The endpoint, account and credentials a store built with ``config`` uses in this process."""
    env = os.environ if env is None else env
    endpoint, account, auth = config.endpoint, config.account, None
    if credential is not None:
        auth = _explicit(credential, account)
    connection = env.get("AZURE_STORAGE_CONNECTION_STRING")
    if connection:
        cs_endpoint, cs_account, cs_auth = _from_connection_string(connection)
        endpoint = endpoint or cs_endpoint
        account = account or cs_account
        auth = auth or cs_auth
    account = account or env.get("AZURE_STORAGE_ACCOUNT") or (_account_of(endpoint) if endpoint else None)
    if account is None:
        raise ConfigError(
            "no Azure storage account: set AzureConfig(account=...) or AZURE_STORAGE_ACCOUNT, give an endpoint "
            "(https://<account>.blob.core.windows.net), or use an https:// checkpoint URI or "
            "AZURE_STORAGE_CONNECTION_STRING"
        )
    endpoint = endpoint or f"https://{account}.blob.core.windows.net"
    if auth is None and env.get("AZURE_STORAGE_KEY"):
        auth = _decode_key(account, env["AZURE_STORAGE_KEY"], "AZURE_STORAGE_KEY")
    if auth is None and env.get("AZURE_STORAGE_SAS_TOKEN"):
        auth = Sas(env["AZURE_STORAGE_SAS_TOKEN"].lstrip("?"))
    if auth is None:
        auth = _default_credential()
    if isinstance(auth, Bearer) and urlsplit(endpoint).scheme != "https":
        raise ConfigError(
            "Azure AD (Entra ID) tokens are sent over https:// only, and the endpoint is plain http://; use a key "
            "or SAS token for an emulator (AZURE_STORAGE_CONNECTION_STRING), or an https:// endpoint"
        )
    if isinstance(auth, SharedKey) and auth.account != account:
        auth = SharedKey(account, auth.key)
    return Resolved(endpoint.rstrip("/"), account, auth)


def sas_expiry(token: str) -> float | None:
    """When a SAS token expires (its ``se`` field, seconds since the epoch), if it says and can be read."""
    for name, value in parse_qsl(token, keep_blank_values=True):
        if name == "se":
            try:
                stamp = _dt.datetime.fromisoformat(unquote(value).replace("Z", "+00:00"))
            except ValueError:
                return None
            if stamp.tzinfo is None:
                stamp = stamp.replace(tzinfo=_dt.timezone.utc)
            return stamp.timestamp()
    return None


def shared_key_signature(
    key: SharedKey, method: str, path: str, query: Mapping[str, str], headers: Mapping[str, str]
) -> str:
    """The ``Authorization`` header of a Shared Key request (Blob service, version 2015-02-21 and later).

    ``path`` is the request's URL path as sent (percent-encoded, starting with ``/``), ``query`` its
    parameters (decoded), ``headers`` every header that will be sent.
    """
    lower = {name.lower(): str(value) for name, value in headers.items()}
    length = lower.get("content-length", "")
    standard = [
        method.upper(),
        lower.get("content-encoding", ""),
        lower.get("content-language", ""),
        "" if length == "0" else length,
        lower.get("content-md5", ""),
        lower.get("content-type", ""),
        "",  # Date: x-ms-date is sent instead
        lower.get("if-modified-since", ""),
        lower.get("if-match", ""),
        lower.get("if-none-match", ""),
        lower.get("if-unmodified-since", ""),
        lower.get("range", ""),
    ]
    ms_headers = "".join(f"{name}:{lower[name]}\n" for name in sorted(n for n in lower if n.startswith("x-ms-")))
    resource = f"/{key.account}{path}"
    for name in sorted(query, key=str.lower):
        resource += f"\n{name.lower()}:{query[name]}"
    string_to_sign = "\n".join(standard) + "\n" + ms_headers + resource
    digest = hmac.new(key.key, string_to_sign.encode("utf-8"), hashlib.sha256).digest()
    return f"SharedKey {key.account}:{base64.b64encode(digest).decode('ascii')}"


__all__ = [
    "DEV_ACCOUNT",
    "DEV_KEY",
    "Bearer",
    "Resolved",
    "Sas",
    "SharedKey",
    "parse_connection_string",
    "resolve",
    "sas_expiry",
    "shared_key_signature",
]
