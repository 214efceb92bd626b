"""Bucket policies, played by the fault proxy in front of an S3 server that has none (moto).

A production bucket's policy often denies every new object that does not ask for the encryption the
bucket's owner wants (``"Condition": {"StringNotEquals": {"s3:x-amz-server-side-encryption": "aws:kms"}}``
on ``s3:PutObject``). :func:`require_sse` is a :class:`~.faults.FaultPlan` that answers such a request with
S3's ``403 AccessDenied`` and forwards every other one, so a test can run every operation of the product
through it: a request that reaches the server without the header is counted as a fault (``denied_403``).

What S3 checks against the condition are the requests that create an object: PutObject, CopyObject (a
PUT with ``x-amz-copy-source`` and no part number) and CreateMultipartUpload (``POST ?uploads``). Parts,
completions, reads, listings and deletes carry no encryption header and are not refused.
"""

from __future__ import annotations

from urllib.parse import parse_qs

from .faults import FaultPlan, RequestInfo

#: Header names (lower case) of the condition keys.
SSE_HEADER = "x-amz-server-side-encryption"
KMS_KEY_HEADER = "x-amz-server-side-encryption-aws-kms-key-id"


def creates_object(request: RequestInfo) -> bool:
    """Whether ``request`` is an S3 request that creates an object (path-style: ``/bucket/key``)."""
    if request.path.strip("/").count("/") < 1:  # the bucket itself (HeadBucket, ListObjectsV2, DeleteObjects)
        return False
    query = parse_qs(request.query, keep_blank_values=True)
    if request.method == "PUT":
        return "partNumber" not in query and "tagging" not in query
    return request.method == "POST" and "uploads" in query


def require_sse(sse: str = "aws:kms", kms_key_id: str | None = None) -> FaultPlan:
    """A plan that refuses (403) every object-creating request whose ``x-amz-server-side-encryption`` is not
    ``sse`` (or, with ``kms_key_id``, whose KMS key header is not that key)."""

    def violates(request: RequestInfo) -> bool:
        if not creates_object(request):
            return False
        if request.headers.get(SSE_HEADER) != sse:
            return True
        return kms_key_id is not None and request.headers.get(KMS_KEY_HEADER) != kms_key_id

    return FaultPlan.only("denied_403", 1.0, when=violates)


__all__ = ["KMS_KEY_HEADER", "SSE_HEADER", "creates_object", "require_sse"]
