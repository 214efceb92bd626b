"""Whether a failed request's exception chain holds a TLS certificate check (not a dropped connection).

One walk for every backend's error translation: a certificate failure gets its own actionable message
(point the CA bundle at the right file) instead of being retried as a transient connection error.
"""

from __future__ import annotations

import ssl
from typing import Any


def caused_by_cert_failure(exc: BaseException) -> bool:
    """True if an ``ssl.SSLCertVerificationError`` is anywhere behind ``exc``: its causes and contexts, the
    ``reason`` of urllib3's errors, exception arguments, and botocore's ``kwargs["error"]``."""
    seen: set[int] = set()
    todo: list[Any] = [exc]
    while todo:
        cur = todo.pop()
        if not isinstance(cur, BaseException) or id(cur) in seen:
            continue
        seen.add(id(cur))
        if isinstance(cur, ssl.SSLCertVerificationError):
            return True
        todo.extend([cur.__cause__, cur.__context__, getattr(cur, "reason", None), *cur.args])
        kwargs = getattr(cur, "kwargs", None)
        if isinstance(kwargs, dict):
            todo.append(kwargs.get("error"))
    return False
