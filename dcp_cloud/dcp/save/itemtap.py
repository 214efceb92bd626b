"""How one item's bytes reach a shard's object stream: torch.save through a tap, or learned framing.

:func:`write_tensor` writes one tensor item. :class:`_ItemTap` sits between
``torch.save`` and the :class:`ObjectWriter`: it finds the raw tensor bytes in
torch.save's writes (by address), hashes them, uploads them in place, and
gathers the framing writes around them. :func:`_write_framed` writes a tensor
from framing learned earlier (:mod:`dcp_cloud.format.framing`).
:func:`~dcp_cloud.format.tensorbytes.host_tensor` gives torch.save a CPU
tensor whose storage is exactly its bytes.
"""

from __future__ import annotations

import io
from typing import Any

import crc32c
import torch

from ...format import framing
from ...format.checksum import Hasher
from ...format.serialize import save_tensor
from ...format.tensorbytes import buffer_address, contiguous_copy, host_tensor, plain_and_exact, tensor_bytes
from ...transfer.upload import MIN_BORROWED_WRITE, ObjectWriter


class _ItemTap(io.RawIOBase):
    """Passes torch.save's writes to the object stream, finding and hashing the raw tensor bytes.

    torch.save hands the tensor's bytes to ``write`` as a view of the tensor's
    own memory (found by address); with an ``owner`` they are uploaded from
    there (:meth:`ObjectWriter.write_view`), ``owner`` kept alive until sent.
    The zip framing around them comes in dozens of tiny writes: those are
    gathered here and passed on in one write (as are the raw bytes of small
    tensors, which the stream would copy anyway), so an item costs the stream
    one or three calls, not forty. Call :meth:`finish` after torch.save.
    """

    def __init__(
        self,
        sink: ObjectWriter,
        tensor: torch.Tensor | None,
        hasher: Hasher | None,
        *,
        owner: Any = None,
        capture: bool = False,
    ) -> None:
        super().__init__()
        self.sink = sink
        self.start = sink.tell()
        self.raw_offset: int | None = None
        self._owner = owner
        self._ptr = tensor.data_ptr() if tensor is not None else 0
        self._nbytes = tensor.nbytes if tensor is not None else -1
        self._hasher = hasher
        self._pending = bytearray()
        self._pos = 0
        #: With ``capture``: the bytes before and after the raw bytes (see :mod:`dcp_cloud.format.framing`).
        self._framing = (bytearray(), bytearray()) if capture else None
        #: The first error the object stream raised (torch.save hides it, see _write_item).
        self.error: BaseException | None = None

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        mv = memoryview(b)
        if mv.format != "B" or mv.ndim != 1:
            mv = mv.cast("B")
        n = len(mv)
        raw = self.raw_offset is None and n == self._nbytes and (n == 0 or buffer_address(mv) == self._ptr)
        if raw:
            self.raw_offset = self._pos
            if self._hasher is not None:
                self._hasher.update(mv)
        elif self._framing is not None:
            part = self._framing[self.raw_offset is not None]
            part += mv
        self._pos += n
        if n < MIN_BORROWED_WRITE:
            self._pending += mv
            return n
        try:
            self._flush()
            if raw and self._owner is not None:
                self.sink.write_view(mv, self._owner)
            else:
                self.sink.write(mv)
        except BaseException as exc:
            if self.error is None:
                self.error = exc
            raise
        return n

    def _flush(self) -> None:
        if self._pending:
            pending, self._pending = self._pending, bytearray()
            self.sink.write(pending)

    def finish(self) -> int:
        """Pass on what is gathered; returns the item's length."""
        self._flush()
        return self._pos

    @property
    def framing(self) -> tuple[bytes, bytes] | None:
        """``(header, trailer)`` around the raw bytes, when captured."""
        if self._framing is None or self.raw_offset is None:
            return None
        return bytes(self._framing[0]), bytes(self._framing[1])


def _write_framed(
    sink: ObjectWriter, tensor: torch.Tensor, frame: tuple[bytes, bytes], hasher: Hasher | None, owner: Any
) -> int:
    """Write ``tensor`` as torch.save would, from learned framing (see :mod:`dcp_cloud.format.framing`); returns
    the raw offset."""
    header, trailer = frame
    raw = tensor_bytes(tensor, writable=False)
    if hasher is not None:
        hasher.update(raw)
    if len(raw) >= MIN_BORROWED_WRITE:
        sink.write(header)
        if owner is not None:
            sink.write_view(raw, owner)
        else:  # a temporary: copied into part buffers once, not held
            sink.write(raw)
        sink.write(trailer)
    else:
        whole = bytearray(header)
        whole += raw
        whole += trailer
        sink.write(whole)
    return len(header)


def write_tensor(stream: ObjectWriter, data: Any, hasher: Hasher, alignment: int, fqn: str) -> tuple[int, int]:
    """torch.save ``data`` (the tensor item ``fqn``) into the stream; returns the offset of its raw bytes in what
    was written, and their length. ``alignment``: torch.save's storage alignment (0: do not use learned framing)."""
    gathered = False
    if isinstance(data, torch.Tensor) and data.device.type == "cpu" and not data.is_contiguous():
        # a strided box of a larger tensor (a column tile): gathered once into a temporary that is copied
        # into part buffers (from the byte budget) and freed, never held in memory by the upload
        data, gathered = contiguous_copy(data.detach()), True
    layout = framing.layout_of(data, alignment) if alignment else None
    frame = framing.known(layout) if layout is not None else None
    if frame is not None:  # what torch.save writes for the host copy of ``data``, from the caller's memory
        return _write_framed(stream, data, frame, hasher, None if gathered else data), data.nbytes
    # A plain tensor that owns exactly its bytes is used as it is: detach()
    # would give the same bytes and the same torch.save output, at the price
    # of a torch op (see .tensorbytes) for each of thousands of items.
    tensor, temporary = (data, False) if plain_and_exact(data) else host_tensor(data)
    temporary = temporary or gathered
    # The caller's memory is uploaded in place (``data`` stays referenced
    # with it); a temporary host copy is copied into part buffers instead,
    # so it can be freed at once (kept alive by in-flight parts,
    # temporaries would add to peak memory).
    owner = None if temporary else (tensor, data)
    tap = _ItemTap(stream, tensor, hasher, owner=owner, capture=layout is not None)
    try:
        save_tensor(tensor, tap)
    except BaseException:
        # torch's zip writer turns an exception of write() into its own
        # RuntimeError ("unexpected pos ..."): surface the store's typed error.
        if tap.error is not None:
            raise tap.error from None
        raise
    tap.finish()
    if tap.raw_offset is None and tensor.nbytes == 0:
        return 0, 0  # nothing to read back
    if tap.raw_offset is None:
        raise AssertionError(f"could not locate the bytes of {fqn} in torch.save output")
    captured = tap.framing
    if layout is not None and captured is not None:
        values = tensor_bytes(tensor, writable=False)
        framing.learn(layout, *captured, crc32c.crc32c(values).to_bytes(4, "big"))
    return tap.raw_offset, tensor.nbytes
