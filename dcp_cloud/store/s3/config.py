"""S3Config: where and how to reach S3 (no credentials), validated when built."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

from ...errors import ConfigError
from ..protocol import PartLimits
from .objectopts import S3ObjectOptions

_ADDRESSING_STYLES = ("auto", "path", "virtual")
_CLIENTS = ("auto", "botocore", "lean")
_REGION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


@dataclass(frozen=True)
class S3Config:
    """Where and how to reach S3. Holds no credentials, by design.

    Every field left at ``None`` falls back to the standard AWS configuration
    (environment variables, then ``~/.aws/config``).
    """

    #: Endpoint of an S3-compatible server, e.g. ``"http://127.0.0.1:9000"``.
    #: ``None``: ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` / the profile's
    #: ``endpoint_url``, else AWS itself. Must be ``http(s)://host[:port][/path]``
    #: and must not carry credentials (``user:pass@``).
    endpoint_url: str | None = None
    #: Region to sign requests for, e.g. ``"us-east-1"``. ``None``:
    #: ``AWS_REGION`` / ``AWS_DEFAULT_REGION`` / the profile's ``region``.
    region: str | None = None
    #: Named profile of ``~/.aws/config`` to take credentials and settings
    #: from. ``None``: ``AWS_PROFILE``, else the default chain.
    profile: str | None = None
    #: ``"path"`` puts the bucket in the URL path (``host/bucket/key``), which
    #: most S3-compatible servers need; ``"virtual"`` puts it in the host name
    #: (``bucket.host/key``); ``"auto"`` lets boto3 (and ``~/.aws/config``) choose.
    addressing_style: Literal["auto", "path", "virtual"] = "auto"
    #: Send the CRC32C of every uploaded body (whole objects and parts) so the
    #: server rejects bytes corrupted in flight. Turn off for S3-compatible
    #: servers that reject the ``x-amz-checksum-crc32c`` header.
    transport_checksums: bool = True
    #: Which HTTP client sends the requests. ``"auto"``: the lean client
    #: (SigV4 over urllib3, built in about a millisecond; see
    #: ``dcp_cloud.store.s3.lean``) where an endpoint is given (here or in
    #: ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``), no profile is named and
    #: no proxy is set, else botocore. ``"botocore"``: always botocore, which
    #: reads every setting of ``~/.aws/config``. ``"lean"``: the lean client
    #: wherever it can (on AWS: ``https://s3.<region>.amazonaws.com``).
    client: Literal["auto", "botocore", "lean"] = "auto"
    #: Multipart size rules of an S3-compatible server whose rules differ from S3's (smallest part, largest
    #: part, most parts). ``None``: S3's (5 MiB, 5 GiB, 10,000 parts).
    part_limits: PartLimits | None = None
    #: Encryption (SSE-S3, SSE-KMS, SSE-C), storage class, tags, requester pays and expected bucket owner of
    #: every object and request: see :class:`~dcp_cloud.store.s3.objectopts.S3ObjectOptions`. ``None``: the
    #: bucket's defaults.
    object_options: S3ObjectOptions | None = None

    def __post_init__(self) -> None:
        if self.endpoint_url is not None:
            _require(
                isinstance(self.endpoint_url, str) and bool(self.endpoint_url),
                f"endpoint_url must be a non-empty string or None, got {self.endpoint_url!r}",
            )
            parts = urlsplit(self.endpoint_url)
            _require(
                parts.scheme in ("http", "https") and bool(parts.hostname),
                "endpoint_url must look like http(s)://host[:port], got a value without an http/https scheme or a host",
            )
            # Never echo the URL here: it may be the one carrying a secret.
            _require(
                parts.username is None and parts.password is None,
                "endpoint_url must not contain credentials (user:password@); "
                "use AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or a profile",
            )
            _require(
                not parts.query and not parts.fragment,
                f"endpoint_url must not have a query or fragment, got {self.endpoint_url!r}",
            )
        if self.region is not None:
            _require(
                isinstance(self.region, str) and bool(_REGION_RE.match(self.region)),
                f"region must be a region name like 'us-east-1' or None, got {self.region!r}",
            )
        if self.profile is not None:
            _require(
                isinstance(self.profile, str) and bool(self.profile.strip()),
                f"profile must be a non-empty profile name or None, got {self.profile!r}",
            )
        _require(
            self.addressing_style in _ADDRESSING_STYLES,
            f"addressing_style must be one of {_ADDRESSING_STYLES}, got {self.addressing_style!r}",
        )
        _require(self.client in _CLIENTS, f"client must be one of {_CLIENTS}, got {self.client!r}")
        _require(
            isinstance(self.transport_checksums, bool),
            f"transport_checksums must be a bool, got {self.transport_checksums!r}",
        )
        _require(
            self.part_limits is None or isinstance(self.part_limits, PartLimits),
            f"part_limits must be a PartLimits or None, got {type(self.part_limits).__name__}",
        )
        _require(
            self.object_options is None or isinstance(self.object_options, S3ObjectOptions),
            f"object_options must be an S3ObjectOptions or None, got {type(self.object_options).__name__}",
        )
        if self.object_options is not None:
            self.object_options.check_endpoint(self.endpoint_url)
