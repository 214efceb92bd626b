"""File primitives of the local store: whole writes and scatter reads, atomic create, durable directories."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

MiB = 1024 * 1024
#: Most bytes one read/write system call moves on Linux.
MAX_IO = 0x7FFFF000
#: Most buffers one vectored system call takes (IOV_MAX).
_IOV_MAX = 1024
_COPY_CHUNK = 8 * MiB
_RENAME_NOREPLACE = 1
_AT_FDCWD = -100


def _renameat2_noreplace() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_renameat2 = _renameat2_noreplace()


def write_all(fd: int, views: list[memoryview]) -> None:
    """Write every byte of ``views`` at the file position of ``fd``."""
    for data in views:
        pos = 0
        while pos < len(data):
            pos += os.write(fd, data[pos : pos + MAX_IO])


def pwrite_all(fd: int, views: list[memoryview], pos: int) -> int:
    """Write every byte of ``views`` at offset ``pos`` (gathered, one call per up to IOV_MAX buffers)."""
    pending = [v for v in views if len(v)]
    written = 0
    while pending:
        if hasattr(os, "pwritev"):
            n = os.pwritev(fd, pending[:_IOV_MAX], pos)
        else:  # pragma: no cover - platforms without pwritev
            n = os.pwrite(fd, pending[0][:MAX_IO], pos)
        pos += n
        written += n
        advance(pending, n)
    return written


def advance(pending: list[memoryview], n: int) -> None:
    """Drop the first ``n`` bytes of ``pending`` (after a vectored call moved that many)."""
    while n and pending:
        if n >= len(pending[0]):
            n -= len(pending.pop(0))
        else:
            pending[0] = pending[0][n:]
            n = 0


def take_views(pending: deque[memoryview], n: int) -> list[memoryview]:
    """The first ``n`` bytes of ``pending`` as views (sliced, never copied), dropped from it."""
    out = []
    while n and pending:
        view = pending[0]
        if len(view) <= n:
            out.append(pending.popleft())
            n -= len(view)
        else:
            out.append(view[:n])
            pending[0] = view[n:]
            n = 0
    return out


def pread_staged(fd: int, views: list[memoryview], pos: int, stages: Sequence[tuple[int, Callable[[], None]]]) -> None:
    """Read ``views`` in full from ``pos``, stopping at each stage's ``end`` (an offset into ``views``) to call its
    ``fn`` (see ``LocalStore.read_into``); EOFError where the file ends first."""
    left = deque(v for v in views if len(v))
    start = pos
    for end, fn in stages:
        pos = _pread_all(fd, take_views(left, start + end - pos), pos)
        fn()
    _pread_all(fd, list(left), pos)


def _pread_all(fd: int, pending: list[memoryview], pos: int) -> int:
    while pending:
        n = preadv(fd, pending, pos)
        if n == 0:
            raise EOFError
        pos += n
        advance(pending, n)
    return pos


def preadv(fd: int, views: list[memoryview], pos: int) -> int:
    """Scatter-read into ``views`` from ``pos`` with one system call where the OS has one."""
    if hasattr(os, "preadv"):
        return os.preadv(fd, views[:_IOV_MAX], pos)
    os.lseek(fd, pos, os.SEEK_SET)  # pragma: no cover - platforms without preadv
    with open(fd, "rb", buffering=0, closefd=False) as fh:  # pragma: no cover
        return fh.readinto(views[0]) or 0


def link_noreplace(tmp: Path, final: Path) -> None:
    """Make ``tmp`` visible as ``final`` unless ``final`` exists (FileExistsError): an atomic create."""
    try:
        os.link(tmp, final)  # fails with FileExistsError if final exists: atomic create
        return
    except FileExistsError:
        raise
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV, errno.EMLINK):
            raise
    if _renameat2 is None:
        raise OSError(errno.ENOTSUP, "this filesystem supports neither hard links nor renameat2", str(final))
    if _renameat2(_AT_FDCWD, os.fsencode(tmp), _AT_FDCWD, os.fsencode(final), _RENAME_NOREPLACE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(final))


def fsync_dir(directory: Path) -> None:
    """Make the entries of ``directory`` durable (best effort: not every filesystem can)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def append_file(src: Path, out_fd: int) -> int:
    """Append the file ``src`` to ``out_fd`` (kernel-side copy where possible); returns the bytes copied."""
    with open(src, "rb") as fh:
        in_fd = fh.fileno()
        remaining = os.fstat(in_fd).st_size
        copied = 0
        copy_range = getattr(os, "copy_file_range", None)
        while remaining > 0:
            n = 0
            if copy_range is not None:
                try:
                    n = copy_range(in_fd, out_fd, min(remaining, MAX_IO))
                except OSError as exc:
                    if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
                        raise
                    copy_range = None
                    continue
            else:
                chunk = fh.read(min(remaining, _COPY_CHUNK))
                n = len(chunk)
                if n:
                    write_all(out_fd, [memoryview(chunk)])
            if n == 0:
                raise OSError(errno.EIO, "part file shrank while being copied", str(src))
            remaining -= n
            copied += n
        return copied
