"""A rank's save spread over several objects, written in parallel.

A rank's items are cut into consecutive runs of about equal bytes, one object
each: ``ceil(bytes / part_size)`` objects, at most
``TransferConfig.max_objects_per_rank``. An object smaller than
``multipart_threshold`` then goes up in one PUT (no create or complete round
trip, and no joining of parts by the server), while as many connections stay
busy as the parts of one multipart upload would keep. Stock
``FileSystemWriter`` writes ``thread_count`` files per rank the same way; the
objects are ordinary shard objects, each with its own index footer.

:class:`Finisher` finishes each object (completes its upload) on a thread of
its own as soon as its last item is written, so the next object is written
meanwhile. If anything fails, every object not yet finished is aborted;
objects already finished are unreferenced (no ``.metadata`` names them) and
``dcp_cloud.gc`` removes them, as it does the objects of a rank whose peer failed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from ...format.layout import SHARD_SUFFIX, spread_dir
from ...store.protocol import ObjectInfo
from ...transfer.upload import ObjectWriter

__all__ = ["Finisher", "split_runs", "stripe_count", "stripe_name"]


def stripe_count(total: int, part_size: int, max_objects: int) -> int:
    """Objects for a rank of ``total`` bytes: one per ``part_size``, between 1 and ``max_objects``."""
    return max(1, min(max_objects, math.ceil(total / part_size)))


def split_runs(sizes: Sequence[int], count: int) -> list[range]:
    """Cut items of ``sizes`` bytes, in order, into at most ``count`` non-empty consecutive runs of about
    equal bytes.

    Item ``i`` goes to run ``floor(mid_i * count / total)``, where ``mid_i`` is
    the byte in the middle of the item, so every run but one holding a huge
    item is within one item of ``total / count``. Empty runs are dropped: an
    item larger than a run's share leaves fewer runs.

    >>> split_runs([4, 4, 4, 4], 2)
    [range(0, 2), range(2, 4)]
    >>> split_runs([10, 1, 1], 3)
    [range(0, 1), range(1, 3)]
    """
    total = sum(sizes)
    if count <= 1 or len(sizes) <= 1 or total <= 0:
        return [range(len(sizes))] if sizes else []
    runs: list[range] = []
    start = 0
    current = 0
    acc = 0
    for i, n in enumerate(sizes):
        which = min(count - 1, int((acc + n / 2) * count // total))
        if which > current and i > start:
            runs.append(range(start, i))
            start = i
        current = max(current, which)
        acc += n
    runs.append(range(start, len(sizes)))
    return runs


def stripe_name(name: str, index: int) -> str:
    """The relative path of a rank's object ``index``: ``name`` itself for 0, else ``__3_<token>-<index>.distcp``
    (under its own hashed sub-prefix when ``name`` has one)."""
    if index == 0:
        return name
    head, _, base = name.rpartition("/")
    if not base.endswith(SHARD_SUFFIX):
        raise ValueError(f"{name!r} is not a shard object name")
    striped = f"{base[: -len(SHARD_SUFFIX)]}-{index}{SHARD_SUFFIX}"
    return f"{spread_dir(striped)}/{striped}" if head else striped


class Finisher:
    """Finishes a rank's objects in parallel with writing the next; aborts what is not finished on failure.

    Use as a context manager: :meth:`finish` each stream after its last
    write, :meth:`wait` for all of them; leaving the block by an exception
    aborts every stream not finished (after the ones under way end).
    Finishing a stream is :meth:`ObjectWriter.commit`: its upload completes.
    """

    def __init__(self, objects: int) -> None:
        self._pool = ThreadPoolExecutor(objects, thread_name_prefix="dcp_cloud-commit") if objects > 1 else None
        self._streams: list[ObjectWriter] = []
        self._futures: list[Future[ObjectInfo]] = []

    def track(self, stream: ObjectWriter) -> ObjectWriter:
        """Register a stream just opened (so a failure aborts it)."""
        self._streams.append(stream)
        return stream

    def finish(self, stream: ObjectWriter) -> None:
        """Finish ``stream`` (in the background when there are several objects); raises a finish that
        already failed, so a rank stops writing soon after a failure."""
        if self._pool is None:
            stream.commit()
            return
        for fut in self._futures:
            if fut.done() and fut.exception() is not None:
                fut.result()
        self._futures.append(self._pool.submit(stream.commit))

    def wait(self) -> None:
        """Wait for every finish; raises the first failure."""
        for fut in self._futures:
            fut.result()

    def abort(self) -> None:
        """Let the finishes under way end, then abort every stream not finished (never raises)."""
        for fut in self._futures:
            try:
                fut.result()
            except BaseException:  # noqa: BLE001, S110 - a failed finish aborted its own stream
                pass
        for stream in self._streams:
            stream.abort()

    def __enter__(self) -> Finisher:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        try:
            if exc_type is not None:
                self.abort()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
