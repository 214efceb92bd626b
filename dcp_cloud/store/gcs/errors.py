"""Error translation of the GCS store: the only place that decides which typed error a failure is."""

from __future__ import annotations

import http.client

from ...errors import (
    AccessDeniedError,
    BucketNotFoundError,
    CorruptCheckpointError,
    DcpCloudError,
    ObjectNotFoundError,
    PreconditionFailedError,
    StoreError,
    ThrottledError,
    TransientStoreError,
)

_TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})


def _url(bucket: str, key: str | None) -> str:
    return f"gs://{bucket}/{key}" if key is not None else f"gs://{bucket}"


def _http_status(exc: BaseException) -> int | None:
    """The HTTP status of a google-api-core or (google-)resumable-media error."""
    from google.api_core import exceptions as api_exceptions

    if isinstance(exc, api_exceptions.GoogleAPICallError):
        code = exc.code
        return int(code) if isinstance(code, int) else None
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    return status if isinstance(status, int) else None


def _reasons(exc: BaseException) -> str:
    """GCS's short error reason codes (``notFound``, ``invalid``...), never bodies."""
    errors = getattr(exc, "errors", None) or []
    reasons = sorted({e.get("reason") for e in errors if isinstance(e, dict) and isinstance(e.get("reason"), str)})
    return f" ({', '.join(reasons)})" if reasons else ""


def _transient_types() -> tuple[type[BaseException], ...]:
    import requests
    import urllib3.exceptions
    from google.auth import exceptions as auth_exceptions

    return (
        requests.exceptions.ConnectionError,  # includes ConnectTimeout
        requests.exceptions.Timeout,
        requests.exceptions.ChunkedEncodingError,
        requests.exceptions.ContentDecodingError,
        urllib3.exceptions.HTTPError,  # ProtocolError, ReadTimeoutError, IncompleteRead... read off the raw stream
        http.client.HTTPException,  # IncompleteRead, RemoteDisconnected...
        ConnectionError,
        TimeoutError,
        auth_exceptions.TransportError,
        auth_exceptions.TimeoutError,
    )


def _translate(exc: BaseException, bucket: str, key: str | None, *, missing: str = "object") -> DcpCloudError:
    """Map any exception of a GCS call to a :mod:`dcp_cloud.errors` type (the one place that does).

    ``missing`` says what an HTTP 404 means for the call: ``"object"`` (the
    key) or ``"bucket"`` (uploads and listings can only miss the bucket).
    Classification uses status codes and exception types only. The result
    must be raised ``from exc`` so the SDK error stays the ``__cause__``.
    """
    from google.auth import exceptions as auth_exceptions
    from google.cloud.storage import exceptions as storage_exceptions

    if isinstance(exc, DcpCloudError):
        return exc
    where = _url(bucket, key)
    kind = type(exc).__name__

    if isinstance(exc, storage_exceptions.DataCorruption):  # carries the (200) response: check before status
        return TransientStoreError(f"bytes of {where} were damaged in transit (checksum mismatch); retry")

    if isinstance(exc, auth_exceptions.RefreshError) and getattr(exc, "retryable", False):
        return TransientStoreError(f"refreshing credentials for {where} failed transiently ({kind}); retry")
    if isinstance(exc, (auth_exceptions.DefaultCredentialsError, auth_exceptions.RefreshError)):
        return AccessDeniedError(
            f"no usable Google credentials for {where} ({kind}): run 'gcloud auth application-default login', "
            "set GOOGLE_APPLICATION_CREDENTIALS or GCSConfig.credentials_file, or point STORAGE_EMULATOR_HOST / "
            "GCSConfig.endpoint at an emulator"
        )

    status = _http_status(exc)
    if status is None and isinstance(exc, _transient_types()):
        return TransientStoreError(
            f"connection to GCS failed for {where} ({kind}): the network or the endpoint is unavailable; retry, "
            "and check GCSConfig.endpoint / STORAGE_EMULATOR_HOST if it persists"
        )
    if status is None:
        return StoreError(f"GCS request for {where} failed ({kind})")

    detail = f"HTTP {status}{_reasons(exc)}"
    if status in (401, 403):
        return AccessDeniedError(
            f"access to {where} denied ({detail}): check that the credentials in use have the "
            "storage.objects.* permissions on the bucket (e.g. roles/storage.objectUser)"
        )
    if status == 404:
        if missing == "bucket":
            return BucketNotFoundError(
                f"bucket gs://{bucket} does not exist ({detail}): create it or fix the bucket name / endpoint"
            )
        return ObjectNotFoundError(f"{where} does not exist ({detail})")
    if status == 412:
        return PreconditionFailedError(
            f"{where} already exists or was changed by another writer ({detail}); refusing to overwrite it"
        )
    if status == 416:
        return CorruptCheckpointError(
            f"the requested byte range lies outside {where} ({detail}): the object is truncated "
            "or does not belong to this checkpoint"
        )
    if status in (429, 503):
        return ThrottledError(
            f"GCS throttled the request for {where} ({detail}); the process-wide rate limit backs off"
        )
    if status in _TRANSIENT_STATUS:
        return TransientStoreError(f"GCS answered {detail} for {where}; the request can be retried")
    return StoreError(f"GCS request for {where} failed ({detail})")
