"""Readers' leases: a job loading a step says so, and retention leaves that step alone until it is done.

A load through the manager writes ``<root>/.readers/<step name>/<id>`` (a few
bytes of JSON: host, pid, step) before it reads, rewrites it every third of
``lease_ttl`` while the load runs, and deletes it after. Retention reads the
leases from the listing it makes anyway and keeps every step with a lease
younger than ``lease_ttl`` (by the store's clock against this machine's, as
gc ages objects); older leases are a crashed reader's and are deleted.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass

from ...errors import DcpCloudError
from ...store.protocol import ObjectInfo, ObjectStore

log = logging.getLogger("dcp_cloud.run")

#: Directory of the leases under a run's root.
LEASES_DIR = ".readers"


@dataclass(frozen=True)
class Lease:
    """One reader's lease on a step, as listed."""

    #: Name of the step directory it holds.
    name: str
    key: str
    #: When it was last written (store's clock), None if the store does not say.
    modified: float | None

    def expired(self, ttl: float, now: float) -> bool:
        return self.modified is not None and self.modified < now - ttl


def parse_lease(rest: str, obj: ObjectInfo) -> Lease | None:
    """The lease listed as ``<root>/.readers/<rest>`` (None for anything else there)."""
    name, slash, lease_id = rest.partition("/")
    if not slash or not name or not lease_id or "/" in lease_id:
        return None
    return Lease(name, obj.key, obj.modified)


class Holding:
    """A lease this process holds while it loads; :meth:`release` ends it (idempotent)."""

    def __init__(self, store: ObjectStore, key: str, body: bytes, ttl: float) -> None:
        self.store = store
        self.key = key
        self._body = body
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if ttl > 0:
            self._thread = threading.Thread(
                target=self._refresh, args=(ttl / 3.0,), name="dcp-cloud-lease", daemon=True
            )
            self._thread.start()

    def _refresh(self, every: float) -> None:
        while not self._stop.wait(every):
            try:
                self.store.put(self.key, self._body)
            except DcpCloudError as exc:  # the load goes on; retention may treat the lease as stale later
                log.warning("could not refresh the reader's lease %s: %s", self.store.url(self.key), exc)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        try:
            self.store.delete([self.key])
        except DcpCloudError as exc:
            log.warning(
                "could not delete the reader's lease %s (%s): retention ignores it once it is older than the "
                "lease's time to live",
                self.store.url(self.key),
                exc,
            )


def take(store: ObjectStore, list_prefix: str, name: str, step: int, ttl: float) -> Holding:
    """Write a lease on the step directory ``name`` (one PUT) and keep it fresh until released."""
    key = f"{list_prefix}{LEASES_DIR}/{name}/{uuid.uuid4().hex}"
    body = json.dumps({"step": step, "host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}).encode()
    store.put(key, body)
    return Holding(store, key, body, ttl)


__all__ = ["LEASES_DIR", "Holding", "Lease", "parse_lease", "take"]
