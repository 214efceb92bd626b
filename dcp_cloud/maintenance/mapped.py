"""Upload objects of a local directory from their files' pages, each in one PUT.

A streamed copy reads each object into memory it must then hold until the object's single PUT goes out, so
its memory budget bounds how many objects are in flight (two 32 MiB objects under the default 128 MiB budget:
two connections where a direct save keeps eight busy). A local file needs no such copy: it is mapped, its
CRC32C regions checked over the mapping, and the mapping itself sent as the PUT's body. The pages are the
file's own (page cache, or the tmpfs' memory), so the only limit on objects in flight is the upload's
``concurrency``, as in a direct save. Local tier files are immutable once committed, so the bytes checked are
the bytes sent.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..errors import CorruptCheckpointError
from ..store.local import LocalStore
from ..uri import join_key
from .common import _Root
from .progress import Progress
from .verification import stream_checker

#: Bytes of a mapping checked at a time (the checker's updates stay short; the pages are read once more to send).
_CHECK_SLICE = 8 << 20


def mapped_limit(src: _Root, dst: _Root) -> int:
    """Objects of ``src`` smaller than this go up from their mapped files (0: ``src`` is not a directory)."""
    if not isinstance(src.raw, LocalStore):
        return 0
    config = dst.transfer
    return min(config.single_put_limit(config.part_size), max(config.part_size, dst.raw.limits.max_part_size))


def send_mapped(
    src: _Root,
    dst: _Root,
    sizes: dict[str, int],
    regions: dict[str, Any],
    bar: Progress,
    rename: dict[str, str],
) -> None:
    """PUT each of ``sizes``' objects from its mapped file, checked first; up to ``concurrency`` at once."""
    assert isinstance(src.raw, LocalStore)
    local: LocalStore = src.raw

    def one(name: str, size: int) -> None:
        key = join_key(src.prefix, name)
        checker = stream_checker(regions.get(name, []), src.url(key))
        with _mapped(local, key, size) as view:
            for start in range(0, size, _CHECK_SLICE):
                checker.update(view[start : start + _CHECK_SLICE])
            checker.finish()
            dst.store.put(f"{dst.prefix}/{rename[name]}", [view] if size else b"")
        bar.advance(size)

    _run_all(sizes, one, dst.transfer.concurrency)


def _run_all(sizes: dict[str, int], one: Callable[[str, int], None], workers: int) -> None:
    with ThreadPoolExecutor(max_workers=max(1, min(len(sizes), workers)), thread_name_prefix="dcp-cloud-send") as pool:
        futures = [pool.submit(one, name, size) for name, size in sizes.items()]
        for future in futures:
            future.result()


class _mapped:
    """``with _mapped(store, key, size) as view``: the file's bytes, mapped read-only (empty: no mapping)."""

    def __init__(self, store: LocalStore, key: str, size: int) -> None:
        self._store, self._key, self._size = store, key, size
        self._map: mmap.mmap | None = None
        self._view: memoryview | None = None

    def __enter__(self) -> memoryview:
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
        return self._view

    def __exit__(self, *exc: object) -> None:
        if self._view is not None:
            self._view.release()
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a slice still exported (a retry's body): the mapping goes with it
                pass
