"""Transfer statistics: bytes, requests, retries and time, per writer/reader."""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field


@dataclass(frozen=True)
class TransferStats:
    """A snapshot of what one save or load moved (this process only)."""

    bytes_written: int = 0
    bytes_read: int = 0
    #: Requests attempted, by operation ("put", "put_part", "read", ...).
    requests: dict[str, int] = field(default_factory=dict)
    retries: int = 0
    seconds: float = 0.0
    #: Peak bytes leased from the memory budget.
    peak_buffer_bytes: int = 0
    #: Of ``bytes_read``, the bytes of shard objects' index footers (raw offsets and checksums).
    index_bytes_read: int = 0
    #: Incremental saves (``base=``): bytes of this process's items found unchanged and stored as references
    #: to the base's bytes, not uploaded.
    bytes_reused: int = 0
    #: Incremental saves: bytes of this process's items uploaded without a comparison because the base
    #: records no content hash for them (saved with ``hashes=False``, or by an older version).
    base_unchecked_bytes: int = 0

    @property
    def total_requests(self) -> int:
        return sum(self.requests.values())

    @property
    def throughput_mb_s(self) -> float:
        moved = self.bytes_written + self.bytes_read
        return moved / 1e6 / self.seconds if self.seconds > 0 else 0.0


class StatsRecorder:
    """Thread-safe counters behind :class:`TransferStats`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self._written = 0
            self._read = 0
            self._index_read = 0
            self._reused = 0
            self._unchecked = 0
            self._requests: Counter[str] = Counter()
            self._retries = 0
            self._start = time.perf_counter()
            self._seconds = 0.0

    def restart_clock(self) -> None:
        """Time from now on, keeping the counters."""
        with self._lock:
            self._start = time.perf_counter()

    def on_attempt(self, op: str) -> None:
        with self._lock:
            self._requests[op] += 1

    def on_retry(self, op: str, exc: BaseException) -> None:
        with self._lock:
            self._retries += 1

    def add_written(self, n: int) -> None:
        with self._lock:
            self._written += n

    def add_read(self, n: int) -> None:
        with self._lock:
            self._read += n

    def add_index_read(self, n: int) -> None:
        """``n`` of the bytes read were index footers (already counted by :meth:`add_read`)."""
        with self._lock:
            self._index_read += n

    def add_reused(self, n: int) -> None:
        """``n`` bytes were not uploaded: the base holds them (an incremental save)."""
        with self._lock:
            self._reused += n

    def add_unchecked(self, n: int) -> None:
        """``n`` bytes were uploaded because the base records no hash to compare them with."""
        with self._lock:
            self._unchecked += n

    def stop_clock(self) -> None:
        with self._lock:
            self._seconds = time.perf_counter() - self._start

    def snapshot(self, peak_buffer_bytes: int = 0) -> TransferStats:
        with self._lock:
            return TransferStats(
                bytes_written=self._written,
                bytes_read=self._read,
                requests=dict(self._requests),
                retries=self._retries,
                seconds=self._seconds,
                peak_buffer_bytes=peak_buffer_bytes,
                index_bytes_read=self._index_read,
                bytes_reused=self._reused,
                base_unchecked_bytes=self._unchecked,
            )
