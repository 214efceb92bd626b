"""Upload the objects of a local directory from their files' pages.

A streamed copy reads each object into memory, which bounds how many objects are in flight by the memory
budget (an object under the single-PUT limit must be held whole until its PUT; a bigger one takes the
budget's part buffers): a copy from a directory kept two connections busy where a direct save keeps eight.
A local file needs no such copy: it is mapped, its CRC32C regions checked over the mapping, then the mapping
itself is the upload's body (lent to the object's writer as a tensor's bytes are in a save: one PUT under
the single-PUT limit, parts in place above it). The pages are the file's own (page cache, or the tmpfs'
memory), so objects go up ``concurrency`` at a time, as in a direct save. Local tier files are immutable once
committed, so the bytes checked are the bytes sent. A file that cannot be mapped (a filesystem without
mappings) is streamed through memory instead, with one warning.
"""

from __future__ import annotations

import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..errors import CorruptCheckpointError
from ..locations import OpenedLocation
from ..store.local import LocalStore
from ..transfer.engine import TransferEngine
from ..transfer.upload import open_writer
from ..uri import join_key
from .common import log
from .progress import Progress, Tally, relay
from .verification import stream_checker

#: Bytes of a mapping checked at a time.
_CHECK_SLICE = 8 << 20


def is_mapped(src: OpenedLocation) -> bool:
    """Whether ``src``'s objects are files this process can map (a local directory)."""
    return isinstance(src.raw, LocalStore)


def send_mapped(
    src: OpenedLocation,
    dst: OpenedLocation,
    sizes: dict[str, int],
    regions: dict[str, Any],
    bar: Progress,
    rename: dict[str, str],
) -> dict[str, int]:
    """Upload each of ``sizes``' objects from its mapped file, checked first; up to ``concurrency`` at once.
    Returns the objects whose file could not be mapped (a filesystem without mappings, say), with one warning:
    the caller streams them instead."""
    assert isinstance(src.raw, LocalStore)
    local: LocalStore = src.raw
    unmapped: dict[str, int] = {}
    lock = threading.Lock()
    with TransferEngine(dst.raw, dst.transfer, dst.retry) as writes:

        def one(name: str, size: int) -> None:
            key = join_key(src.prefix, name)
            checker = stream_checker(regions.get(name, []), src.url(key))
            try:
                mapping = _map(local, key, size)
            except _UnmappableError as exc:
                with lock:
                    if not unmapped:
                        log.warning("%s cannot be mapped (%s): copied through memory instead", src.url(key), exc)
                    unmapped[name] = size
                return
            view = memoryview(mapping) if mapping is not None else memoryview(b"")
            try:
                for start in range(0, size, _CHECK_SLICE):
                    checker.update(view[start : start + _CHECK_SLICE])
                checker.finish()
                writer = open_writer(writes, f"{dst.prefix}/{rename[name]}", size)
                try:
                    writer.write_view(view, mapping)
                    writer.commit()
                except BaseException:
                    writer.abort()
                    raise
            finally:
                _unmap(view, mapping)
            tally.advance(size)

        tally = Tally()
        workers = max(1, min(len(sizes), dst.transfer.concurrency))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dcp-cloud-send") as pool:
            relay([pool.submit(one, name, size) for name, size in sizes.items()], bar, tally)
    return unmapped


class _UnmappableError(Exception):
    """The file exists and has its size, but cannot be mapped."""


def _map(store: LocalStore, key: str, size: int) -> mmap.mmap | None:
    """``key``'s file mapped read-only (None: empty); CorruptCheckpointError where its size is not ``size``."""
    fd, actual = store.open_read(key)
    try:
        if actual != size:
            raise CorruptCheckpointError(
                f"{store.url(key)} has {actual} bytes where {size} were expected "
                "(the object is truncated or does not belong to this checkpoint)"
            )
        if not size:
            return None
        try:
            mapping = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        except (OSError, ValueError) as exc:
            raise _UnmappableError(str(exc)) from exc
        if hasattr(mapping, "madvise") and hasattr(mmap, "MADV_SEQUENTIAL"):
            mapping.madvise(mmap.MADV_SEQUENTIAL)
        return mapping
    finally:
        os.close(fd)


def _unmap(view: memoryview, mapping: mmap.mmap | None) -> None:
    try:
        view.release()
        if mapping is not None:
            mapping.close()
    except BufferError:  # a slice still referenced (an aborted part's body): the mapping goes with it
        pass
