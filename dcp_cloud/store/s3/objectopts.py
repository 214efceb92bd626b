"""S3ObjectOptions: how a production bucket wants its objects written and its requests made (encryption,
storage class, tags, requester pays, expected owner), and the one function that turns them into the botocore
keyword arguments of each request, which both clients send (the lean client through :data:`OPTION_HEADERS`).
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

_SSE = ("AES256", "aws:kms")
_STORAGE_CLASS_RE = re.compile(r"^[A-Z][A-Z0-9_]*$")
_OWNER_RE = re.compile(r"^[0-9]{12}$")
#: What S3 allows in tag keys and values: letters, digits, spaces and + - = . _ : / @
_TAG_RE = re.compile(r"^[\w \t+\-=.:/@]*$")


@dataclass(frozen=True)
class S3ObjectOptions:
    """What every object a store writes carries, and every request it makes. ``None``: the bucket's default.

    Both S3 clients send every option on every request it applies to; the lean client raises ConfigError
    rather than send a request without one.
    """

    #: Server-side encryption of new objects: ``"AES256"`` (SSE-S3) or ``"aws:kms"`` (SSE-KMS).
    #: ``None``: the bucket's default encryption. Not together with ``sse_customer_key``.
    sse: Literal["AES256", "aws:kms"] | None = None
    #: The KMS key (id, ARN or alias) of ``sse="aws:kms"``; ``None``: the account's ``aws/s3`` key.
    kms_key_id: str | None = None
    #: ``True``/``False``: ask for (or against) an S3 Bucket Key for SSE-KMS objects (fewer KMS calls).
    #: ``None``: the bucket's setting. Only with ``sse="aws:kms"``.
    bucket_key: bool | None = None
    #: SSE-C: the 32-byte AES-256 key of every object, sent on every write, read, head and copy. S3 keeps no
    #: copy: objects written with it can be read only with it. Never shown in repr, logs or errors.
    sse_customer_key: bytes | None = field(default=None, repr=False)
    #: Allow ``sse_customer_key`` over plain ``http://`` (emulators only: the key would cross the network
    #: in the clear). S3 itself refuses SSE-C over http.
    allow_sse_customer_key_over_http: bool = False
    #: Storage class of new objects, e.g. ``"STANDARD_IA"``, ``"INTELLIGENT_TIERING"``; ``None``: STANDARD.
    storage_class: str | None = None
    #: Tags of every new object, ``{key: value}`` (at most 10; sent url-encoded in ``x-amz-tagging``).
    tags: Mapping[str, str] | None = None
    #: ``True``: send ``x-amz-request-payer: requester`` on every request (requester-pays buckets).
    requester_pays: bool = False
    #: A 12-digit AWS account id: S3 refuses every request (403) if the bucket belongs to another account.
    expected_bucket_owner: str | None = None

    def __post_init__(self) -> None:
        require(self.sse is None or self.sse in _SSE, f"sse must be one of {_SSE} or None, got {self.sse!r}")
        if self.kms_key_id is not None:
            require(
                isinstance(self.kms_key_id, str) and bool(self.kms_key_id.strip()),
                f"kms_key_id must be a non-empty KMS key id, ARN or alias, got {self.kms_key_id!r}",
            )
            require(self.sse == "aws:kms", 'kms_key_id needs sse="aws:kms"')
        if self.bucket_key is not None:
            require(isinstance(self.bucket_key, bool), f"bucket_key must be a bool or None, got {self.bucket_key!r}")
            require(self.sse == "aws:kms", 'bucket_key applies only to SSE-KMS: set sse="aws:kms"')
        if self.sse_customer_key is not None:
            check_customer_key(self.sse_customer_key, "sse_customer_key")
            require(self.sse is None, "sse_customer_key (SSE-C) cannot be combined with sse: choose one")
        require(
            isinstance(self.allow_sse_customer_key_over_http, bool),
            "allow_sse_customer_key_over_http must be a bool",
        )
        if self.storage_class is not None:
            require(
                isinstance(self.storage_class, str) and bool(_STORAGE_CLASS_RE.match(self.storage_class)),
                f"storage_class must be an S3 storage class like 'STANDARD_IA', got {self.storage_class!r}",
            )
        if self.tags is not None:
            tags = check_tags(self.tags, "S3", "object", _TAG_RE, "letters, digits, spaces and + - = . _ : / @")
            object.__setattr__(self, "tags", tags)
        require(isinstance(self.requester_pays, bool), f"requester_pays must be a bool, got {self.requester_pays!r}")
        if self.expected_bucket_owner is not None:
            require(
                isinstance(self.expected_bucket_owner, str) and bool(_OWNER_RE.match(self.expected_bucket_owner)),
                f"expected_bucket_owner must be a 12-digit AWS account id, got {self.expected_bucket_owner!r}",
            )

    def __hash__(self) -> int:  # tags is a dict: hash what it holds
        return hash(tuple(sorted((self.tags or {}).items())) + (self.sse, self.kms_key_id, self.storage_class))

    def check_endpoint(self, endpoint_url: str | None) -> None:
        """ConfigError where an SSE-C key would go over plain http without the explicit allowance."""
        if self.sse_customer_key is None or self.allow_sse_customer_key_over_http:
            return
        check_key_endpoint(
            endpoint_url, "sse_customer_key (SSE-C)", "S3ObjectOptions(allow_sse_customer_key_over_http=True)"
        )


# Operation groups (botocore's operation names).
_NEW_OBJECT = ("PutObject", "CreateMultipartUpload", "CopyObject")
_SSE_C = ("PutObject", "CreateMultipartUpload", "CopyObject", "UploadPart", "UploadPartCopy", "GetObject",
          "HeadObject", "CompleteMultipartUpload")  # fmt: skip
_COPY = ("CopyObject", "UploadPartCopy")
_PAYER = (*_SSE_C, "AbortMultipartUpload", "DeleteObjects", "ListObjectsV2", "ListMultipartUploads")
_OWNER = (*_PAYER, "HeadBucket")

#: botocore keyword -> HTTP header (lower case), as botocore's service model sends it.
WIRE: Mapping[str, str] = {
    "ServerSideEncryption": "x-amz-server-side-encryption",
    "SSEKMSKeyId": "x-amz-server-side-encryption-aws-kms-key-id",
    "BucketKeyEnabled": "x-amz-server-side-encryption-bucket-key-enabled",
    "SSECustomerAlgorithm": "x-amz-server-side-encryption-customer-algorithm",
    "SSECustomerKey": "x-amz-server-side-encryption-customer-key",
    "SSECustomerKeyMD5": "x-amz-server-side-encryption-customer-key-md5",
    "CopySourceSSECustomerAlgorithm": "x-amz-copy-source-server-side-encryption-customer-algorithm",
    "CopySourceSSECustomerKey": "x-amz-copy-source-server-side-encryption-customer-key",
    "CopySourceSSECustomerKeyMD5": "x-amz-copy-source-server-side-encryption-customer-key-md5",
    "StorageClass": "x-amz-storage-class",
    "Tagging": "x-amz-tagging",
    "TaggingDirective": "x-amz-tagging-directive",
    "RequestPayer": "x-amz-request-payer",
    "ExpectedBucketOwner": "x-amz-expected-bucket-owner",
    "ExpectedSourceBucketOwner": "x-amz-source-expected-bucket-owner",
}

_ALL_OPS = sorted(set(_OWNER))


def _ops_of(param: str) -> tuple[str, ...]:
    if param in ("ServerSideEncryption", "SSEKMSKeyId", "BucketKeyEnabled", "StorageClass", "Tagging"):
        return _NEW_OBJECT
    if param == "TaggingDirective":
        return ("CopyObject",)
    if param.startswith("SSECustomer"):
        return _SSE_C
    if param.startswith("CopySource") or param == "ExpectedSourceBucketOwner":
        return _COPY
    return _PAYER if param == "RequestPayer" else _OWNER


#: Per operation, the botocore keywords of these options it takes (the lean client's header rows).
OPTION_PARAMS: Mapping[str, tuple[str, ...]] = {op: tuple(p for p in WIRE if op in _ops_of(p)) for op in _ALL_OPS}


def option_params(options: S3ObjectOptions | None, op: str) -> dict[str, object]:
    """The botocore keyword arguments of ``options`` that ``op`` takes (empty where none are set)."""
    if options is None:
        return {}
    values: dict[str, object] = {}
    if options.sse is not None:
        values["ServerSideEncryption"] = options.sse
    if options.kms_key_id is not None:
        values["SSEKMSKeyId"] = options.kms_key_id
    if options.bucket_key is not None:
        values["BucketKeyEnabled"] = options.bucket_key
    key = options.sse_customer_key
    if key is not None:
        # Given with its MD5, botocore sends the key as it is (already base64), like the lean client.
        b64 = base64.b64encode(key).decode()
        md5 = base64.b64encode(hashlib.md5(key, usedforsecurity=False).digest()).decode()
        for prefix in ("SSECustomer", "CopySourceSSECustomer"):
            values.update({f"{prefix}Algorithm": "AES256", f"{prefix}Key": b64, f"{prefix}KeyMD5": md5})
    if options.storage_class is not None:
        values["StorageClass"] = options.storage_class
    if options.tags:
        values["Tagging"] = "&".join(f"{quote(k, safe='')}={quote(v, safe='')}" for k, v in options.tags.items())
        values["TaggingDirective"] = "REPLACE"
    if options.requester_pays:
        values["RequestPayer"] = "requester"
    if options.expected_bucket_owner is not None:
        values["ExpectedBucketOwner"] = options.expected_bucket_owner
        values["ExpectedSourceBucketOwner"] = options.expected_bucket_owner
    allowed = OPTION_PARAMS.get(op, ())
    return {name: value for name, value in values.items() if name in allowed}


def wire_value(value: object) -> str:
    """A keyword's value as its header sends it (botocore's booleans are ``true``/``false``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


__all__ = ["OPTION_PARAMS", "WIRE", "S3ObjectOptions", "option_params", "wire_value"]
