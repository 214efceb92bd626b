"""A byte budget that caps the host memory held by in-flight transfers.

Every part buffer and every scratch buffer of the engine is leased from one
:class:`ByteBudget`; a lease blocks while the budget is spent, so peak extra
memory is the budget, whatever the shard size.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from ..errors import ConfigError


class ByteBudget:
    """A counting semaphore over bytes, with the peak recorded."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ConfigError(f"memory budget must be positive, got {capacity}")
        self.capacity = capacity
        self._used = 0
        self.peak = 0
        self._cond = threading.Condition()

    @property
    def used(self) -> int:
        return self._used

    def acquire(self, nbytes: int) -> None:
        """Block until ``nbytes`` fit; a single lease larger than the capacity waits for an empty budget.

        Leases are released by transfers that always end (in success or
        failure), so a waiter never waits forever.
        """
        need = min(nbytes, self.capacity)
        with self._cond:
            while self._used > 0 and self._used + need > self.capacity:
                self._cond.wait()
            self._used += nbytes
            self.peak = max(self.peak, self._used)

    def release(self, nbytes: int) -> None:
        with self._cond:
            self._used -= nbytes
            self._cond.notify_all()

    @contextmanager
    def lease(self, nbytes: int) -> Iterator[None]:
        self.acquire(nbytes)
        try:
            yield
        finally:
            self.release(nbytes)


class BufferPool:
    """Reusable fixed-size buffers drawn from a :class:`ByteBudget`.

    Reuse avoids faulting in fresh pages for every part; buffers beyond
    ``keep`` are dropped on release so an idle pool holds little memory.
    A fresh buffer is an anonymous mapping, so only the pages written become
    resident: a part buffer that holds a few KiB of headers before the
    tensor bytes that follow them go out in place (see
    :meth:`~dcp_cloud.transfer.upload.ObjectWriter.write_view`) costs those
    pages, not ``size`` bytes (``bytearray(size)`` zero-fills them all).
    """

    def __init__(self, budget: ByteBudget, size: int, keep: int) -> None:
        self.budget = budget
        self.size = size
        self._keep = keep
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()

    def get(self) -> mmap.mmap:
        self.budget.acquire(self.size)
        with self._lock:
            if self._free:
                return self._free.pop()
        return mmap.mmap(-1, self.size)

    def put(self, buf: mmap.mmap) -> None:
        with self._lock:
            if len(self._free) < self._keep:
                self._free.append(buf)
        self.budget.release(self.size)

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
