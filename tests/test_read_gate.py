"""A reader's engine runs more small reads at once than ``concurrency``, and no more large ones.

A resharded load reads a rank's rows of every tensor of an object as separate ranges of a few MiB, each
waiting as long for its first byte as a full-size request; the engine keeps as many *bytes* in flight as
``concurrency`` full-size requests would, on up to ``READ_BURST * concurrency`` connections.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import pytest

from dcp_cloud import RetryConfig, TransferConfig
from dcp_cloud.store.memory import MemoryStore
from dcp_cloud.transfer.engine import READ_BURST, ReadGate, TransferEngine

KiB = 1024


class SlowStore(MemoryStore):
    """Every read waits ``delay`` seconds (a request's first-byte wait) and counts the reads in flight."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay
        self.now = self.peak = 0
        self._count = threading.Lock()

    def read_into(self, key: str, start: int, outs: Sequence[memoryview]) -> None:
        with self._count:
            self.now += 1
            self.peak = max(self.peak, self.now)
        try:
            time.sleep(self.delay)
            super().read_into(key, start, outs)
        finally:
            with self._count:
                self.now -= 1


def _peak_reads(read_burst: int, request: int, requests: int = 48) -> tuple[int, bytes]:
    store = SlowStore(delay=0.05)
    data = bytes(range(256)) * (request * requests // 256 + 1)
    store.put("obj", data)
    config = TransferConfig(concurrency=4, read_chunk_size=64 * KiB)
    out = bytearray(request * requests)
    view = memoryview(out)
    with TransferEngine(store, config, RetryConfig(), read_burst=read_burst) as engine:
        futures = [engine.read_at("obj", i * request, [view[i * request : (i + 1) * request]]) for i in range(requests)]
        for f in futures:
            f.result(timeout=60)
    assert bytes(out) == data[: len(out)]  # every byte where it belongs, whatever ran at once
    return store.peak, bytes(out)


def test_small_reads_run_on_more_connections_than_concurrency() -> None:
    peak, _ = _peak_reads(READ_BURST, request=16 * KiB)  # a quarter of read_chunk_size each
    assert peak == READ_BURST * 4


def test_full_size_reads_keep_concurrency() -> None:
    peak, _ = _peak_reads(READ_BURST, request=64 * KiB)  # read_chunk_size each: bytes in flight bound them
    assert peak == 4


def test_an_engine_without_burst_keeps_concurrency() -> None:
    peak, _ = _peak_reads(1, request=16 * KiB)  # a writer's engine (uploads keep concurrency)
    assert peak == 4


def test_gate_admits_by_count_then_by_bytes() -> None:
    gate = ReadGate(base=2, most=4, target=100)
    gate.enter(90)
    gate.enter(90)  # within base: admitted whatever the bytes
    entered = threading.Event()

    def third() -> None:
        gate.enter(10)  # 190 + 10 > 100: waits for bytes to leave
        entered.set()

    thread = threading.Thread(target=third, daemon=True)
    thread.start()
    assert not entered.wait(0.2)
    gate.leave(90)  # one left: count 1 < base, admitted
    assert entered.wait(5)
    gate.leave(90)
    gate.leave(10)
    for _ in range(4):
        gate.enter(20)  # 80 bytes, count 4 = most
    assert gate.peak == 4
    blocked = threading.Event()

    def fifth() -> None:
        gate.enter(1)
        blocked.set()

    thread = threading.Thread(target=fifth, daemon=True)
    thread.start()
    assert not blocked.wait(0.2)  # at most ``most`` however small
    gate.leave(20)
    assert blocked.wait(5)


@pytest.mark.parametrize("read_burst", [1, READ_BURST])
def test_engine_threads_follow_the_burst(read_burst: int) -> None:
    config = TransferConfig(concurrency=3)
    with TransferEngine(MemoryStore(), config, RetryConfig(), read_burst=read_burst) as engine:
        assert engine._executor._max_workers == 3 * read_burst
        assert (engine.gate is None) == (read_burst == 1)


def test_tiled_objects_are_read_in_requests_the_budget_holds_twice_per_connection() -> None:
    """Tiles land through temporaries leased from the budget until their request lands: at 16 MiB requests
    a same-layout load of a tiled rank leased fewer requests than it had connections, and its last request
    waited for its first to land. A tiled object's requests are at most budget / (2 x concurrency)."""
    from dcp_cloud.dcp.load.chunks import ChunkIndex
    from dcp_cloud.dcp.load.loadrun import LoadRun
    from dcp_cloud.transfer.stats import StatsRecorder

    config = TransferConfig(concurrency=8)  # budget 16 MiB x 8 = 128 MiB
    with TransferEngine(MemoryStore(), config, RetryConfig(), read_burst=READ_BURST) as engine:
        run = LoadRun(engine, None, config, ChunkIndex({}), StatsRecorder(), "mem://ck", 16 << 20)  # type: ignore[arg-type]
        assert run._object_chunk(False) == 16 << 20
        assert run._object_chunk(True) == 8 << 20  # 128 MiB / 16
    small = TransferConfig(concurrency=8, part_size=1 << 20, max_inflight_parts=2)  # a 2 MiB budget
    with TransferEngine(MemoryStore(), small, RetryConfig(), read_burst=READ_BURST) as engine:
        run = LoadRun(engine, None, small, ChunkIndex({}), StatsRecorder(), "mem://ck", 16 << 20)  # type: ignore[arg-type]
        assert run._object_chunk(True) == 2 << 20  # never below MIN_SPLIT (the budget cuts shorter as it fills)
