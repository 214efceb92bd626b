"""What S3 answers, as the store reports it: ETags without quotes, times as epoch seconds."""

from __future__ import annotations

import email.utils
from typing import Any


def _etag(value: Any) -> str | None:
    return str(value).strip('"') if value else None


def _timestamp(value: Any) -> float | None:
    """Seconds since the epoch of a datetime boto3 parsed, if any."""
    return value.timestamp() if hasattr(value, "timestamp") else None


def _server_time(response: dict[str, Any]) -> float | None:
    """The server's clock when it answered (its Date header): the write time of a PUT/Complete,
    whose responses carry no Last-Modified (1 s resolution)."""
    date = response.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    try:
        return email.utils.parsedate_to_datetime(date).timestamp() if date else None
    except (TypeError, ValueError):
        return None
