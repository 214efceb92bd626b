"""The transfer engine shared by every store: bounded-memory uploads and parallel scatter reads.

One engine per writer/reader per process. It owns the worker threads, the
byte budget and the statistics, and sees the store only through the retry
wrapper, so every request of every backend goes through the one retry loop.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from ..config import RetryConfig, TransferConfig
from ..store.protocol import ObjectStore
from ..store.retry import RetryHooks, RetryingStore
from .budget import BufferPool, ByteBudget
from .ranges import plan_part_size
from .stats import StatsRecorder, TransferStats

T = TypeVar("T")


def split_outs(outs: Sequence[memoryview], chunk: int) -> list[tuple[int, list[memoryview]]]:
    """Cut a scatter list into consecutive pieces of at most ``chunk`` bytes.

    Returns ``(offset_of_piece, outs_of_piece)`` pairs; memoryviews that cross
    a boundary are sliced, never copied.
    """
    pieces: list[tuple[int, list[memoryview]]] = []
    current: list[memoryview] = []
    filled = 0
    offset = 0
    for out in outs:
        view = out
        while len(view):
            take = min(len(view), chunk - filled)
            current.append(view[:take])
            view = view[take:]
            filled += take
            if filled == chunk:
                pieces.append((offset, current))
                offset += filled
                current, filled = [], 0
    if current:
        pieces.append((offset, current))
    return pieces


class TransferEngine:
    """Worker threads + byte budget + retries + statistics over one ObjectStore."""

    def __init__(
        self,
        store: ObjectStore,
        config: TransferConfig,
        retry: RetryConfig,
        *,
        hooks: RetryHooks | None = None,
        recorder: StatsRecorder | None = None,
    ) -> None:
        self.config = config
        self.recorder = recorder or StatsRecorder()
        hooks = hooks or RetryHooks()
        hooks.on_attempt = self.recorder.on_attempt
        hooks.on_retry = self.recorder.on_retry
        self.store = RetryingStore(store, retry, hooks)
        self.budget = ByteBudget(config.memory_budget)
        self._pools: dict[int, BufferPool] = {}
        self._pools_lock = threading.Lock()
        self._executor = ThreadPoolExecutor(config.concurrency, thread_name_prefix="dcp_cloud")

    # -- shared plumbing --------------------------------------------------
    @property
    def stats(self) -> StatsRecorder:
        return self.recorder

    def snapshot(self) -> TransferStats:
        return self.recorder.snapshot(peak_buffer_bytes=self.budget.peak)

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        return self._executor.submit(fn, *args)

    def pool(self, size: int) -> BufferPool:
        with self._pools_lock:
            pool = self._pools.get(size)
            if pool is None:
                pool = BufferPool(self.budget, size, keep=max(1, self.config.memory_budget // size))
                self._pools[size] = pool
            return pool

    def close(self) -> None:
        """Stop the worker threads and drop pooled buffers (the store stays open for reuse)."""
        self._executor.shutdown(wait=True)
        with self._pools_lock:
            for pool in self._pools.values():
                pool.clear()

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- uploads ----------------------------------------------------------
    # The stream that uploads one object is dcp_cloud.transfer.upload.open_writer(engine, key, size_hint):
    # upload builds on the engine, never the other way round.
    def part_size_for(self, size_hint: int | None) -> int:
        return plan_part_size(size_hint, self.config.part_size, self.store.limits)

    # -- reads ------------------------------------------------------------
    def read(
        self,
        key: str,
        start: int,
        outs: Sequence[memoryview],
        *,
        align: int = 1,
        check: Callable[[int, list[memoryview]], None] | None = None,
    ) -> list[Future[None]]:
        """Scatter-read ``key`` from ``start`` into ``outs``, in parallel pieces of ``read_chunk_size``.

        Pieces are cut at multiples of ``align`` from ``start`` (e.g. the
        checksum block size, so each piece holds whole blocks). ``check``, if
        given, is called by the worker that read a piece, with the piece's
        offset from ``start`` and its views, so verification runs in parallel
        and overlaps the reads still in flight.
        """
        chunk = self.config.read_chunk_size
        if align > 1:
            chunk = max(align, chunk // align * align)
        futures = []
        for offset, piece in split_outs(outs, chunk):
            futures.append(self.submit(self._read_piece, key, start + offset, piece, offset, check))
        return futures

    def read_at(
        self,
        key: str,
        start: int,
        outs: Sequence[memoryview],
        *,
        check: Callable[[int, list[memoryview]], None] | None = None,
    ) -> Future[None]:
        """Scatter-read ``key`` from ``start`` into ``outs`` with exactly one request (the caller sized it).

        ``check`` is called as for :meth:`read` (offset 0, all of ``outs``).
        """
        return self.submit(self._read_piece, key, start, list(outs), 0, check)

    def _read_piece(
        self,
        key: str,
        start: int,
        outs: list[memoryview],
        offset: int,
        check: Callable[[int, list[memoryview]], None] | None,
    ) -> None:
        self.store.read_into(key, start, outs)
        self.recorder.add_read(sum(len(o) for o in outs))
        if check is not None:
            check(offset, outs)
