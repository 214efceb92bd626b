"""The bucket options of ``dcp-cloud`` (``--sse``, ``--kms-key-name``, ``--access-tier``, ``--customer-key-file``,
...): what a production bucket or container wants on every request, as the ``object_options`` of the URI's
cloud (:class:`~dcp_cloud.S3ObjectOptions`, :class:`~dcp_cloud.GCSObjectOptions`,
:class:`~dcp_cloud.AzureObjectOptions`).

A customer-supplied key is read from a file, never taken on the command line (which other users of the
machine can see in the process list), and never printed.
"""

from __future__ import annotations

import argparse
import base64
import binascii
from pathlib import Path
from typing import Any

#: ``args`` attribute -> {scheme: the field of that cloud's options it sets}.
FIELDS: dict[str, dict[str, str]] = {
    "sse": {"s3": "sse"},
    "kms_key_id": {"s3": "kms_key_id"},
    "bucket_key": {"s3": "bucket_key"},
    "requester_pays": {"s3": "requester_pays"},
    "expected_bucket_owner": {"s3": "expected_bucket_owner"},
    "kms_key_name": {"gs": "kms_key_name"},
    "user_project": {"gs": "user_project"},
    "encryption_scope": {"az": "encryption_scope"},
    "access_tier": {"az": "access_tier"},
    "storage_class": {"s3": "storage_class", "gs": "storage_class"},
    "tag": {"s3": "tags", "az": "tags"},
    "customer_key_file": {"s3": "sse_customer_key", "gs": "customer_encryption_key", "az": "customer_provided_key"},
    "allow_customer_key_over_http": {
        "s3": "allow_sse_customer_key_over_http",
        "gs": "allow_customer_encryption_key_over_http",
        "az": "allow_customer_provided_key_over_http",
    },
}


class ObjectArgError(Exception):
    """A bucket option that cannot be used as given (the message says why; never the key)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of buckets that demand encryption, a storage class or tier, tags or a billing project."""
    group = parser.add_argument_group("bucket options (each names the clouds it applies to)")
    group.add_argument("--sse", choices=("AES256", "aws:kms"), help="S3: server-side encryption of new objects")
    group.add_argument("--kms-key-id", metavar="KEY", help="S3: the KMS key (id, ARN or alias) of --sse aws:kms")
    group.add_argument(
        "--bucket-key",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="S3: ask for (or against) an S3 Bucket Key for --sse aws:kms objects",
    )
    group.add_argument("--requester-pays", action="store_true", help="S3: for requester-pays buckets")
    group.add_argument("--expected-bucket-owner", metavar="ACCOUNT", help="S3: the account the bucket must belong to")
    group.add_argument("--kms-key-name", metavar="NAME", help="GCS: the Cloud KMS key (CMEK) of new objects")
    group.add_argument("--user-project", metavar="PROJECT", help="GCS: the project billed (requester-pays buckets)")
    group.add_argument("--encryption-scope", metavar="SCOPE", help="Azure: the encryption scope of new blobs")
    group.add_argument("--access-tier", choices=("Hot", "Cool", "Cold", "Archive"), help="Azure: tier of new blobs")
    group.add_argument("--storage-class", metavar="CLASS", help="S3, GCS: storage class of new objects")
    group.add_argument(
        "--tag", action="append", metavar="KEY=VALUE", help="S3, Azure: a tag of every new object (repeat for more)"
    )
    group.add_argument(
        "--customer-key-file",
        metavar="FILE",
        help="S3 (SSE-C), GCS (CSEK), Azure (CPK): a file holding the 32-byte AES-256 key (raw, or base64); "
        "needed to read what was written with it",
    )
    group.add_argument(
        "--allow-customer-key-over-http",
        action="store_true",
        help="send the customer key to a plain http:// endpoint (emulators only)",
    )


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def given(args: argparse.Namespace) -> list[str]:
    """The attributes of these options given on the command line."""
    return [name for name in FIELDS if getattr(args, name, None) not in (None, False)]


def misfits(args: argparse.Namespace, scheme: str) -> list[str]:
    """The options given that do not apply to ``scheme``'s URIs, as ``--flag`` names."""
    return [_flag(name) for name in given(args) if scheme not in FIELDS[name]]


def _key(path: str) -> bytes:
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ObjectArgError(f"--customer-key-file {path}: cannot read it ({exc.strerror})") from None
    if len(raw) == 32:
        return raw
    try:
        key = base64.b64decode(raw.strip(), validate=True)
    except (binascii.Error, ValueError):
        key = b""
    if len(key) != 32:
        raise ObjectArgError(
            f"--customer-key-file {path}: holds neither 32 raw bytes nor the base64 of 32 bytes "
            "(an AES-256 key, e.g. from: head -c 32 /dev/urandom > key)"
        )
    return key


def _tags(pairs: list[str]) -> dict[str, str]:
    tags: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ObjectArgError(f"--tag takes KEY=VALUE, got {pair!r}")
        tags[key] = value
    return tags


def object_options(args: argparse.Namespace, scheme: str) -> Any:
    """The ``object_options`` of ``scheme``'s cloud from the command line (the options that apply to it), or
    None when none was given."""
    values: dict[str, Any] = {}
    for name in given(args):
        field = FIELDS[name].get(scheme)
        if field is None:
            continue
        value = getattr(args, name)
        if name == "customer_key_file":
            value = _key(value)
        elif name == "tag":
            value = _tags(value)
        values[field] = value
    if not values:
        return None
    if scheme == "s3":
        from ..store.s3.objectopts import S3ObjectOptions

        return S3ObjectOptions(**values)
    if scheme == "gs":
        from ..store.gcs.objectopts import GCSObjectOptions

        return GCSObjectOptions(**values)
    from ..store.azure.objectopts import AzureObjectOptions

    return AzureObjectOptions(**values)
