"""The little XML that S3 answers and asks for, read with the standard library as botocore reads it.

Element names are matched by their local name whatever their namespace:
AWS answers in ``http://s3.amazonaws.com/doc/2006-03-01/``, s3rver in
``http://doc.s3.amazonaws.com/2006-03-01/``, other servers in none at all,
and botocore ignores namespaces too. A body that must be XML and is not, or
whose root is not the element the request answers with (or ``<{Operation}Response>``, the
root moto up to 5.2.1 answers CompleteMultipartUpload with), raises
:class:`MalformedResponseError` (the store translates it, as it does
botocore's own ``ResponseParserError``); it never reads as an empty result.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Iterator
from typing import Any
from xml.etree import ElementTree

#: The namespace of the request bodies the client sends (AWS's).
_XMLNS = 'xmlns="http://s3.amazonaws.com/doc/2006-03-01/"'


class MalformedResponseError(ValueError):
    """A body the S3 client cannot read: not XML, or not the element the request answers with."""


def _local(tag: object) -> str:
    """``{namespace}Name`` -> ``Name`` (comments and processing instructions have no str tag)."""
    return tag.rpartition("}")[2] if isinstance(tag, str) else ""


def _children(node: ElementTree.Element | None, name: str) -> Iterator[ElementTree.Element]:
    """Direct children of ``node`` whose local name is ``name``."""
    if node is None:
        return
    for child in node:
        if _local(child.tag) == name:
            yield child


def _text(node: ElementTree.Element | None, name: str) -> str | None:
    """Text of the first direct child of ``node`` named ``name`` (None if there is none)."""
    for child in _children(node, name):
        return child.text or ""
    return None


def _is(node: ElementTree.Element | None, name: str) -> bool:
    return node is not None and _local(node.tag) == name


def _parse_xml(data: bytes) -> ElementTree.Element | None:
    """The root of ``data``, or None when it is empty or not XML (for bodies that may be either)."""
    if not data:
        return None
    try:
        return ElementTree.fromstring(data)
    except ElementTree.ParseError:
        return None


def _parse_expected(data: bytes, root: str, operation: str) -> ElementTree.Element:
    """The root of a body that must be the XML element ``root``; MalformedResponseError otherwise.

    ``<{operation}Response>`` with the same children is accepted as well: servers whose answers are
    generated from a generic serializer (moto up to 5.2.1) wrap them so, and botocore, which reads the
    children whatever the root is called, accepts them. Messages say what was wrong, never what the body held.
    """
    node = _parse_xml(data)
    if node is None:
        what = "an empty body" if not data else f"{len(data)} bytes that are not XML"
        raise MalformedResponseError(f"{operation}: the server answered with {what}, not <{root}>")
    if not (_is(node, root) or _is(node, f"{operation}Response")):
        raise MalformedResponseError(f"{operation}: the server answered <{_local(node.tag)}>, not <{root}>")
    return node


def _iso_time(value: str | None) -> _dt.datetime | None:
    if not value:
        return None
    try:
        return _dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


# -- the answers the lean client reads, in botocore's shapes --------------------------------------------


def parse_error(data: bytes) -> tuple[str | None, str]:
    """(code, message) of an error body; (None, "") where it is not an ``<Error>`` (the status tells then)."""
    root = _parse_xml(data)
    if not _is(root, "Error"):
        return None, ""
    return _text(root, "Code") or None, _text(root, "Message") or ""


def parse_initiate(data: bytes) -> str:
    """The UploadId of a CreateMultipartUpload answer."""
    root = _parse_expected(data, "InitiateMultipartUploadResult", "CreateMultipartUpload")
    upload_id = _text(root, "UploadId")
    if not upload_id:
        raise MalformedResponseError("CreateMultipartUpload: the answer holds no UploadId")
    return upload_id


def parse_complete(data: bytes) -> dict[str, Any]:
    """``{"ETag": ...}`` of a CompleteMultipartUpload answer, or ``{"Error": {...}}`` where S3 failed the
    completion with a 200 and an ``<Error>`` body. (Ceph RGW 16 answers an empty ETag.)"""
    root = _parse_xml(data)
    if _is(root, "Error"):
        return {"Error": {"Code": _text(root, "Code") or "InternalError", "Message": _text(root, "Message") or ""}}
    root = _parse_expected(data, "CompleteMultipartUploadResult", "CompleteMultipartUpload")
    return {"ETag": _text(root, "ETag") or None}


def parse_delete(data: bytes) -> list[dict[str, str | None]]:
    """The per-key failures of a DeleteObjects answer (an empty body: none)."""
    if not data:  # a quiet delete without failures may answer with no body at all
        return []
    root = _parse_expected(data, "DeleteResult", "DeleteObjects")
    return [{name: _text(node, name) for name in ("Key", "Code", "Message")} for node in _children(root, "Error")]


def parse_list_v2(data: bytes) -> dict[str, Any]:
    """A ListObjectsV2 page: ``Contents`` (Key, Size, ETag, LastModified), ``IsTruncated``,
    ``NextContinuationToken`` and, where the server sends it, ``KeyCount``."""
    root = _parse_expected(data, "ListBucketResult", "ListObjectsV2")
    contents = []
    for node in _children(root, "Contents"):
        key = _text(node, "Key")
        if key is None:
            raise MalformedResponseError("ListObjectsV2: a <Contents> entry holds no <Key>")
        size = (_text(node, "Size") or "0").strip()
        if not size.isdigit():
            raise MalformedResponseError("ListObjectsV2: a <Contents> entry has a <Size> that is not a number")
        contents.append(
            {"Key": key, "Size": int(size), "ETag": _text(node, "ETag"),
             "LastModified": _iso_time(_text(node, "LastModified"))}
        )  # fmt: skip
    page: dict[str, Any] = {
        "Contents": contents,
        "IsTruncated": (_text(root, "IsTruncated") or "false").strip().lower() == "true",
        "NextContinuationToken": _text(root, "NextContinuationToken") or None,
    }
    key_count = (_text(root, "KeyCount") or "").strip()
    if key_count.isdigit():
        page["KeyCount"] = int(key_count)
    return page
