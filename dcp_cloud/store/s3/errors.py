"""Error translation of the S3 store: the only place that decides which typed error a failure is."""

from __future__ import annotations

import http.client
import sys

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
    UnsupportedOperationError,
)
from ..tlscheck import caused_by_cert_failure
from .s3xml import MalformedResponseError

_BUCKET_MISSING_CODES = frozenset({"NoSuchBucket"})
_ACCESS_CODES = frozenset(
    {
        "AccessDenied",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "TokenRefreshRequired",
        "AllAccessDisabled",
        "AccountProblem",
        "InvalidSecurity",
        "RequestTimeTooSkewed",
        "Forbidden",
        "403",
    }
)
_PRECONDITION_CODES = frozenset({"PreconditionFailed", "ConditionalRequestConflict", "412"})
#: Codes that mean "slow down": they also cut the process's request rate (see store/ratelimit.py).
_THROTTLE_CODES = frozenset(
    {
        "SlowDown",
        "ServiceUnavailable",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "TooManyRequests",
        "RequestThrottled",
        "BandwidthLimitExceeded",
        "503",
    }
)
_TRANSIENT_CODES = _THROTTLE_CODES | {"RequestTimeout", "InternalError", "OperationAborted", "500", "502", "504"}
_TRANSIENT_STATUSES = frozenset({429, 500, 502, 503, 504})
_RANGE_CODES = frozenset({"InvalidRange", "416"})
_REGION_CODES = frozenset(
    {"PermanentRedirect", "AuthorizationHeaderMalformed", "IllegalLocationConstraintException", "301"}
)


def _s3_url(bucket: str, key: str | None) -> str:
    return f"s3://{bucket}/{key}" if key is not None else f"s3://{bucket}"


def _translate(exc: BaseException, bucket: str, key: str | None, action: str = "access") -> DcpCloudError:
    """Map a failure of either client (botocore, or the lean one: urllib3, socket) to a dcp_cloud error.

    Decides on error codes, HTTP statuses and exception types only, never on
    message text. The caller raises the result ``from exc``. Messages name
    the object and say what to do; they never contain credentials or bodies.
    """
    from botocore import exceptions as bce
    from urllib3 import exceptions as u3e

    if isinstance(exc, DcpCloudError):
        return exc
    where = _s3_url(bucket, key)

    if isinstance(exc, bce.ClientError):
        response = getattr(exc, "response", None) or {}
        error = response.get("Error") or {}
        code = str(error.get("Code") or "")
        meta = response.get("ResponseMetadata") or {}
        status = meta.get("HTTPStatusCode")
        if status is None and code.isdigit():  # HEAD errors carry the status as their code
            status = int(code)
        request_id = meta.get("RequestId") or ""
        detail = f"S3 error {code or '?'}, HTTP {status if status is not None else '?'}"
        if request_id:
            detail += f", request id {request_id}"

        if code in _BUCKET_MISSING_CODES or (key is None and status == 404 and code in ("", "404", "NotFound")):
            return BucketNotFoundError(
                f"bucket {bucket!r} does not exist ({where}; {detail}): create the bucket or fix the URI "
                "(and check the endpoint/region point at the right service)"
            )
        if code in _ACCESS_CODES or status == 403:
            hint = (
                "the system clock is off; sync it (NTP)"
                if code == "RequestTimeTooSkewed"
                else "check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN / AWS_PROFILE, "
                f"that the identity may {action} {where}, and that the bucket's policy does not demand "
                "headers this request lacks (encryption, storage class, tags: S3Config(object_options="
                "S3ObjectOptions(...))); S3 also answers 403 for a missing key when the identity may not "
                "list the bucket"
            )
            return AccessDeniedError(f"access denied to {where} ({detail}): {hint}")
        if code == "NoSuchKey" or (status == 404 and code in ("", "404", "NotFound")):
            return ObjectNotFoundError(f"{where} does not exist ({detail})")
        if code in _PRECONDITION_CODES or status == 412:
            return PreconditionFailedError(
                f"{where} already exists or was changed by a concurrent writer ({detail}); nothing was overwritten"
            )
        if code in _RANGE_CODES or status == 416:
            return CorruptCheckpointError(
                f"{where} is shorter than the byte range asked for ({detail}): the object is truncated "
                "or does not belong to this checkpoint"
            )
        if code in _THROTTLE_CODES or status in (429, 503):
            return ThrottledError(
                f"S3 throttled {action} {where} ({detail}): the request rate is above what the prefix "
                "sustains; the process-wide rate limit backs off (see RetryConfig.rate_limit)"
            )
        if code in _TRANSIENT_CODES or status in _TRANSIENT_STATUSES:
            return TransientStoreError(
                f"S3 could not {action} {where} right now ({detail}): the service is throttling or "
                "unavailable; retry later or lower the request concurrency"
            )
        if code in _REGION_CODES or status == 301:
            return StoreError(
                f"{where} lives in another region or endpoint ({detail}): set AWS_REGION (or S3Config.region) "
                "to the bucket's region"
            )
        if code == "NotImplemented" or status == 501:
            return UnsupportedOperationError(
                f"the S3 server does not implement the request to {action} {where} ({detail}): this S3-compatible "
                "server lacks that part of the S3 API"
            )
        message = str(error.get("Message") or "")[:200]
        return StoreError(f"S3 refused to {action} {where} ({detail}){': ' + message if message else ''}")

    # botocore's parser error, where botocore's client (which loads its parsers) made the request: importing
    # them here would cost the lean client's processes 20 ms on their first 404.
    parsers = sys.modules.get("botocore.parsers")
    unreadable = (MalformedResponseError, parsers.ResponseParserError) if parsers else (MalformedResponseError,)
    if isinstance(exc, unreadable):
        return StoreError(
            f"the S3 endpoint answered a request to {action} {where} with a body that is not S3's XML "
            f"({str(exc)[:200]}): check that the endpoint URL points at an S3 API (not a web page or a proxy)"
        )
    if isinstance(exc, (bce.NoCredentialsError, bce.PartialCredentialsError)):
        return AccessDeniedError(
            f"no usable AWS credentials to {action} {where}: set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, or run where an instance/container role is available"
        )
    if isinstance(exc, bce.ProfileNotFound):
        return AccessDeniedError(
            f"the AWS profile named by S3Config.profile / AWS_PROFILE does not exist (needed to {action} {where}): "
            "fix the profile name or define it in ~/.aws/config"
        )
    if isinstance(
        exc,
        (
            bce.CredentialRetrievalError,
            bce.NoAuthTokenError,
            bce.TokenRetrievalError,
            bce.SSOError,
            bce.UnknownCredentialError,
        ),
    ):
        return AccessDeniedError(
            f"could not obtain AWS credentials to {action} {where} ({type(exc).__name__}): "
            "check AWS_PROFILE / SSO login / the instance role"
        )
    if isinstance(exc, (bce.SSLError, u3e.SSLError)) and caused_by_cert_failure(exc):
        return StoreError(
            f"TLS certificate of the S3 endpoint was rejected while trying to {action} {where}: "
            "fix the endpoint URL or AWS_CA_BUNDLE"
        )
    transient_types: tuple[type[BaseException], ...] = (
        bce.ConnectionError,  # EndpointConnectionError, ConnectTimeoutError, SSLError, ProxyConnectionError
        bce.HTTPClientError,  # ConnectionClosedError, ReadTimeoutError, ResponseStreamingError
        bce.IncompleteReadError,
        u3e.ProtocolError,
        u3e.TimeoutError,
        u3e.IncompleteRead,
        u3e.SSLError,
        http.client.IncompleteRead,
        http.client.HTTPException,
        ConnectionError,  # builtin: reset, aborted, refused, broken pipe
        TimeoutError,
    )
    if isinstance(exc, transient_types):
        return TransientStoreError(
            f"connection to S3 failed while trying to {action} {where} ({type(exc).__name__}): "
            "the network or the endpoint is unavailable; retry, and check the endpoint URL if it persists"
        )
    return StoreError(f"could not {action} {where} ({type(exc).__name__})")
