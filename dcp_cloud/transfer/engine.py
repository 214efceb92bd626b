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

#: A reader's engine runs up to this many times ``concurrency`` reads at once while they are small (see
#: :class:`ReadGate`).
READ_BURST = 2


class ReadGate:
    """How many reads run at once: up to ``base`` whatever their size, and up to ``most`` while the bytes in
    flight stay within ``target`` (``base`` full-size requests).

    A request waits ~20-50 ms for its first byte on S3 or GCS, about as long as one connection takes to move
    2-4 MiB: a connection reading 16 MiB requests moves bytes ~80% of the time, one reading 2 MiB pieces
    (a resharded load: a rank's rows of every tensor of an object, each a separate range) under half of it.
    Keeping as many *bytes* in flight as ``base`` full-size requests would, on up to ``most`` connections,
    gives small requests the connections their waits need while large ones keep ``base``.
    """

    def __init__(self, base: int, most: int, target: int) -> None:
        self.base, self.most, self.target = base, most, target
        self.count = self.bytes = self.peak = 0
        self._cond = threading.Condition()

    def enter(self, nbytes: int) -> None:
        with self._cond:
            while not (self.count < self.base or (self.count < self.most and self.bytes + nbytes <= self.target)):
                self._cond.wait()
            self.count += 1
            self.bytes += nbytes
            self.peak = max(self.peak, self.count)

    def leave(self, nbytes: int) -> None:
        with self._cond:
            self.count -= 1
            self.bytes -= nbytes
            self._cond.notify_all()


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
        read_burst: int = 1,
    ) -> None:
        """``read_burst`` > 1 (a reader's engine): up to ``read_burst * concurrency`` worker threads, and reads
        through a :class:`ReadGate` that runs more than ``concurrency`` of them at once only while they are
        small. Uploads keep ``concurrency`` (their part buffers bound them anyway)."""
        self.config = config
        self.recorder = recorder or StatsRecorder()
        hooks = hooks or RetryHooks()
        hooks.on_attempt = self.recorder.on_attempt
        hooks.on_retry = self.recorder.on_retry
        self.store = RetryingStore(store, retry, hooks)
        self.budget = ByteBudget(config.memory_budget)
        self._pools: dict[int, BufferPool] = {}
        self._pools_lock = threading.Lock()
        most = config.concurrency * max(1, read_burst)
        #: The reads' gate (None: at most ``concurrency`` run at once, one per worker thread).
        self.gate = (
            ReadGate(config.concurrency, most, config.concurrency * config.read_chunk_size) if read_burst > 1 else None
        )
        self._executor = ThreadPoolExecutor(most, thread_name_prefix="dcp_cloud")

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
        stages: Sequence[tuple[int, Callable[[], None]]] = (),
    ) -> Future[None]:
        """Scatter-read ``key`` from ``start`` into ``outs`` with exactly one request (the caller sized it).

        ``check`` is called as for :meth:`read` (offset 0, all of ``outs``). ``stages`` (only where the store
        has ``capabilities.staged_reads``): ``(end, fn)`` pairs, in order of ``end`` (offsets into ``outs``); the read
        stops at each ``end`` to call ``fn`` before it goes on.
        """
        return self.submit(self._read_piece, key, start, list(outs), 0, check, stages)

    def _read_piece(
        self,
        key: str,
        start: int,
        outs: list[memoryview],
        offset: int,
        check: Callable[[int, list[memoryview]], None] | None,
        stages: Sequence[tuple[int, Callable[[], None]]] = (),
    ) -> None:
        nbytes = sum(len(o) for o in outs)
        gate = self.gate
        if gate is None:
            self._read(key, start, outs, stages)
        else:
            gate.enter(nbytes)
            try:
                self._read(key, start, outs, stages)
            finally:
                gate.leave(nbytes)
        self.recorder.add_read(nbytes)
        if check is not None:
            check(offset, outs)

    def _read(
        self, key: str, start: int, outs: list[memoryview], stages: Sequence[tuple[int, Callable[[], None]]]
    ) -> None:
        if stages:
            self.store.read_into(key, start, outs, stages)
        else:
            self.store.read_into(key, start, outs)
