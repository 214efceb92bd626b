"""The request headers of an S3 store's requests, from one table both clients read.

A store's request carries, beyond its operation's own arguments (bucket, key,
body, upload id, part number), options the store decides: the body's CRC32C,
the checksum algorithm an upload declares, a create-only precondition. The
store puts them into :class:`RequestOptions`; :meth:`RequestOptions.params`
gives them as botocore's keyword arguments, which the store passes to either
client. botocore sends each as the header of its service model; the lean
client (:mod:`.lean`) sends :func:`wire_headers` of the same keywords, from
the same :data:`HEADERS` rows, and refuses a keyword that has no row (it
would otherwise go unsent). A header added later (server-side encryption,
storage class, ``If-Match``) is one row here and one field of
:class:`RequestOptions`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...errors import ConfigError
from .objectopts import OPTION_PARAMS, WIRE, wire_value


@dataclass(frozen=True)
class Header:
    """One request header: the :class:`RequestOptions` field it comes from, botocore's keyword for it and the
    HTTP header (lower case) that botocore's service model and the lean client send it as."""

    option: str
    param: str
    wire: str


_CRC32C = Header("crc32c", "ChecksumCRC32C", "x-amz-checksum-crc32c")
#: The algorithm of the checksum a body carries (PutObject, UploadPart).
_BODY_ALGORITHM = Header("checksum_algorithm", "ChecksumAlgorithm", "x-amz-sdk-checksum-algorithm")
#: The algorithm every part of an upload carries (CreateMultipartUpload): another header for the same keyword.
_UPLOAD_ALGORITHM = Header("checksum_algorithm", "ChecksumAlgorithm", "x-amz-checksum-algorithm")
_IF_NONE_MATCH = Header("if_none_match", "IfNoneMatch", "if-none-match")

#: Per operation (botocore's operation names), the headers a store's request may carry, in the order the lean
#: client sends them. tests/test_s3_headers.py checks every row against botocore's service model.
HEADERS: Mapping[str, tuple[Header, ...]] = {
    "PutObject": (_CRC32C, _BODY_ALGORITHM, _IF_NONE_MATCH),
    "UploadPart": (_CRC32C, _BODY_ALGORITHM),
    "CreateMultipartUpload": (_UPLOAD_ALGORITHM,),
    "CompleteMultipartUpload": (_IF_NONE_MATCH,),
}


@dataclass(frozen=True)
class RequestOptions:
    """What a store's request carries beyond its operation's own arguments; None: not sent."""

    #: The body's CRC32C, base64 of its 4 big-endian bytes (PutObject, UploadPart): S3 refuses a body that
    #: does not match it.
    crc32c: str | None = None
    #: ``"CRC32C"``: the algorithm of ``crc32c`` (PutObject, UploadPart), or of every part's checksum
    #: (CreateMultipartUpload: S3 refuses part checksums of an upload created without one).
    checksum_algorithm: str | None = None
    #: ``"*"``: refused where the key exists (PutObject, CompleteMultipartUpload; create-only writes).
    if_none_match: str | None = None

    def params(self, op: str) -> dict[str, str]:
        """The options ``op`` takes, as botocore's keyword arguments (those that are set)."""
        values = dataclasses.asdict(self)
        return {h.param: values[h.option] for h in HEADERS[op] if values[h.option] is not None}


def wire_headers(op: str, params: Mapping[str, Any]) -> dict[str, str]:
    """The HTTP headers of botocore keyword arguments ``params`` of ``op``: :data:`HEADERS` rows in order, then
    the bucket options of :mod:`.objectopts` (falsy values are not sent). ConfigError for a keyword without a
    row: it would be dropped, not sent."""
    rows = HEADERS.get(op, ())
    options = OPTION_PARAMS.get(op, ())
    known = {h.param for h in rows} | set(options)
    unknown = sorted(name for name in params if name not in known)
    if unknown:
        raise ConfigError(
            f"the lean S3 client cannot send {', '.join(unknown)} with {op} (it sends only "
            f"{', '.join(sorted(known)) or 'no options'} there): map it in dcp_cloud/store/s3/headers.py, or use "
            'S3Config(client="botocore")'
        )
    headers = {h.wire: str(params[h.param]) for h in rows if params.get(h.param)}
    headers.update({WIRE[name]: wire_value(params[name]) for name in options if params.get(name) is not None})
    return headers


__all__ = ["HEADERS", "Header", "RequestOptions", "wire_headers"]
