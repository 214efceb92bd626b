"""Whole files moved between ranks' local directories over a process group: bounded memory, CRC32C, no hang.

:func:`move_files` is called by every rank of a group with the same list of moves. Each rank sends the files
it is the source of, from a thread of its own, while its calling thread receives the files it is the
destination of, so sends and receives of different pairs run at once and no pattern deadlocks (the earliest
unfinished move always has its sender and its receiver at it). A file travels on its pair's connection as::

    header  int64[2] = (OK or FAIL, size)       FAIL (unreadable, wrong size): nothing else follows;
                                                a size the receiver does not expect: a ConfigError
    chunks  ceil(size / chunk_bytes) x uint8    read and sent one while the next is read (2 buffers)
    trailer int64[2] = (OK or FAIL, CRC32C)     FAIL: the sender could not read it all; the chunks are junk

so each side knows what comes next whatever goes wrong: a sender that fails mid-file sends junk chunks and
FAIL, a receiver that cannot write keeps receiving and discards. A received file is written to
``<name>.partial``, fsynced, checked against the sender's CRC32C, then renamed over ``<name>`` (and its
directory fsynced): a name never holds half a file.

At the end every rank sends its outcome to every other rank directly (point to point, not a ring
collective: in a gloo ring, a rank next to a dead one raises and the rest wait for it until the group's
timeout), and every rank raises together: its own error, or the lowest failed rank's, naming that rank.
A peer that dies makes gloo fail the operations on its connection at once ("Connection closed by peer");
the other ranks stop moving files with it, finish with the rest, and raise naming it.
"""

from __future__ import annotations

import errno
import functools
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

import crc32c
import torch

from ...dcp.metashare import from_rank
from ...errors import (
    AccessDeniedError,
    ChecksumMismatchError,
    ConfigError,
    CorruptCheckpointError,
    DcpCloudError,
    ObjectNotFoundError,
    StoreError,
)
from .peerlink import Link, PeerLost, exchange_outcomes

_OK, _FAIL = 1, 0
#: The tag of files' messages (the outcome exchange has its own).
_TAG_FILES = 4801
_PARTIAL = ".partial"


@dataclass(frozen=True)
class FileMove:
    """One file to copy from rank ``src``'s directory to rank ``dst``'s (group ranks)."""

    #: The group rank that holds the file and sends it.
    src: int
    #: The group rank that receives it.
    dst: int
    #: Its path relative to the directories, e.g. ``__3_0.distcp`` or ``.metadata``.
    name: str
    #: Its size in bytes; the sender refuses to send a file of another size.
    size: int

    def __post_init__(self) -> None:
        for field in ("src", "dst", "size"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"FileMove.{field} must be a non-negative int, got {value!r}")
        parts = self.name.split("/") if isinstance(self.name, str) else [""]
        if any(p in ("", ".", "..") for p in parts) or "\x00" in self.name or self.name.endswith(_PARTIAL):
            raise ConfigError(
                f"FileMove.name must be a relative 'a/b' path without empty, '.' or '..' segments, not ending "
                f"in {_PARTIAL!r}, got {self.name!r}"
            )


@dataclass
class MoveStats:
    """What one rank moved in one :func:`move_files` call (files that arrived whole and checked)."""

    #: Bytes of the files this rank sent whole.
    bytes_sent: int = 0
    #: Bytes of the files this rank received, checked and renamed into place.
    bytes_received: int = 0
    #: Files this rank sent whole.
    files_sent: int = 0
    #: Files this rank received, checked and renamed into place.
    files_received: int = 0
    #: Wall time of the call on this rank, outcome exchange included.
    seconds: float = 0.0


def _crc(data: memoryview, value: int) -> int:
    """CRC32C of ``data`` continuing ``value`` (the GIL is released for large chunks: the other direction runs)."""
    return int(crc32c.crc32c(data, value))


def _read_into(stream: BinaryIO, view: memoryview) -> int:
    """Fill ``view`` from ``stream``; the number of bytes read (less only at the end of the file)."""
    got = 0
    while got < len(view):
        n = stream.readinto(view[got:])
        if not n:
            break
        got += n
    return got


def file_error(exc: OSError, path: str, action: str) -> DcpCloudError:
    """The one mapping from an OSError of this module to a dcp_cloud error."""
    if isinstance(exc, FileNotFoundError):
        return ObjectNotFoundError(f"cannot {action} {path}: it does not exist")
    if isinstance(exc, PermissionError):
        return AccessDeniedError(f"permission denied to {action} {path}: check the directory's owner and mode")
    if exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", -1)):
        return StoreError(f"cannot {action} {path}: the disk or quota is full; free space there and try again")
    reason = os.strerror(exc.errno) if exc.errno else f"{type(exc).__name__}: {exc}"
    return StoreError(f"cannot {action} {path} ({reason})")


def _send_file(
    link: Link,
    src_dir: str,
    move: FileMove,
    index: int,
    bufs: list[torch.Tensor],
    on_chunk: Callable[[], None] | None = None,
) -> bool:
    """Send one file (the header, the chunks, the trailer); whether it went whole. Raises PeerLost."""
    path = os.path.join(src_dir, move.name)
    stream: BinaryIO | None = None
    try:
        stream = open(path, "rb", buffering=0)  # noqa: SIM115 - closed below, whatever happens
        actual = os.fstat(stream.fileno()).st_size
        if actual != move.size:
            raise CorruptCheckpointError(f"{path} holds {actual} bytes, {move.size} expected: it changed or is cut")
    except (OSError, DcpCloudError) as exc:
        if stream is not None:
            stream.close()
        link.fail(index, file_error(exc, path, "read") if isinstance(exc, OSError) else exc)
        link.wait(link.isend(torch.tensor([_FAIL, move.size], dtype=torch.int64), move.dst, _TAG_FILES), move.dst)
        return False
    with stream:
        link.wait(link.isend(torch.tensor([_OK, move.size], dtype=torch.int64), move.dst, _TAG_FILES), move.dst)
        chunk = len(bufs[0])
        ok, crc = True, 0
        works: list[Any] = [None, None]
        try:
            for i, offset in enumerate(range(0, move.size, chunk)):
                slot = i % 2
                if works[slot] is not None:  # the buffer is free once its last send is done
                    link.wait(works[slot], move.dst)
                    works[slot] = None
                buf = bufs[slot][: min(chunk, move.size - offset)]
                if ok:
                    view = memoryview(buf.numpy())
                    try:
                        got = _read_into(stream, view)
                        if got != len(view):
                            raise CorruptCheckpointError(f"{path} ended at {offset + got} bytes, {move.size} expected")
                        crc = _crc(view, crc)
                    except (OSError, DcpCloudError) as exc:  # keep in step: junk chunks, then FAIL
                        ok = False
                        link.fail(index, file_error(exc, path, "read") if isinstance(exc, OSError) else exc)
                works[slot] = link.isend(buf, move.dst, _TAG_FILES)
                if on_chunk is not None:
                    on_chunk()
        finally:
            for slot, work in enumerate(works):
                if work is not None:
                    try:
                        link.wait(work, move.dst)
                    except PeerLost:
                        pass
                    works[slot] = None
        trailer = torch.tensor([_OK if ok else _FAIL, crc], dtype=torch.int64)
        link.wait(link.isend(trailer, move.dst, _TAG_FILES), move.dst)
        return ok


def _receive_file(link: Link, dst_dir: str, move: FileMove, index: int, bufs: list[torch.Tensor]) -> bool:
    """Receive one file into ``<name>.partial``, check it and rename it into place; whether it arrived. Raises
    PeerLost."""
    header = torch.zeros(2, dtype=torch.int64)
    link.wait(link.irecv(header, move.src, _TAG_FILES), move.src)
    if int(header[1]) != move.size:  # the ranks were given different lists: this pair cannot stay in step
        error = ConfigError(
            f"rank {link.global_rank(move.src)} sends {move.name} as {int(header[1])} bytes, this rank expects "
            f"{move.size}: every rank must pass move_files the same moves, in the same order"
        )
        link.fail(index, error)
        link.drop(move.src, error)
        return False
    if int(header[0]) != _OK:
        return False  # the sender could not read it, and reports why
    final = os.path.join(dst_dir, move.name)
    partial = final + _PARTIAL
    fd: int | None = None
    try:
        os.makedirs(os.path.dirname(final) or ".", exist_ok=True)
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError as exc:
        link.fail(index, file_error(exc, partial, "write"))
    chunk = len(bufs[0])
    starts = list(range(0, move.size, chunk))
    crc = 0
    works: list[Any] = [None, None]
    trailer = torch.zeros(2, dtype=torch.int64)
    try:
        if starts:
            works[0] = link.irecv(bufs[0][: min(chunk, move.size)], move.src, _TAG_FILES)
        for i, offset in enumerate(starts):
            slot = i % 2
            link.wait(works[slot], move.src)
            works[slot] = None
            if i + 1 < len(starts):  # the next chunk arrives while this one is written
                nxt = starts[i + 1]
                works[1 - slot] = link.irecv(bufs[1 - slot][: min(chunk, move.size - nxt)], move.src, _TAG_FILES)
            view = memoryview(bufs[slot][: min(chunk, move.size - offset)].numpy())
            crc = _crc(view, crc)
            if fd is not None:
                try:
                    written = 0
                    while written < len(view):
                        written += os.write(fd, view[written:])
                except OSError as exc:  # keep receiving, discard
                    link.fail(index, file_error(exc, partial, "write"))
                    os.close(fd)
                    fd = None
        link.wait(link.irecv(trailer, move.src, _TAG_FILES), move.src)
        if fd is not None:
            try:
                os.fsync(fd)
            except OSError as exc:
                link.fail(index, file_error(exc, partial, "write"))
                os.close(fd)
                fd = None
    finally:
        for work in works:
            if work is not None:
                try:
                    link.wait(work, move.src)
                except PeerLost:
                    pass
        if fd is not None:
            os.close(fd)
        arrived = fd is not None and int(trailer[0]) == _OK
        if arrived and (int(trailer[1]) & 0xFFFFFFFF) != crc:
            arrived = False
            link.fail(
                index,
                ChecksumMismatchError(
                    f"{move.name} from rank {link.global_rank(move.src)} arrived with CRC32C {crc:08x}, sent with "
                    f"{int(trailer[1]) & 0xFFFFFFFF:08x}: corrupted on the way; nothing was renamed into place"
                ),
            )
        if not arrived:
            try:
                os.unlink(partial)
            except OSError:
                pass
    if not arrived:
        return False
    try:
        os.replace(partial, final)
        _fsync_dir(os.path.dirname(final) or ".")
    except OSError as exc:
        link.fail(index, file_error(exc, final, "rename into"))
        return False
    return True


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _copy_local(link: Link, move: FileMove, index: int, src_dir: str, dst_dir: str, buf: torch.Tensor) -> bool:
    """A move from a rank to itself: a plain checked copy, through ``<name>.partial`` (nothing when the
    directories are the same)."""
    path, final = os.path.join(src_dir, move.name), os.path.join(dst_dir, move.name)
    if os.path.realpath(path) == os.path.realpath(final):
        return True
    partial = final + _PARTIAL
    action, where = "read", path
    try:
        with open(path, "rb", buffering=0) as stream:
            if os.fstat(stream.fileno()).st_size != move.size:
                raise CorruptCheckpointError(f"{path} does not hold the {move.size} bytes expected")
            action, where = "write", partial
            os.makedirs(os.path.dirname(final) or ".", exist_ok=True)
            with open(partial, "wb", buffering=0) as out:
                view = memoryview(buf.numpy())
                while got := _read_into(stream, view):
                    out.write(view[:got])
                os.fsync(out.fileno())
        action, where = "rename into", final
        os.replace(partial, final)
        _fsync_dir(os.path.dirname(final) or ".")
        return True
    except (OSError, DcpCloudError) as exc:
        link.fail(index, file_error(exc, where, action) if isinstance(exc, OSError) else exc)
        if action != "read":
            try:
                os.unlink(partial)
            except OSError:
                pass
        return False


def _side(
    link: Link,
    moves: list[tuple[int, FileMove]],
    chunk: int,
    peer_of: Callable[[FileMove], int],
    step: Callable[[FileMove, int, list[torch.Tensor]], bool],
) -> tuple[int, int]:
    """This rank's moves of one direction, in order, with two chunk buffers; (files, bytes) that went whole.
    Moves with a lost peer are skipped."""
    bufs = [torch.empty(chunk, dtype=torch.uint8) for _ in range(2)] if moves else []
    files = nbytes = 0
    for index, move in moves:
        peer = peer_of(move)
        if link.is_lost(peer):
            continue
        try:
            if step(move, index, bufs):
                files += 1
                nbytes += move.size
        except PeerLost:
            continue
        except Exception as exc:  # noqa: BLE001 - a bug: reported, and that pair is out of step, so dropped
            link.fail(index, exc)
            link.drop(peer, exc)
    return files, nbytes


def move_files(
    group: Any,
    moves: Sequence[FileMove],
    src_dir: str,
    dst_dir: str,
    *,
    chunk_bytes: int = 8 << 20,
    timeout: float | None = None,
    on_chunk: Callable[[], None] | None = None,
) -> MoveStats:
    """Move whole files between the ranks of ``group``; called by every rank with the same ``moves``.

    Each rank sends the files it is the ``src`` of, read from ``src_dir``, and receives those it is the
    ``dst`` of into ``dst_dir`` (each rank passes its own directories; a move to itself is a local copy).
    Memory: two ``chunk_bytes`` buffers per direction per rank, whatever the file sizes. A received file is
    checked against the sender's CRC32C and renamed into place only whole and checked; a failed one leaves no
    ``<name>`` and no ``<name>.partial`` behind (a ``<name>`` that was already there stays; a rank that dies
    while receiving leaves its ``.partial``, never a part under ``<name>``).

    Calls on one group must not overlap (run them one after another, from one thread per group).
    Every rank returns, or every rank raises: its own error (a file it could not read or write:
    :class:`~dcp_cloud.errors.ObjectNotFoundError`, :class:`~dcp_cloud.errors.AccessDeniedError`,
    :class:`~dcp_cloud.errors.StoreError`; bytes that arrived changed:
    :class:`~dcp_cloud.errors.ChecksumMismatchError`; a file of another size:
    :class:`~dcp_cloud.errors.CorruptCheckpointError`), or else the lowest failed rank's, naming that rank.
    A peer that dies is a :class:`~dcp_cloud.errors.StoreError` naming it, raised as soon as gloo sees its
    connection close (within a second or so), and the group is then unusable. ``timeout`` (seconds) bounds
    each wait on one peer; a peer silent longer is taken as lost. None leaves the group's own timeout
    (``dist.new_group(timeout=...)``, 30 minutes by default for gloo), which is what a peer that hangs without
    dying costs; a peer that dies costs no timeout. ``on_chunk``: called after each chunk this rank sends (a
    test's crash point).
    """
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
        raise ConfigError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}")
    if timeout is not None and not timeout > 0:
        raise ConfigError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
    started = time.monotonic()
    link = Link(group, timeout)
    for move in moves:
        if not isinstance(move, FileMove) or move.src >= link.size or move.dst >= link.size:
            raise ConfigError(f"every move must be a FileMove between ranks 0..{link.size - 1}, got {move!r}")
    stats = MoveStats()
    indexed = list(enumerate(moves))
    sends = [(i, m) for i, m in indexed if m.src == link.rank and m.dst != link.rank]
    receives = [(i, m) for i, m in indexed if m.dst == link.rank and m.src != link.rank]
    locals_ = [(i, m) for i, m in indexed if m.src == m.dst == link.rank]
    # Both ends of a file cut it alike: a file over chunk_bytes makes both ranks' chunk chunk_bytes, and a
    # smaller one fits in one chunk on both, so capping the buffers at this rank's largest file is safe.
    largest = max((m.size for _, m in sends + receives + locals_), default=0)
    chunk = max(1, min(chunk_bytes, largest))

    def send_all() -> None:
        step = functools.partial(_send_file, link, src_dir, on_chunk=on_chunk)
        stats.files_sent, stats.bytes_sent = _side(link, sends, chunk, lambda m: m.dst, step)

    thread = threading.Thread(target=send_all, name="dcp-cloud-p2p-send", daemon=True)
    thread.start()
    try:
        step = functools.partial(_receive_file, link, dst_dir)
        stats.files_received, stats.bytes_received = _side(link, receives, chunk, lambda m: m.src, step)
        buf = torch.empty(chunk, dtype=torch.uint8) if locals_ else None
        for index, move in locals_:
            if buf is not None and _copy_local(link, move, index, src_dir, dst_dir, buf):
                stats.files_received += 1
                stats.bytes_received += move.size
    finally:
        thread.join()
    own = min(link.errors, key=lambda e: e[0])[1] if link.errors else None
    failed = exchange_outcomes(link, own)
    stats.seconds = time.monotonic() - started
    if own is not None:
        raise own
    if failed:
        rank = min(failed)
        error = failed[rank]
        if rank in link.lost and error is link.lost[rank]:
            raise error
        raise from_rank(error, link.global_rank(rank)) from error
    return stats


__all__ = ["FileMove", "MoveStats", "file_error", "move_files"]
