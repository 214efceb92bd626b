"""The little XML that S3 answers and asks for, read with the standard library."""

from __future__ import annotations

import datetime as _dt
from xml.etree import ElementTree

_NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"
_XMLNS = 'xmlns="http://s3.amazonaws.com/doc/2006-03-01/"'


def _text(node: ElementTree.Element | None, name: str) -> str | None:
    if node is None:
        return None
    found = node.find(_NS + name)
    if found is None:
        found = node.find(name)
    return found.text if found is not None else None


def _parse_xml(data: bytes) -> ElementTree.Element | None:
    if not data:
        return None
    try:
        return ElementTree.fromstring(data)
    except ElementTree.ParseError:
        return None


def _iso_time(value: str | None) -> _dt.datetime | None:
    if not value:
        return None
    try:
        return _dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
