"""Upload bodies: one buffer or a list of buffers sent back to back, never joined by a copy.

The transfer engine uploads tensor memory in place: a part is often a few
header bytes followed by a slice of a tensor, so ``put`` / ``put_part`` take
a :data:`Payload` (one buffer, or a list/tuple of buffers that together form
the body). Stores turn it into flat byte views with :func:`payload_views` and
hand an HTTP client a :class:`ScatterReader` (or the single view itself).
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from typing import Any

import crc32c as _crc32c

Buffer = bytes | bytearray | memoryview
#: One buffer, or the body as consecutive buffers.
Payload = Buffer | Sequence[Buffer]


def byte_view(data: Any) -> memoryview:
    """``data`` as a flat unsigned-byte view: the same memory, or a copy if it is not contiguous."""
    view = data if isinstance(data, memoryview) else memoryview(data)
    if not view.c_contiguous:
        return memoryview(view.tobytes())
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def payload_views(data: Payload) -> list[memoryview]:
    """The body's non-empty pieces as flat byte views, in order."""
    pieces = data if isinstance(data, (list, tuple)) else (data,)
    views = [byte_view(p) for p in pieces]
    return [v for v in views if len(v)]


def payload_size(views: Sequence[memoryview]) -> int:
    return sum(len(v) for v in views)


def payload_crc32c(views: Sequence[memoryview]) -> int:
    """CRC32C of the whole body, chained over its pieces."""
    crc = 0
    for v in views:
        crc = _crc32c.crc32c(v, value=crc)
    return crc


def payload_bytes(views: Sequence[memoryview]) -> bytes:
    """The body as one bytes object (a copy: for stores that keep bodies, like the memory store)."""
    return b"".join(views)


class ScatterReader(io.RawIOBase):
    """A seekable read-only file over consecutive buffers.

    ``read`` returns views of the buffers, not copies: HTTP clients pass what
    they read straight to ``socket.sendall``. ``len()`` gives the body size,
    so ``requests`` sends a Content-Length instead of chunked encoding.
    """

    def __init__(self, views: Sequence[memoryview]) -> None:
        super().__init__()
        self._views = list(views)
        self._starts: list[int] = []
        pos = 0
        for v in self._views:
            self._starts.append(pos)
            pos += len(v)
        self._size = pos
        self._pos = 0
        self._index = 0  # the view holding _pos (or len(views) at the end)

    def __len__(self) -> int:
        return self._size

    @property
    def pieces(self) -> list[memoryview]:
        """The buffers, in order (a client that sends a list of buffers takes them as they are)."""
        return self._views

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._size}[whence]
        self._pos = min(max(0, base + offset), self._size)
        self._index = 0
        while self._index < len(self._views) and self._pos >= self._starts[self._index] + len(self._views[self._index]):
            self._index += 1
        return self._pos

    def _next_view(self, size: int) -> memoryview:
        """Up to ``size`` bytes (all if negative) from the current view, advancing."""
        while self._index < len(self._views):
            view = self._views[self._index]
            offset = self._pos - self._starts[self._index]
            if offset < len(view):
                end = len(view) if size < 0 else min(len(view), offset + size)
                self._pos += end - offset
                return view[offset:end]
            self._index += 1
        return memoryview(b"")

    def read(self, size: int | None = -1) -> Any:  # a memoryview, which HTTP clients send as is
        if size is None or size < 0:
            if self._index >= len(self._views) or self._pos >= self._size:
                return b""
            rest = [self._next_view(-1) for _ in range(len(self._views) - self._index)]
            return rest[0] if len(rest) == 1 else b"".join(rest)
        return self._next_view(size)

    def readinto(self, b: Any) -> int:
        out = memoryview(b).cast("B")
        n = 0
        while n < len(out):
            chunk = self._next_view(len(out) - n)
            if not len(chunk):
                break
            out[n : n + len(chunk)] = chunk
            n += len(chunk)
        return n


def out_view(out: memoryview) -> memoryview:
    """A read target (``read_into``'s ``outs``) as a flat byte view of the same memory (never a copy)."""
    if not out.c_contiguous or out.readonly:
        raise ValueError("read_into needs writable, contiguous buffers")
    return out if out.format == "B" and out.ndim == 1 else out.cast("B")
