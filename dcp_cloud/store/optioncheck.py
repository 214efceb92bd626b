"""The checks the clouds' object options share (``S3ObjectOptions``, ``GCSObjectOptions``,
``AzureObjectOptions``): a customer-supplied key, the endpoint it may go to, tags. Each raises ConfigError
with a message that never shows the key."""

from __future__ import annotations

import re
from collections.abc import Mapping
from urllib.parse import urlsplit

from ..errors import ConfigError


def require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def check_customer_key(key: object, field: str) -> None:
    """``key`` (the ``field`` of some options) is a 32-byte AES-256 key."""
    require(
        isinstance(key, bytes) and len(key) == 32, f"{field} must be 32 bytes (an AES-256 key), e.g. os.urandom(32)"
    )


def check_key_endpoint(endpoint: str | None, what: str, allowance: str) -> None:
    """A customer key (``what``, e.g. ``"sse_customer_key (SSE-C)"``) goes to ``endpoint`` only over https, unless
    the options' ``allowance`` (``"S3ObjectOptions(allow_sse_customer_key_over_http=True)"``) is given."""
    if endpoint is not None and urlsplit(endpoint).scheme != "https":
        raise ConfigError(
            f"{what} is sent only over https: the endpoint is plain http; for an emulator set {allowance}"
        )


def check_tags(tags: object, cloud: str, noun: str, pattern: re.Pattern[str], characters: str) -> dict[str, str]:
    """``tags`` as a plain dict after the rules ``cloud`` has for the tags of a ``noun`` (at most 10, keys of 1-128
    characters, values of 0-256, every character matching ``pattern``, which ``characters`` spells out)."""
    require(isinstance(tags, Mapping), f"tags must be a dict of str to str, got {tags!r}")
    assert isinstance(tags, Mapping)
    require(len(tags) <= 10, f"{cloud} allows at most 10 tags per {noun}, got {len(tags)}")
    for k, v in tags.items():
        require(
            isinstance(k, str) and isinstance(v, str) and 1 <= len(k) <= 128 and len(v) <= 256,
            f"tags must map keys of 1-128 characters to values of 0-256, got {k!r}: {v!r}",
        )
        require(
            bool(pattern.match(k) and pattern.match(v)),
            f"tag {k!r}: {v!r} has a character {cloud} refuses in tags: use {characters} only",
        )
    return dict(tags)


__all__ = ["check_customer_key", "check_key_endpoint", "check_tags", "require"]
