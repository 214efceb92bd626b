"""Streaming upload of one object from a bounded set of part buffers.

:class:`ObjectWriter` is a write-only stream (``torch.save`` can write to
it). Bytes are copied into part buffers leased from the engine's pool; each
full part is uploaded by a worker thread while the caller keeps writing, and
the caller blocks only when every buffer of the budget is in flight. Small
objects become one PUT. Any failure aborts the multipart upload, so nothing
half-written is left behind by a live process.
"""

from __future__ import annotations

import io
import logging
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING

import crc32c

from ..errors import DcpCloudError, PreconditionFailedError, StoreError
from ..store.protocol import ObjectInfo, PartInfo

if TYPE_CHECKING:
    from .engine import TransferEngine

log = logging.getLogger("dcp_cloud")


class ObjectWriter(io.RawIOBase):
    """Write ``key`` as a stream; call :meth:`commit` to finish or :meth:`abort` to discard."""

    def __init__(self, engine: TransferEngine, key: str, part_size: int, *, create_only: bool = False) -> None:
        super().__init__()
        self._engine = engine
        self._store = engine.store
        self.key = key
        self._part_size = part_size
        self._create_only = create_only
        self._buf: bytearray | None = None
        self._fill = 0
        self._pos = 0
        self._upload_id: str | None = None
        self._parts: list[Future[PartInfo]] = []
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

    def write(self, b: bytes | bytearray | memoryview) -> int:  # type: ignore[override]
        self._raise_if_failed()
        mv = memoryview(b).cast("B")
        total = len(mv)
        while len(mv):
            if self._buf is None:
                self._buf = self._engine.pool(self._part_size).get()
                self._fill = 0
            n = min(len(mv), self._part_size - self._fill)
            self._buf[self._fill : self._fill + n] = mv[:n]
            self._fill += n
            mv = mv[n:]
            if self._fill == self._part_size:
                self._send_part()
        self._pos += total
        return total

    # -- parts ------------------------------------------------------------
    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _send_part(self) -> None:
        buf, fill = self._buf, self._fill
        assert buf is not None
        self._buf = None
        if self._upload_id is None:
            try:
                self._upload_id = self._store.create_multipart(self.key)
            except BaseException:
                self._engine.pool(self._part_size).put(buf)
                raise
        number = len(self._parts) + 1
        if number > self._store.limits.max_parts:
            self._engine.pool(self._part_size).put(buf)
            raise StoreError(
                f"{self._store.url(self.key)} needs more than {self._store.limits.max_parts} parts of "
                f"{self._part_size} bytes; raise TransferConfig.part_size"
            )
        fut = self._engine.submit(self._upload_part, number, buf, fill)
        fut.add_done_callback(self._on_part_done)
        self._parts.append(fut)

    def _upload_part(self, number: int, buf: bytearray, fill: int) -> PartInfo:
        try:
            if self._aborted.is_set():
                raise StoreError(f"{self._store.url(self.key)}: upload aborted")
            data = memoryview(buf)[:fill]
            crc = crc32c.crc32c(data) if self._engine.transport_checksums else None
            info = self._store.put_part(self.key, self._upload_id or "", number, data, crc32c=crc)
            self._engine.stats.add_written(fill)
            return info
        finally:
            self._engine.pool(self._part_size).put(buf)

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
        return info

    def _commit(self) -> ObjectInfo:
        self._raise_if_failed()
        if self._upload_id is None:
            buf, fill = self._buf, self._fill
            self._buf = None
            data = memoryview(buf)[:fill] if buf is not None else memoryview(b"")
            try:
                crc = crc32c.crc32c(data) if self._engine.transport_checksums else None
                info = self._store.put(self.key, data, create_only=self._create_only, crc32c=crc)
                self._engine.stats.add_written(fill)
                return info
            finally:
                if buf is not None:
                    self._engine.pool(self._part_size).put(buf)
        if self._buf is not None and self._fill:
            self._send_part()
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
        if self._buf is not None:
            self._engine.pool(self._part_size).put(self._buf)
            self._buf = None
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
