"""AWS Signature Version 4 for S3 requests, header-signed (what the lean client sends).

Only what S3 needs: ``host`` and every ``x-amz-*`` header are signed, the
payload is either its SHA-256 or ``UNSIGNED-PAYLOAD``. Checked against
botocore's signer in the tests. Secrets never leave this module's return
values except inside the ``Authorization`` header's HMAC.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import hmac
import threading
from collections.abc import Iterable, Mapping
from typing import NamedTuple
from urllib.parse import quote

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
UNSIGNED_PAYLOAD = "UNSIGNED-PAYLOAD"


class Credentials(NamedTuple):
    access_key: str
    secret_key: str
    token: str | None = None

    def __repr__(self) -> str:  # never print a secret
        return f"Credentials(access_key={self.access_key[:4]}…, secret_key=***, token={'***' if self.token else None})"


def payload_sha256(pieces: Iterable[bytes | bytearray | memoryview]) -> str:
    digest = hashlib.sha256()
    for piece in pieces:
        digest.update(piece)
    return digest.hexdigest()


def uri_encode_path(path: str) -> str:
    """A URL path as S3 signs it: every byte but unreserved ones and ``/`` percent-encoded, once."""
    return quote(path, safe="/~")


def canonical_query(params: Mapping[str, str]) -> str:
    return "&".join(f"{quote(k, safe='-_.~')}={quote(v, safe='-_.~')}" for k, v in sorted(params.items()))


_key_lock = threading.Lock()
_key_cache: dict[tuple[str, str, str, str], bytes] = {}


def _signing_key(secret: str, date: str, region: str, service: str) -> bytes:
    cache_key = (secret, date, region, service)
    with _key_lock:
        key = _key_cache.get(cache_key)
    if key is None:
        key = hmac.new(("AWS4" + secret).encode(), date.encode(), hashlib.sha256).digest()
        for part in (region, service, "aws4_request"):
            key = hmac.new(key, part.encode(), hashlib.sha256).digest()
        with _key_lock:
            if len(_key_cache) > 64:
                _key_cache.clear()
            _key_cache[cache_key] = key
    return key


def sign(
    method: str,
    host: str,
    path: str,
    query: Mapping[str, str],
    headers: dict[str, str],
    payload_hash: str,
    credentials: Credentials,
    region: str,
    *,
    now: _dt.datetime | None = None,
    service: str = "s3",
) -> None:
    """Add ``x-amz-date``, ``x-amz-content-sha256``, the token and ``Authorization`` to ``headers``.

    ``path`` is the already-encoded request path; ``headers`` use lower-case names.
    """
    moment = (now or _dt.datetime.now(_dt.timezone.utc)).strftime("%Y%m%dT%H%M%SZ")
    date = moment[:8]
    headers["x-amz-date"] = moment
    headers["x-amz-content-sha256"] = payload_hash
    if credentials.token:
        headers["x-amz-security-token"] = credentials.token
    signed = {"host": host}
    for name, value in headers.items():
        if name.startswith("x-amz-") or name in ("content-md5", "content-type"):
            signed[name] = " ".join(str(value).split())
    names = sorted(signed)
    canonical = "\n".join(
        [
            method,
            path,
            canonical_query(query),
            "".join(f"{n}:{signed[n]}\n" for n in names),
            ";".join(names),
            payload_hash,
        ]
    )
    scope = f"{date}/{region}/{service}/aws4_request"
    to_sign = f"AWS4-HMAC-SHA256\n{moment}\n{scope}\n{hashlib.sha256(canonical.encode()).hexdigest()}"
    signature = hmac.new(
        _signing_key(credentials.secret_key, date, region, service), to_sign.encode(), hashlib.sha256
    ).hexdigest()
    headers["authorization"] = (
        f"AWS4-HMAC-SHA256 Credential={credentials.access_key}/{scope}, "
        f"SignedHeaders={';'.join(names)}, Signature={signature}"
    )
