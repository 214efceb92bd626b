"""Error translation of the Azure store: the only place that decides which typed error a failure is.

Classification uses the HTTP status and Azure's error code (``x-ms-error-code``, or ``<Code>`` of the error
body), and exception types; never message strings. Messages name the container/blob and say what to do;
they never carry a key, a SAS token, a bearer token or a body.
"""

from __future__ import annotations

import http.client
import time

from ...errors import (
    AccessDeniedError,
    BucketNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    DcpCloudError,
    ObjectNotFoundError,
    PreconditionFailedError,
    StoreError,
    ThrottledError,
    TransientStoreError,
    UnsupportedOperationError,
)
from ..tlscheck import caused_by_cert_failure


class AzureHTTPError(Exception):
    """An answer of the Blob service outside 2xx (raised by the client, translated by :func:`_translate`)."""

    def __init__(
        self,
        status: int,
        code: str | None,
        request_id: str | None,
        *,
        auth: str | None = None,
        sas_expiry: float | None = None,
    ) -> None:
        super().__init__(f"HTTP {status} {code or ''}".strip())
        self.status = status
        #: What authorized the request: ``"key"`` (Shared Key), ``"sas"`` or ``"token"`` (Entra ID).
        self.auth = auth
        #: Azure's error code (``BlobNotFound``, ``ServerBusy``...), if the answer had one.
        self.code = code
        #: ``x-ms-request-id``: what Azure support asks for.
        self.request_id = request_id
        #: When the SAS token in use expires (seconds since the epoch), if a SAS token was in use.
        self.sas_expiry = sas_expiry


class MalformedResponseError(Exception):
    """An answer whose body is not the XML the request calls for."""


_CONTAINER_MISSING = frozenset({"ContainerNotFound", "ContainerBeingDeleted"})
_BLOB_MISSING = frozenset({"BlobNotFound", "CannotVerifyCopySource"})
_EXISTS = frozenset({"BlobAlreadyExists", "ConditionNotMet", "TargetConditionNotMet", "SourceConditionNotMet"})
#: Azure's throttling answers (503 ServerBusy, 500 OperationTimedOut): they also cut the process's rate.
_THROTTLE = frozenset({"ServerBusy", "OperationTimedOut", "TooManyRequests"})
_DAMAGED = frozenset({"Md5Mismatch", "Crc64Mismatch", "ContentMD5Mismatch"})
_TOO_BIG = frozenset({"RequestBodyTooLarge", "BlockCountExceedsLimit", "BlockListTooLong", "InvalidBlobOrBlock"})
_TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})


def _url(account: str, container: str, key: str | None) -> str:
    return f"az://{container}/{key}" if key is not None else f"az://{container}"


def _detail(exc: AzureHTTPError) -> str:
    parts = [f"HTTP {exc.status}"]
    if exc.code:
        parts.append(exc.code)
    if exc.request_id:
        parts.append(f"request id {exc.request_id}")
    return ", ".join(parts)


def _transient_types() -> tuple[type[BaseException], ...]:
    import urllib3.exceptions

    return (urllib3.exceptions.HTTPError, http.client.HTTPException, ConnectionError, TimeoutError, OSError)


def _identity_error(exc: BaseException) -> bool:
    try:
        from azure.core.exceptions import ClientAuthenticationError
    except ImportError:
        return False
    return isinstance(exc, ClientAuthenticationError)


def _access(where: str, exc: AzureHTTPError) -> AccessDeniedError:
    detail = _detail(exc)
    if exc.sas_expiry is not None and exc.sas_expiry <= time.time():
        stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(exc.sas_expiry))
        return AccessDeniedError(
            f"access to {where} denied ({detail}): the SAS token in use expired at {stamp}; "
            "issue a new one (AZURE_STORAGE_SAS_TOKEN or the connection string's SharedAccessSignature)"
        )
    if exc.auth == "key":
        return AccessDeniedError(
            f"access to {where} denied ({detail}): the account key was refused. Check AZURE_STORAGE_KEY or the "
            "connection string's AccountKey (a rotated key invalidates the old one) and this machine's clock; if "
            "the key is right, the account may disallow Shared Key access or its network rules refuse this client"
        )
    if exc.auth == "sas":
        return AccessDeniedError(
            f"access to {where} denied ({detail}): the SAS token was refused. Check that it is complete, for this "
            "account and container, within its start and expiry times, and grants read, write, list and delete "
            "(rwld) permissions"
        )
    return AccessDeniedError(
        f"access to {where} denied ({detail}): the identity in use lacks a permission on the container; "
        "grant it a data role (e.g. 'Storage Blob Data Contributor') or use a SAS with read, write, list "
        "and delete (rwld) permissions"
    )


def _translate(
    exc: BaseException, account: str, container: str, key: str | None, *, missing: str = "either"
) -> DcpCloudError:
    """Map any failure of an Azure call to a :mod:`dcp_cloud.errors` type (the one place that does).

    ``missing`` says what a 404 without an error code means: ``"object"``, ``"bucket"`` (container calls,
    listings, uploads) or ``"either"`` (an object call: then it is the object). The result must be raised
    ``from exc`` so the original stays the ``__cause__``.
    """
    if isinstance(exc, DcpCloudError):
        return exc
    where = _url(account, container, key)
    kind = type(exc).__name__
    if isinstance(exc, MalformedResponseError):
        return StoreError(
            f"the Azure endpoint answered a request for {where} with something that is not a Blob service "
            f"answer ({exc}); check that the endpoint points at the Blob service (not a web page or a proxy)"
        )
    if _identity_error(exc):
        return AccessDeniedError(
            f"no usable Azure credentials for {where} ({kind}): DefaultAzureCredential found no managed or "
            "workload identity, service principal or `az login`; set AZURE_STORAGE_CONNECTION_STRING, "
            "AZURE_STORAGE_KEY or AZURE_STORAGE_SAS_TOKEN, or log in"
        )
    if not isinstance(exc, AzureHTTPError):
        if caused_by_cert_failure(exc):
            return StoreError(
                f"the TLS certificate of the Azure endpoint for {where} could not be verified ({kind}); "
                "check the endpoint, or point REQUESTS_CA_BUNDLE / SSL_CERT_FILE at your CA bundle"
            )
        if isinstance(exc, _transient_types()):
            return TransientStoreError(
                f"connection to Azure failed for {where} ({kind}): the network or the endpoint is unavailable; "
                "retry, and check AzureConfig.endpoint / the connection string if it persists"
            )
        return StoreError(f"Azure request for {where} failed ({kind})")

    status, code, detail = exc.status, exc.code, _detail(exc)
    if status in (401, 403):
        return _access(where, exc)
    if code in _CONTAINER_MISSING or (status == 404 and code is None and missing == "bucket"):
        return BucketNotFoundError(
            f"container {_url(account, container, None)} does not exist in storage account {account!r} ({detail}):"
            " create it (`az storage container create -n NAME`) or fix the container name / account"
        )
    if status == 404:
        return ObjectNotFoundError(f"{where} does not exist ({detail})")
    if code in _EXISTS or status == 412:
        return PreconditionFailedError(
            f"{where} already exists or was changed by another writer ({detail}); refusing to overwrite it"
        )
    if status == 416 or code == "InvalidRange":
        return CorruptCheckpointError(
            f"the requested byte range lies outside {where} ({detail}): the blob is truncated "
            "or does not belong to this checkpoint"
        )
    if code in _DAMAGED:
        return TransientStoreError(f"bytes sent to {where} were damaged in transit ({detail}); retry")
    if code in _TOO_BIG or status == 413:
        return StoreError(
            f"{where} is over Azure's block blob limits ({detail}): at most 50,000 blocks of up to 4000 MiB, "
            "and 5000 MiB in one Put Blob; raise TransferConfig.part_size for larger shards"
        )
    if code in ("InvalidResourceName", "OutOfRangeInput") and key is None:
        return ConfigError(
            f"Azure refused the container name of {where} ({detail}): names are 3-63 characters, lowercase "
            "letters, digits and single '-'"
        )
    if code in _THROTTLE or status == 429:
        return ThrottledError(
            f"Azure throttled the request for {where} ({detail}): the storage account is over its request or "
            "bandwidth target; the process-wide rate limit backs off"
        )
    if status in _TRANSIENT_STATUS:
        return TransientStoreError(f"Azure answered {detail} for {where}; the request can be retried")
    if status == 501:
        return UnsupportedOperationError(f"the Azure endpoint does not implement the request for {where} ({detail})")
    return StoreError(f"Azure request for {where} failed ({detail})")


__all__ = ["AzureHTTPError", "MalformedResponseError", "_translate", "_url"]
