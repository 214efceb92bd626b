"""Streaming upload of one object in bounded memory, tensor bytes sent in place.

:class:`ObjectWriter` is a write-only stream (``torch.save`` can write to
it). Two kinds of write build the parts:

* :meth:`ObjectWriter.write` copies into part buffers leased from the
  engine's pool (headers, pickles, small items);
* :meth:`ObjectWriter.write_view` borrows the caller's memory (the bytes of
  a tensor) and uploads it in place: a part is then a list of pieces, e.g. a
  few header bytes followed by a slice of a tensor, sent without joining.

Each full part is uploaded by a worker thread while the caller keeps
writing; the caller blocks when ``max_inflight_parts`` parts are in flight
or the byte budget is spent. An object smaller than
``TransferConfig.multipart_threshold`` becomes one PUT: its first full parts
are held (borrowed pieces cost nothing to hold) until either the object
ends, or it outgrows the threshold, or a second held part holds a copied
buffer (host copies of GPU tensors, many small items): then the held parts
start the multipart upload, so copied bytes never wait in memory and keep
``max_inflight_parts`` connections busy as before. Any failure aborts the multipart
upload, so nothing half-written is left behind by a live process.
"""

from __future__ import annotations

import io
import logging
import mmap
import threading
from concurrent.futures import Future
from typing import Any

from ..errors import DcpCloudError, PreconditionFailedError, StoreError
from ..store.payload import Buffer, byte_view
from ..store.protocol import ObjectInfo, PartInfo
from .engine import TransferEngine

log = logging.getLogger("dcp_cloud")

#: A borrowed write shorter than this is copied instead (not worth a piece of its own).
MIN_BORROWED_WRITE = 64 * 1024
#: Copied bytes up to this long are copied out of the part buffer when a
#: borrowed write follows them, so the buffer stays with the writer instead of
#: travelling with a part for a few header bytes.
_SMALL_COPY = 64 * 1024


class ObjectWriter(io.RawIOBase):
    """Write ``key`` as a stream; call :meth:`commit` to finish or :meth:`abort` to discard."""

    def __init__(self, engine: TransferEngine, key: str, part_size: int, *, create_only: bool = False) -> None:
        super().__init__()
        self._engine = engine
        self._store = engine.store
        self._pool = engine.pool(part_size)
        self.key = key
        self._part_size = part_size
        self._create_only = create_only
        # The pending part: ``_pieces`` (``_piece_bytes`` long), then ``_buf[_start:_fill]``. Copies between
        # borrowed pieces go on filling the same buffer (its earlier regions are pieces already, the buffer
        # leased once to the part), so a part holds at most two buffers however its copies and borrowed
        # views interleave; a fresh buffer per copy would let one part take more than the whole budget.
        self._buf: mmap.mmap | None = None
        self._start = 0
        self._fill = 0
        self._buf_leased = False
        self._pieces: list[Buffer] = []
        self._piece_bytes = 0
        self._leases: list[mmap.mmap] = []  # pool buffers the pending pieces point into
        self._owners: list[Any] = []  # what keeps borrowed pieces alive
        self._pos = 0
        self._upload_id: str | None = None
        #: Full parts held back while the object may still go up in one PUT (see the module docstring).
        self._single_limit = min(
            engine.config.single_put_limit(part_size), max(part_size, self._store.limits.max_part_size)
        )
        self._held: list[tuple[list[Buffer], list[mmap.mmap], list[Any], int]] = []
        self._held_bytes = 0
        self._parts: list[Future[PartInfo]] = []
        self._window = threading.Semaphore(max(1, engine.config.max_inflight_parts))
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._finished = False
        self._aborted = threading.Event()

    # -- io.RawIOBase -----------------------------------------------------
    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def tell(self) -> int:
        return self._pos

    def write(self, b: Buffer) -> int:  # type: ignore[override]
        """Copy ``b`` into part buffers."""
        self._raise_if_failed()
        mv = byte_view(b)
        total = len(mv)
        while len(mv):
            if self._buf is not None and self._fill == len(self._buf):  # full, its part not: on in a fresh one
                self._seal_copied()
                self._buf, self._buf_leased, self._start, self._fill = None, False, 0, 0
            if self._buf is None:
                self._buf = self._pool.get()
                self._start = self._fill = 0
            room = min(self._part_size - self._piece_bytes - (self._fill - self._start), len(self._buf) - self._fill)
            n = min(len(mv), room)
            self._buf[self._fill : self._fill + n] = mv[:n]
            self._fill += n
            mv = mv[n:]
            if self._piece_bytes + self._fill - self._start == self._part_size:
                self._send_part()
        self._pos += total
        return total

    def write_view(self, b: Buffer, owner: Any) -> int:
        """Upload ``b`` in place, without copying it.

        The caller promises the bytes stay unchanged until :meth:`commit` or
        :meth:`abort` returns; ``owner`` (e.g. the tensor the view points
        into) is referenced until every part holding a slice of it is sent.
        """
        mv = byte_view(b)
        if len(mv) < MIN_BORROWED_WRITE:
            return self.write(mv)
        self._raise_if_failed()
        self._seal_copied()
        total = len(mv)
        while len(mv):
            n = min(len(mv), self._part_size - self._piece_bytes)
            self._pieces.append(mv[:n])
            self._piece_bytes += n
            self._owners.append(owner)
            mv = mv[n:]
            if self._piece_bytes == self._part_size:
                self._send_part()
        self._pos += total
        return total

    # -- parts ------------------------------------------------------------
    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _seal_copied(self) -> None:
        """Turn the copied bytes of the part buffer not yet in a piece into a piece of the pending part."""
        n = self._fill - self._start
        if self._buf is None or not n:
            return
        region = memoryview(self._buf)[self._start : self._fill]
        if n <= _SMALL_COPY:
            self._pieces.append(bytes(region))
            self._fill = self._start  # copied out: the space is written again
        else:
            self._pieces.append(region)
            if not self._buf_leased:  # released with the part, whatever pieces of it the part holds
                self._leases.append(self._buf)
                self._buf_leased = True
            self._start = self._fill
        self._piece_bytes += n

    def _take_pending(self) -> tuple[list[Buffer], list[mmap.mmap], list[Any], int]:
        self._seal_copied()
        taken = (self._pieces, self._leases, self._owners, self._piece_bytes)
        self._pieces, self._leases, self._owners, self._piece_bytes = [], [], [], 0
        if self._buf_leased:  # the buffer goes with the part taken
            self._buf, self._buf_leased, self._start, self._fill = None, False, 0, 0
        return taken

    def _drop_buffer(self) -> None:
        if self._buf is not None and not self._buf_leased:
            self._pool.put(self._buf)
        self._buf, self._buf_leased, self._start, self._fill = None, False, 0, 0

    def _release(self, leases: list[mmap.mmap]) -> None:
        for buf in leases:
            self._pool.put(buf)

    def _send_part(self) -> None:
        part = self._take_pending()
        self._held.append(part)
        self._held_bytes += part[3]
        copied = sum(len(leases) for _pieces, leases, _owners, _size in self._held)
        if self._upload_id is None and self._held_bytes < self._single_limit and copied <= 1:
            return  # the object may still be small enough for one PUT
        self._send_held()

    def _send_held(self) -> None:
        """Start the multipart upload of every held part, in order."""
        held, self._held, self._held_bytes = self._held, [], 0
        for i, (pieces, leases, owners, size) in enumerate(held):
            try:
                self._start_part(pieces, leases, owners, size)
            except BaseException:
                for _pieces, later, _owners, _size in held[i + 1 :]:
                    self._release(later)
                raise

    def _start_part(self, pieces: list[Buffer], leases: list[mmap.mmap], owners: list[Any], size: int) -> None:
        try:
            if self._upload_id is None:
                self._upload_id = self._store.create_multipart(self.key)
            number = len(self._parts) + 1
            if number > self._store.limits.max_parts:
                raise StoreError(
                    f"{self._store.url(self.key)} needs more than {self._store.limits.max_parts} parts of "
                    f"{self._part_size} bytes; raise TransferConfig.part_size"
                )
        except BaseException:
            self._release(leases)
            raise
        self._window.acquire()
        fut = self._engine.submit(self._upload_part, number, pieces, leases, owners, size)
        fut.add_done_callback(self._on_part_done)
        self._parts.append(fut)

    def _upload_part(
        self, number: int, pieces: list[Buffer], leases: list[mmap.mmap], owners: list[Any], size: int
    ) -> PartInfo:
        """Send one part (a worker thread). ``owners`` is only held: it keeps the memory
        of borrowed pieces alive until the part is sent."""
        try:
            if self._aborted.is_set():
                raise StoreError(f"{self._store.url(self.key)}: upload aborted")
            if self._store.capabilities.positional_parts:  # every part but the last is part_size long
                offset = (number - 1) * self._part_size
                info = self._store.put_part_at(self.key, self._upload_id or "", number, offset, pieces)
            else:
                info = self._store.put_part(self.key, self._upload_id or "", number, pieces)
            self._engine.stats.add_written(size)
            return info
        finally:
            self._release(leases)
            self._window.release()

    def _on_part_done(self, fut: Future[PartInfo]) -> None:
        exc = fut.exception()
        if exc is not None:
            with self._lock:
                if self._error is None:
                    self._error = exc

    # -- finish -----------------------------------------------------------
    def commit(self) -> ObjectInfo:
        """Upload what is buffered, wait for every part and make the object visible."""
        if self._finished:
            raise StoreError(f"{self._store.url(self.key)}: writer already finished")
        try:
            info = self._commit()
        except BaseException:
            self.abort()
            raise
        self._finished = True
        self._drop_buffer()
        return info

    def _commit(self) -> ObjectInfo:
        self._raise_if_failed()
        pending = self._piece_bytes + self._fill - self._start
        if self._upload_id is None and (not self._held or self._held_bytes + pending < self._single_limit):
            pieces, leases, _owners, size = self._take_pending()
            held, self._held, self._held_bytes = self._held, [], 0
            for h_pieces, h_leases, _h_owners, h_size in reversed(held):
                pieces, leases, size = h_pieces + pieces, h_leases + leases, h_size + size
            try:
                info = self._store.put(self.key, pieces, create_only=self._create_only)
                self._engine.stats.add_written(size)
                return info
            finally:
                self._release(leases)
        if pending:
            self._send_part()
        self._send_held()
        parts = [f.result() for f in self._parts]
        try:
            info = self._store.complete_multipart(self.key, self._upload_id, parts, create_only=self._create_only)
        except DcpCloudError as exc:
            # A retried complete may have succeeded on the attempt whose answer was lost.
            if not (getattr(exc, "after_retry", False) and not isinstance(exc, PreconditionFailedError)):
                raise
            info = self._store.head(self.key)
            if info.size != self._pos:
                raise
        if self._store.capabilities.sweeps_after_complete:
            self._sweep()
        return info

    def _sweep(self) -> None:
        """Release what a completed upload may have left behind (GCS composite temporaries
        whose one-shot delete failed); a no-op answer on S3. Failure only costs storage
        until dcp_cloud.gc, so it is logged, not raised."""
        try:
            self._store.abort_multipart(self.key, self._upload_id or "")
        except DcpCloudError as exc:
            log.warning("could not release the parts of %s after completing it: %s", self._store.url(self.key), exc)

    def abort(self) -> None:
        """Discard everything written; never raises for a second abort."""
        if self._finished:
            return
        self._finished = True
        self._aborted.set()
        for fut in self._parts:  # parts not yet started skip their upload but return their buffer
            try:
                fut.result()
            except BaseException:
                pass
        self._release(self._leases)
        self._pieces, self._leases, self._owners, self._piece_bytes = [], [], [], 0
        for _pieces, leases, _owners, _size in self._held:
            self._release(leases)
        self._held, self._held_bytes = [], 0
        self._drop_buffer()
        if self._upload_id is not None:
            try:
                self._store.abort_multipart(self.key, self._upload_id)
            except DcpCloudError:
                pass  # what is left is found by dcp_cloud.gc

    def close(self) -> None:
        # torch.save closes nothing it did not open, but guard against misuse:
        # closing without commit discards the upload.
        if not self._finished:
            self.abort()
        super().close()


def open_writer(
    engine: TransferEngine, key: str, size_hint: int | None = None, *, create_only: bool = False
) -> ObjectWriter:
    """A stream that uploads ``key`` through ``engine``; ``size_hint`` lets huge objects get bigger parts."""
    return ObjectWriter(engine, key, engine.part_size_for(size_hint), create_only=create_only)
