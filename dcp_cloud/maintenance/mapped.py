"""Upload the objects of a local directory from their files' pages.

A streamed copy reads each object into memory, which bounds how many objects are in flight by the memory
budget (an object under the single-PUT limit must be held whole until its PUT; a bigger one takes the
budget's part buffers): a copy from a directory kept two connections busy where a direct save keeps eight.
A local file needs no such copy: it is mapped, its CRC32C regions checked over the mapping, then the mapping
itself is the upload's body (lent to the object's writer as a tensor's bytes are in a save: one PUT under
the single-PUT limit, parts in place above it). The pages are the file's own (page cache, or the tmpfs'
memory), so objects go up ``concurrency`` at a time, as in a direct save. Local tier files are immutable once
committed, so the bytes checked are the bytes sent.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..errors import CorruptCheckpointError
from ..store.local import LocalStore
from ..transfer.engine import TransferEngine
from ..transfer.upload import open_writer
from ..uri import join_key
from .common import _Root
from .progress import Progress
from .verification import stream_checker

#: Bytes of a mapping checked at a time.
_CHECK_SLICE = 8 << 20


def is_mapped(src: _Root) -> bool:
    """Whether ``src``'s objects are files this process can map (a local directory)."""
    return isinstance(src.raw, LocalStore)


def send_mapped(
    src: _Root,
    dst: _Root,
    sizes: dict[str, int],
    regions: dict[str, Any],
    bar: Progress,
    rename: dict[str, str],
) -> None:
    """Upload each of ``sizes``' objects from its mapped file, checked first; up to ``concurrency`` at once."""
    assert isinstance(src.raw, LocalStore)
    local: LocalStore = src.raw
    with TransferEngine(dst.raw, dst.transfer, dst.retry) as writes:

        def one(name: str, size: int) -> None:
            key = join_key(src.prefix, name)
            checker = stream_checker(regions.get(name, []), src.url(key))
            with _MappedFile(local, key, size) as (view, owner):
                for start in range(0, size, _CHECK_SLICE):
                    checker.update(view[start : start + _CHECK_SLICE])
                checker.finish()
                writer = open_writer(writes, f"{dst.prefix}/{rename[name]}", size)
                try:
                    writer.write_view(view, owner)
                    writer.commit()
                except BaseException:
                    writer.abort()
                    raise
            bar.advance(size)

        _run_all(sizes, one, dst.transfer.concurrency)


def _run_all(sizes: dict[str, int], one: Callable[[str, int], None], workers: int) -> None:
    with ThreadPoolExecutor(max_workers=max(1, min(len(sizes), workers)), thread_name_prefix="dcp-cloud-send") as pool:
        futures = [pool.submit(one, name, size) for name, size in sizes.items()]
        for future in futures:
            future.result()


class _MappedFile:
    """``with _MappedFile(store, key, size) as (view, owner)``: the file's bytes, mapped read-only (empty: no
    mapping), and what keeps them alive."""

    def __init__(self, store: LocalStore, key: str, size: int) -> None:
        self._store, self._key, self._size = store, key, size
        self._map: mmap.mmap | None = None
        self._view: memoryview | None = None

    def __enter__(self) -> tuple[memoryview, Any]:
        path = self._store._path(self._key)
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise self._store._error(exc, self._key, "read") from exc
        try:
            actual = os.fstat(fd).st_size
            if actual != self._size:
                raise CorruptCheckpointError(
                    f"{self._store.url(self._key)} has {actual} bytes where {self._size} were expected "
                    "(the object is truncated or does not belong to this checkpoint)"
                )
            if self._size:
                self._map = mmap.mmap(fd, self._size, prot=mmap.PROT_READ)
                if hasattr(self._map, "madvise") and hasattr(mmap, "MADV_SEQUENTIAL"):
                    self._map.madvise(mmap.MADV_SEQUENTIAL)
        except OSError as exc:
            raise self._store._error(exc, self._key, "read") from exc
        finally:
            os.close(fd)
        self._view = memoryview(self._map) if self._map is not None else memoryview(b"")
        return self._view, self._map

    def __exit__(self, *exc: object) -> None:
        try:
            if self._view is not None:
                self._view.release()
            if self._map is not None:
                self._map.close()
        except BufferError:  # a slice still referenced (an aborted part's body): the mapping goes with it
            pass
