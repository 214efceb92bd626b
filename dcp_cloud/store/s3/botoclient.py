"""The botocore S3 client of a store: built for dcp_cloud's retry loop and checksums."""

from __future__ import annotations

import os
import threading
from typing import Any

from .config import S3Config

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
