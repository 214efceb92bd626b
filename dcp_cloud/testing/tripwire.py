"""Kill (or fail) a process at an exact store request, for crash-safety tests.

    backend = TripwireBackend(LocalBackend(), [Tripwire("put", "*/.metadata", action="kill")])
    manager = CheckpointManager("file:///tmp/run", backend=backend)  # in a spawned process
    manager.save(3, state)  # SIGKILLs its own process as the commit's PUT is about to be sent

A :class:`Tripwire` matches one operation of the store protocol (``put``,
``put_part``, ``complete_multipart``, ``list``, ``delete``, ``get``, ``head``...)
on keys matching a glob (for ``list``, the prefix listed; for ``delete``, any of
the keys), and fires on its ``nth`` match in the process: ``kill`` sends
SIGKILL to the process (nothing after it runs: no ``finally``, no atexit), ``fail``
raises a permanent StoreError. ``when="after"`` fires once the inner store has
done the request (the object is written; the answer never arrives).

The backend is a picklable recipe like every backend, so it reaches spawned
ranks and the process of a process-based ``async_save``; the match counts are
per process.
"""

from __future__ import annotations

import fnmatch
import os
import signal
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from ..config import RetryConfig, TransferConfig
from ..errors import StoreError
from ..store.protocol import ObjectStore
from ..store.wrapper import StoreWrapper

T = TypeVar("T")

_lock = threading.Lock()
#: Matches so far in this process, by tripwire.
_counts: dict[Tripwire, int] = {}


@dataclass(frozen=True)
class Tripwire:
    """Fire ``action`` at the ``nth`` request ``op`` on a key matching ``keys`` (a glob) in this process."""

    op: str
    keys: str = "*"
    nth: int = 1
    #: ``"kill"`` (SIGKILL this process) or ``"fail"`` (raise a permanent StoreError).
    action: str = "kill"
    #: ``"before"`` the request reaches the store, or ``"after"`` it was done.
    when: str = "before"
    #: Tells otherwise equal wires apart (each counts its own matches), e.g. in one process running many cases.
    tag: str = ""

    def __post_init__(self) -> None:
        if self.action not in ("kill", "fail") or self.when not in ("before", "after") or self.nth < 1:
            raise ValueError(f"bad tripwire {self!r}")

    def matches(self, op: str, keys: Sequence[str]) -> bool:
        return op == self.op and any(fnmatch.fnmatchcase(k, self.keys) for k in keys)


def fired(wire: Tripwire) -> int:
    """Matches of ``wire`` in this process so far."""
    with _lock:
        return _counts.get(wire, 0)


class TripwireStore(StoreWrapper):
    """A store that fires its tripwires (see the module docstring)."""

    def __init__(self, inner: ObjectStore, wires: Sequence[Tripwire]) -> None:
        super().__init__(inner)
        self.wires = tuple(wires)

    def _check(self, op: str, keys: Sequence[str], when: str) -> None:
        for wire in self.wires:
            if wire.when != when or not wire.matches(op, keys):
                continue
            with _lock:
                _counts[wire] = _counts.get(wire, 0) + 1
                hit = _counts[wire] == wire.nth
            if not hit:
                continue
            if wire.action == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise StoreError(f"tripwire {wire} fired on {op} {list(keys)[:3]}")

    def _keyed(self, op: str, keys: Sequence[str], fn: Callable[[], T]) -> T:
        self._check(op, keys, "before")
        result = fn()
        self._check(op, keys, "after")
        return result

    def put(self, key: str, data: Any, *, create_only: bool = False, crc32c: int | None = None) -> Any:
        return self._keyed("put", [key], lambda: self.inner.put(key, data, create_only=create_only, crc32c=crc32c))

    def read_into(self, key: str, start: int, outs: Any) -> None:
        self._keyed("read_into", [key], lambda: self.inner.read_into(key, start, outs))

    def get(self, key: str) -> bytes:
        return self._keyed("get", [key], lambda: self.inner.get(key))

    def head(self, key: str) -> Any:
        return self._keyed("head", [key], lambda: self.inner.head(key))

    def list(self, prefix: str) -> Any:
        return iter(self._keyed("list", [prefix], lambda: list(self.inner.list(prefix))))

    def delete(self, keys: Sequence[str]) -> None:
        self._keyed("delete", list(keys), lambda: self.inner.delete(keys))

    def create_multipart(self, key: str) -> str:
        return self._keyed("create_multipart", [key], lambda: self.inner.create_multipart(key))

    def put_part(self, key: str, upload_id: str, number: int, data: Any, *, crc32c: int | None = None) -> Any:
        return self._keyed("put_part", [key], lambda: self.inner.put_part(key, upload_id, number, data, crc32c=crc32c))

    def put_part_at(self, key: str, upload_id: str, number: int, offset: int, data: Any) -> Any:
        return self._keyed(
            "put_part",
            [key],
            lambda: self.inner.put_part_at(key, upload_id, number, offset, data),  # type: ignore[attr-defined]
        )

    def complete_multipart(self, key: str, upload_id: str, parts: Any, *, create_only: bool = False) -> Any:
        return self._keyed(
            "complete_multipart",
            [key],
            lambda: self.inner.complete_multipart(key, upload_id, parts, create_only=create_only),
        )

    def abort_multipart(self, key: str, upload_id: str) -> None:
        self._keyed("abort_multipart", [key], lambda: self.inner.abort_multipart(key, upload_id))

    def list_multipart(self, prefix: str) -> Any:
        return self._keyed("list_multipart", [prefix], lambda: self.inner.list_multipart(prefix))


@dataclass(frozen=True)
class TripwireBackend:
    """Opens ``inner``'s stores wrapped in :class:`TripwireStore` with ``wires``."""

    inner: Any
    wires: tuple[Tripwire, ...] = ()

    @property
    def schemes(self) -> tuple[str, ...]:
        return tuple(self.inner.schemes)

    def open_store(self, bucket: str, transfer: TransferConfig, retry: RetryConfig) -> ObjectStore:
        return TripwireStore(self.inner.open_store(bucket, transfer, retry), self.wires)


__all__ = ["Tripwire", "TripwireBackend", "TripwireStore", "fired"]
