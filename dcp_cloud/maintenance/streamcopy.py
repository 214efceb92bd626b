"""Streaming copies of checkpoint objects between stores: ranged reads, checked as they pass, into uploads.

Each object is read in order in ranged GETs of ``transfer.read_chunk_size``
(bounded by the read engine's memory budget), every CRC32C checked as the
bytes pass, and written through its upload; several objects are copied at
once, as many as the upload's memory budget holds their parts
(:func:`run_bounded`). A local directory's objects go up from their mapped
files instead (:mod:`.mapped`). ``cp`` (:mod:`.copying`) uses it where the
two ends are not the same service, and to read server-side copies back.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..locations import OpenedLocation
from ..transfer.engine import TransferEngine
from ..transfer.upload import open_writer
from ..uri import join_key
from .mapped import is_mapped, send_mapped
from .progress import Progress, Tally, relay
from .verification import StreamChecker, stream_checker


def copy_streaming(
    src: OpenedLocation,
    dst: OpenedLocation,
    sizes: dict[str, int],
    regions: dict[str, Any],
    bar: Progress,
    rename: dict[str, str],
) -> None:
    """Stream each object through its upload, several objects at once, as many as the upload's memory budget
    holds their parts (an object under the single-PUT limit is one request on one connection: one after
    another, a store that caps each connection's bandwidth would cap the copy's). A local directory's objects
    go up from their mapped files instead, up to ``concurrency`` at once (streamed where a file cannot be
    mapped)."""
    if is_mapped(src):
        sizes = send_mapped(src, dst, sizes, regions, bar, rename)  # what could not be mapped: streamed below
        if not sizes:
            return
    with (
        TransferEngine(src.raw, src.transfer, src.retry) as reads,
        TransferEngine(dst.raw, dst.transfer, dst.retry) as writes,
    ):
        # An object under the single-PUT limit lends its read buffers to its writer, which holds them until
        # the object ends and sends it in one PUT, as a direct save does (copied bytes would start a multipart
        # upload at the second part: a create and a complete round trip more per object, and a copy).
        limit = writes.config.single_put_limit(writes.config.part_size)

        tally = Tally()

        def one(name: str, size: int) -> None:
            key = f"{dst.prefix}/{rename[name]}"
            checker = stream_checker(regions.get(name, []), src.url(join_key(src.prefix, name)))
            writer = open_writer(writes, key, size)
            try:
                stream_object(reads, join_key(src.prefix, name), size, checker, writer, tally, borrow=size < limit)
                writer.commit()
            except BaseException:
                writer.abort()
                raise

        run_bounded(writes, sizes, one, bar, tally)


def run_bounded(writes: TransferEngine, sizes: dict[str, int], one: Any, bar: Progress, tally: Tally) -> None:
    """Run ``one(name, size)`` for every object, at once as far as the upload's buffers go: each object takes
    the part buffers it can hold at most (a small object's whole body waits for one PUT) plus one, from a
    count of the budget's buffers, before it starts; so no upload waits on a buffer another one holds. After
    a failure, the objects not started are not copied."""
    config = writes.config
    total = max(1, config.memory_budget // config.part_size)
    free = [total]
    failed = threading.Event()
    cond = threading.Condition()
    limit = config.single_put_limit(config.part_size)

    def need(size: int) -> int:
        return min(total, -(-min(size, limit) // config.part_size) + 1)

    def run(name: str, size: int) -> None:
        taken = need(size)
        with cond:  # all of them at once: two objects holding some each could wait on each other
            cond.wait_for(lambda: free[0] >= taken)
            free[0] -= taken
        try:
            if not failed.is_set():
                one(name, size)
        except BaseException:
            failed.set()
            raise
        finally:
            with cond:
                free[0] += taken
                cond.notify_all()

    workers = max(1, min(len(sizes), total))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dcp-cloud-copy") as pool:
        relay([pool.submit(run, name, size) for name, size in sizes.items()], bar, tally)


def stream_object(
    engine: TransferEngine,
    key: str,
    size: int,
    checker: StreamChecker,
    writer: Any,
    bar: Progress | None,
    borrow: bool = False,
) -> None:
    """Read ``key`` in order through ``engine`` (bounded by its budget), checking and passing on each chunk
    (``borrow``: lent to the writer, which keeps it until the object ends; the caller counts that memory)."""
    chunk = max(1, engine.config.read_chunk_size)
    budget = engine.budget
    pending: deque[tuple[bytearray, Future[None]]] = deque()

    def land() -> None:
        buf, fut = pending.popleft()
        try:
            fut.result()
            view = memoryview(buf)
            checker.update(view)
            if writer is not None and borrow:
                writer.write_view(view, buf)
            elif writer is not None:
                writer.write(view)
            if bar is not None:
                bar.advance(len(buf))
        finally:
            budget.release(len(buf))

    try:
        for start in range(0, size, chunk):
            length = min(chunk, size - start)
            while pending and budget.used + length > budget.capacity:
                land()
            budget.acquire(length)
            buf = bytearray(length)
            pending.append((buf, engine.read_at(key, start, [memoryview(buf)])))
        while pending:
            land()
        checker.finish()
    finally:
        for buf, fut in pending:  # after a failure: let reads end before their buffers go
            fut.exception()
            budget.release(len(buf))
