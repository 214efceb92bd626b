"""What a store's S3 client is built from: which client it takes (the lean one or botocore's), the lean
client's settings and credentials, and botocore's client, built for dcp_cloud's retry loop and checksums."""

from __future__ import annotations

import os
import socket
import threading
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from .config import S3Config
from .sigv4 import Credentials

#: Environment variables under which botocore would route through a proxy (the lean client does not).
_PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy")


@dataclass(frozen=True)
class LeanSettings:
    """Everything the lean client needs that is not a credential."""

    endpoint_url: str
    region: str
    path_style: bool
    ca_bundle: str | None


def _endpoint_from_env() -> str | None:
    if os.environ.get("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "").lower() == "true":
        return None
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def lean_settings(config: S3Config) -> LeanSettings | None:
    """The lean client's settings, or None where the store should build a botocore client.

    ``client="botocore"`` always gives None. ``"auto"`` (the default) takes the
    lean client where its behaviour is botocore's without reading
    ``~/.aws/config``: an endpoint given in the config or the environment
    (``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``), no named profile, and no
    proxy variables. ``"lean"`` takes it wherever it can: on AWS itself the
    endpoint is ``https://s3.<region>.amazonaws.com``.
    """
    if config.client == "botocore":
        return None
    endpoint = config.endpoint_url or _endpoint_from_env()
    if config.client == "auto":
        profile = config.profile or os.environ.get("AWS_PROFILE")
        if endpoint is None or profile or any(os.environ.get(v) for v in _PROXY_VARS):
            return None
    region = config.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    if endpoint is None:
        endpoint = f"https://s3.{region}.amazonaws.com"
    host = urlsplit(endpoint).hostname or ""
    path_style = config.addressing_style == "path" or (config.addressing_style == "auto" and _is_ip(host))
    return LeanSettings(endpoint.rstrip("/"), region, path_style, os.environ.get("AWS_CA_BUNDLE") or None)


def _is_ip(host: str) -> bool:
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, host)
            return True
        except OSError:
            continue
    return False


class _Credentials:
    """Static keys from the environment when present; otherwise botocore's provider chain (built once)."""

    def __init__(self, profile: str | None) -> None:
        self._profile = profile
        self._lock = threading.Lock()
        self._static: Credentials | None = None
        self._provider: Any = None
        key, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
        if profile is None and key and secret:
            self._static = Credentials(key, secret, os.environ.get("AWS_SESSION_TOKEN") or None)

    def get(self) -> Credentials:
        if self._static is not None:
            return self._static
        with self._lock:
            if self._provider is None:
                import botocore.session
                from botocore.exceptions import NoCredentialsError

                provider = botocore.session.Session(profile=self._profile).get_credentials()
                if provider is None:
                    raise NoCredentialsError()
                self._provider = provider
        frozen = self._provider.get_frozen_credentials()
        return Credentials(frozen.access_key, frozen.secret_key, frozen.token)


_loader_lock = threading.Lock()
_loader: Any = None


def _shared_loader() -> Any:
    """One botocore data loader per process (its model cache makes clients cheap)."""
    global _loader
    with _loader_lock:
        if _loader is None:
            from botocore.loaders import create_loader

            _loader = create_loader()
        return _loader


def _unsigned_payload_over_tls(client: Any, transport_checksums: bool) -> None:
    """Over HTTPS, with a CRC32C header on every upload, send bodies as UNSIGNED-PAYLOAD.

    botocore skips the SHA-256 pass over a body (one more read of every
    byte, in Python-sized pieces) when the connection is TLS and the body
    carries a checksum header, but it only sees checksums it computed itself:
    with the CRC32C this store sends, it hashed every part anyway. TLS
    protects the body in flight and the server checks the CRC32C, the
    combination botocore itself deems enough. Plain ``http://`` keeps the
    signed payload (nothing else protects the body there), and so does a
    store without transport checksums.
    """
    if not (transport_checksums and str(client.meta.endpoint_url).startswith("https://")):
        return
    config = client.meta.config  # what the signer reads, per request, from the request context
    config.s3 = {**(config.s3 or {}), "payload_signing_enabled": False}


def make_botocore_client(config: S3Config, request_timeout: float, max_connections: int) -> Any:
    """A botocore S3 client that never retries on its own (store/retry.py does) and computes no checksums."""
    import botocore.session
    from botocore.config import Config

    s3_options: dict[str, Any] = {}
    if config.addressing_style != "auto":
        s3_options["addressing_style"] = config.addressing_style
    boto_config = Config(
        retries={"total_max_attempts": 1, "mode": "standard"},
        connect_timeout=request_timeout,
        read_timeout=request_timeout,
        max_pool_connections=max_connections,
        tcp_keepalive=True,
        # boto3's default (a CRC32 of every body, computed in Python) halves
        # single-PUT throughput; we send CRC32C ourselves where we have it.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        user_agent_extra="dcp_cloud",
        s3=s3_options or None,
    )
    session = botocore.session.Session(profile=config.profile)
    # Parsed service models are shared: a fresh loader costs ~50 ms per client.
    session.register_component("data_loader", _shared_loader())
    # botocore reads AWS_DEFAULT_REGION and the profile but not AWS_REGION,
    # which the other AWS SDKs give precedence; honour it the same way.
    region = config.region or os.environ.get("AWS_REGION") or None
    client = session.create_client("s3", region_name=region, endpoint_url=config.endpoint_url, config=boto_config)
    _unsigned_payload_over_tls(client, config.transport_checksums)
    return client
