"""The S3 object options of ``dcp-cloud`` (``--sse``, ``--kms-key-id``, ``--sse-customer-key-file``, ...): what a
production bucket wants on every request, as :class:`~dcp_cloud.S3ObjectOptions`.

An SSE-C key is read from a file, never taken on the command line (which other users of the machine can see
in the process list), and never printed.
"""

from __future__ import annotations

import argparse
import base64
import binascii
from pathlib import Path
from typing import Any

#: The ``args`` attributes of these options (None or False: not given).
NAMES = (
    "sse",
    "kms_key_id",
    "bucket_key",
    "sse_customer_key_file",
    "allow_sse_customer_key_over_http",
    "storage_class",
    "tag",
    "requester_pays",
    "expected_bucket_owner",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of S3 buckets that demand encryption, a storage class, tags or requester pays."""
    group = parser.add_argument_group("S3 bucket options (s3:// URIs only)")
    group.add_argument("--sse", choices=("AES256", "aws:kms"), help="server-side encryption of new objects")
    group.add_argument("--kms-key-id", metavar="KEY", help="the KMS key (id, ARN or alias) of --sse aws:kms")
    group.add_argument(
        "--bucket-key",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="ask for (or against) an S3 Bucket Key for --sse aws:kms objects",
    )
    group.add_argument(
        "--sse-customer-key-file",
        metavar="FILE",
        help="SSE-C: a file holding the 32-byte AES-256 key (raw, or base64); needed to read what was written with it",
    )
    group.add_argument(
        "--allow-sse-customer-key-over-http",
        action="store_true",
        help="send the SSE-C key to a plain http:// endpoint (emulators only)",
    )
    group.add_argument("--storage-class", metavar="CLASS", help="storage class of new objects, e.g. STANDARD_IA")
    group.add_argument(
        "--tag", action="append", metavar="KEY=VALUE", help="a tag of every new object (repeat for more)"
    )
    group.add_argument("--requester-pays", action="store_true", help="for requester-pays buckets")
    group.add_argument(
        "--expected-bucket-owner", metavar="ACCOUNT", help="12-digit account id the bucket must belong to"
    )


def given(args: argparse.Namespace) -> list[str]:
    """The options of this module on the command line, as ``--flag`` names."""
    return [f"--{name.replace('_', '-')}" for name in NAMES if getattr(args, name, None) not in (None, False)]


class ObjectArgError(Exception):
    """An S3 bucket option that cannot be used as given (the message says why; never the key)."""


def _key(path: str) -> bytes:
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ObjectArgError(f"--sse-customer-key-file {path}: cannot read it ({exc.strerror})") from None
    if len(raw) == 32:
        return raw
    try:
        key = base64.b64decode(raw.strip(), validate=True)
    except (binascii.Error, ValueError):
        key = b""
    if len(key) != 32:
        raise ObjectArgError(
            f"--sse-customer-key-file {path}: holds neither 32 raw bytes nor the base64 of 32 bytes "
            "(an AES-256 key, e.g. from: head -c 32 /dev/urandom > key)"
        )
    return key


def _tags(pairs: list[str] | None) -> dict[str, str] | None:
    if not pairs:
        return None
    tags: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ObjectArgError(f"--tag takes KEY=VALUE, got {pair!r}")
        tags[key] = value
    return tags


def object_options(args: argparse.Namespace) -> Any:
    """The :class:`~dcp_cloud.S3ObjectOptions` of the command line, or None when none was given."""
    if not given(args):
        return None
    from ..store.s3.objectopts import S3ObjectOptions

    key_file = getattr(args, "sse_customer_key_file", None)
    return S3ObjectOptions(
        sse=args.sse,
        kms_key_id=args.kms_key_id,
        bucket_key=args.bucket_key,
        sse_customer_key=_key(key_file) if key_file else None,
        allow_sse_customer_key_over_http=args.allow_sse_customer_key_over_http,
        storage_class=args.storage_class,
        tags=_tags(args.tag),
        requester_pays=args.requester_pays,
        expected_bucket_owner=args.expected_bucket_owner,
    )
