"""GCSObjectOptions: how a production bucket wants its objects written and its requests made (CMEK, CSEK,
requester pays, storage class), and the one place that turns them into what each request carries.

The store sends some requests itself (media uploads and downloads, uploads with an object resource, compose)
and leaves the rest to google-cloud-storage (small create-only uploads, whole-object downloads, metadata GETs,
rewrites, listings, deletes). :func:`request_params` and :func:`request_headers` give the query parameters and
headers of the former; :func:`bucket_kwargs` and :func:`blob_kwargs` configure the library's ``Bucket`` and
``Blob`` objects, from which the library sends the same parameters and headers on the latter.
"""

from __future__ import annotations

import base64
import hashlib
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from ..optioncheck import check_customer_key, check_key_endpoint, require

#: ``projects/P/locations/L/keyRings/R/cryptoKeys/K`` (no ``cryptoKeyVersions``: GCS wants the key).
_KMS_RE = re.compile(r"^projects/[^/\s]+/locations/[^/\s]+/keyRings/[^/\s]+/cryptoKeys/[^/\s]+$")
_STORAGE_CLASS_RE = re.compile(r"^[A-Z][A-Z_]*$")
#: GCS project ids (6-30 characters, or the older domain-scoped ``example.com:project``) and project numbers.
_PROJECT_RE = re.compile(r"^(([a-z0-9.-]+:)?[a-z][a-z0-9-]{4,28}[a-z0-9]|[0-9]{1,20})$")

#: The requests the store makes itself (the library makes the others, from :func:`bucket_kwargs` and
#: :func:`blob_kwargs`): media and multipart uploads, ranged media GETs, composes.
Op = Literal["upload", "read", "compose"]


@dataclass(frozen=True)
class GCSObjectOptions:
    """What every object a GCS store writes carries, and every request it makes. ``None``: the bucket's default."""

    #: CMEK: the Cloud KMS key of new objects, ``projects/P/locations/L/keyRings/R/cryptoKeys/K``, sent as
    #: ``kmsKeyName`` on every upload and compose (``destinationKmsKeyName`` on rewrites). The bucket's service
    #: agent needs ``roles/cloudkms.cryptoKeyEncrypterDecrypter`` on it. Not together with
    #: ``customer_encryption_key``.
    kms_key_name: str | None = None
    #: CSEK: the 32-byte AES-256 key of every object, sent (``x-goog-encryption-*`` headers) on every upload,
    #: read, metadata GET, compose and rewrite (as the source's key too: a copy's source must have the same key).
    #: GCS keeps only its SHA-256: objects written with it can be read only with it. Never shown in repr,
    #: logs or errors.
    customer_encryption_key: bytes | None = field(default=None, repr=False)
    #: Allow ``customer_encryption_key`` over plain ``http://`` (emulators only: the key would cross the network
    #: in the clear).
    allow_customer_encryption_key_over_http: bool = False
    #: Requester pays: the project billed for every request (``userProject`` on every request); the caller
    #: needs ``serviceusage.services.use`` on it.
    user_project: str | None = None
    #: Storage class of new objects, e.g. ``"NEARLINE"``, ``"COLDLINE"``, ``"ARCHIVE"``, ``"STANDARD"``;
    #: ``None``: the bucket's default class. Sent in the object resource of every upload, compose and rewrite
    #: (so uploads that would carry no resource go as ``uploadType=multipart``, still without copying the body).
    storage_class: str | None = None

    def __post_init__(self) -> None:
        if self.kms_key_name is not None:
            require(
                isinstance(self.kms_key_name, str) and bool(_KMS_RE.match(self.kms_key_name)),
                "kms_key_name must name a Cloud KMS key as "
                f"'projects/P/locations/L/keyRings/R/cryptoKeys/K' (no cryptoKeyVersions), got {self.kms_key_name!r}",
            )
        if self.customer_encryption_key is not None:
            # Never echo the key itself.
            check_customer_key(self.customer_encryption_key, "customer_encryption_key")
            require(
                self.kms_key_name is None,
                "customer_encryption_key (CSEK) cannot be combined with kms_key_name (CMEK): choose one",
            )
        require(
            isinstance(self.allow_customer_encryption_key_over_http, bool),
            "allow_customer_encryption_key_over_http must be a bool",
        )
        if self.user_project is not None:
            require(
                isinstance(self.user_project, str) and bool(_PROJECT_RE.match(self.user_project)),
                f"user_project must be the id of the project to bill, like 'my-project-123', got {self.user_project!r}",
            )
        if self.storage_class is not None:
            require(
                isinstance(self.storage_class, str) and bool(_STORAGE_CLASS_RE.match(self.storage_class)),
                f"storage_class must be a GCS storage class like 'NEARLINE' or 'COLDLINE', got {self.storage_class!r}",
            )

    def check_endpoint(self, endpoint: str | None) -> None:
        """ConfigError where a customer key would go over plain http without the explicit allowance."""
        if self.customer_encryption_key is None or self.allow_customer_encryption_key_over_http:
            return
        check_key_endpoint(
            endpoint, "customer_encryption_key (CSEK)", "GCSObjectOptions(allow_customer_encryption_key_over_http=True)"
        )


def request_params(options: GCSObjectOptions | None, op: Op) -> list[tuple[str, str]]:
    """The query parameters of ``options`` that request ``op`` carries (none where no options are set)."""
    if options is None:
        return []
    params: list[tuple[str, str]] = []
    if options.kms_key_name is not None and op != "read":  # the requests that create an object
        params.append(("kmsKeyName", options.kms_key_name))
    if options.user_project is not None:
        params.append(("userProject", options.user_project))
    return params


def request_headers(options: GCSObjectOptions | None, op: Op) -> dict[str, str]:
    """The headers of ``options`` that request ``op`` carries: the customer key's (all three ops read or write
    an object's bytes), spelled as the library spells them."""
    key = None if options is None else options.customer_encryption_key
    if key is None:
        return {}
    return {
        "X-Goog-Encryption-Algorithm": "AES256",
        "X-Goog-Encryption-Key": base64.b64encode(key).decode("ascii"),
        "X-Goog-Encryption-Key-Sha256": base64.b64encode(hashlib.sha256(key).digest()).decode("ascii"),
    }


def object_resource(options: GCSObjectOptions | None) -> dict[str, str]:
    """The fields of ``options`` that the object resource of a new object (upload, compose) carries."""
    if options is None or options.storage_class is None:
        return {}
    return {"storageClass": options.storage_class}


def bucket_kwargs(options: GCSObjectOptions | None) -> dict[str, Any]:
    """Keywords of ``client.bucket()``: the library adds ``userProject`` to every request of that bucket."""
    return {} if options is None or options.user_project is None else {"user_project": options.user_project}


def blob_kwargs(options: GCSObjectOptions | None) -> dict[str, Any]:
    """Keywords of ``bucket.blob()``: the library sends the customer key's headers on every request of the blob
    (the source's on rewrites) and ``kmsKeyName`` on uploads (``destinationKmsKeyName`` on rewrites)."""
    if options is None:
        return {}
    kwargs: dict[str, Any] = {}
    if options.customer_encryption_key is not None:
        kwargs["encryption_key"] = options.customer_encryption_key
    if options.kms_key_name is not None:
        kwargs["kms_key_name"] = options.kms_key_name
    return kwargs


__all__ = [
    "GCSObjectOptions",
    "Op",
    "blob_kwargs",
    "bucket_kwargs",
    "object_resource",
    "request_headers",
    "request_params",
]
