"""One SDK client per configuration per process, shared by every store that needs it.

A training job makes a new ``S3Writer(f".../step-{n}")`` for every
checkpoint. Without sharing, each one built its own boto3 (or
google-cloud-storage) client: tens of milliseconds of CPU, and a fresh
connection pool, so every checkpoint paid its TCP (and TLS) handshakes again.
With this cache the second and later checkpoints of a process reuse the
first one's client and its warm keep-alive connections.

The key is everything a client is built from: the store's frozen config, its
timeouts and pool size, and the environment variables the SDK reads
(``AWS_*``, ``GOOGLE_*``, ``STORAGE_EMULATOR_HOST``, ``AZURE_*``), so a changed endpoint or
credential in the environment builds a new client. Only a digest of the
environment is kept, never its values. A forked child drops (never closes) its
parent's clients, whose sockets it must not share. A store keeps using the
client it first got, even if the environment changes later. :func:`close_clients`
closes them all, e.g. between tests or before a long idle period.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable, Hashable
from typing import Any

#: Environment variables that decide how an SDK client is built.
_ENV_PREFIXES = ("AWS_", "GOOGLE_", "GCE_", "STORAGE_EMULATOR_HOST", "CLOUDSDK_", "AZURE_")

_lock = threading.Lock()
_clients: dict[Hashable, Any] = {}


def _after_fork_in_child() -> None:
    """A forked child drops (never closes) the parent's clients: their sockets are the parent's."""
    global _lock
    _lock = threading.Lock()  # another thread may have held it at the fork
    _clients.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def environment_digest() -> str:
    """A digest of the SDK-relevant environment (values are hashed, never stored)."""
    hasher = hashlib.sha256()
    for name in sorted(os.environ):
        if name.startswith(_ENV_PREFIXES):
            hasher.update(name.encode())
            hasher.update(b"\0")
            hasher.update(os.environ[name].encode("utf-8", "surrogateescape"))
            hasher.update(b"\0")
    return hasher.hexdigest()


def shared_client(key: Hashable, make: Callable[[], Any]) -> Any:
    """The process's client for ``key`` (plus the environment), built with ``make`` the first time."""
    full_key = (key, environment_digest())
    with _lock:
        client = _clients.get(full_key)
        if client is None:
            client = _clients[full_key] = make()
        return client


def close_clients() -> int:
    """Close every shared client of this process (they are rebuilt on next use); returns how many."""
    with _lock:
        clients = list(_clients.values())
        _clients.clear()
    for client in clients:
        close = getattr(client, "close", None)
        if close is not None:
            try:
                close()
            except Exception:  # noqa: BLE001, S110 - closing is best effort
                pass
    return len(clients)
