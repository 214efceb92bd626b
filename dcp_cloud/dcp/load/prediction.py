"""An item's extras guessed before its object's index footer arrives, and confirmed when it does.

A load of a checkpoint we wrote needs, before it can send a data GET, each
item's raw offset (where torch.save's framing ends and the tensor's bytes
begin) and checksum block size; both are in the object's index footer
(:mod:`dcp_cloud.format.footer`), one round trip away: 20-50 ms to S3, the time a stock
reader's first data GET is already on its way. Both are predictable from
what the metadata says of the item:

* the raw offset is the length of the framing ``torch.save`` writes before
  the bytes of a contiguous tensor of the chunk's dtype and shape (this
  torch's serializer run once per layout, on an untouched tensor, into a
  sink that only counts);
* the block size is what the writer picks for the item
  (:func:`dcp_cloud.format.checksum.checksum_block_for` of the bytes of the whole tensor,
  all chunks, as torch's write item gives them), given the reader's
  ``checksum_block_size``;
* bytes items and compressed items have no raw offset and are checked from
  their first byte, over their stored length.

A guess is made only where the framing's length plus the tensor's bytes is
exactly the stored length. A load then sends its first reads at once; the
worker that completes a read waits for the footer (sent before any data
read, so it is never queued behind the reads waiting for it), confirms the
guess and checks the bytes against the footer's CRCs before the item is
handed to the planner. A wrong guess (a checkpoint written by another torch,
or with another block size) raises :class:`GuessMiss`, and the load is read
again from the footers.
"""

from __future__ import annotations

import functools
import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ...format import serialize
from ...format.checksum import checksum_block_for
from ...format.framing import storage_alignment
from ...format.layout import ItemExtras
from ...format.tensorbytes import buffer_address

#: Most layouts whose framing length is remembered per process.
MAX_LAYOUTS = 4096


class GuessMiss(Exception):
    """The footer places an item's bytes elsewhere than guessed; the load must be read again from the footers.

    Not a DcpCloudError: the reader handles it and it never reaches a caller.
    """


@dataclass(frozen=True, slots=True)
class Guess(ItemExtras):
    """Guessed extras (no CRCs); ``confirm`` waits for the footer and returns the real ones, or raises."""

    confirm: Callable[[], ItemExtras]


class _Locate(io.RawIOBase):
    """A sink for torch.save that keeps nothing: it finds where the tensor's own bytes were written."""

    def __init__(self, tensor: torch.Tensor) -> None:
        super().__init__()
        self._ptr = tensor.data_ptr()
        self._nbytes = tensor.nbytes
        self.pos = 0
        self.raw: int | None = None

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        mv = memoryview(b)
        n = mv.nbytes
        if self.raw is None and n == self._nbytes and buffer_address(mv.cast("B")) == self._ptr:
            self.raw = self.pos
        self.pos += n
        return n


@functools.lru_cache(maxsize=MAX_LAYOUTS)
def _framing(dtype: torch.dtype, shape: tuple[int, ...], alignment: int) -> tuple[int, int] | None:
    """``(raw offset, stored length)`` of what torch.save writes for a contiguous ``dtype`` tensor of ``shape``."""
    try:
        # Never touched: the CRC-free serializer hands its bytes to the sink without reading them.
        tensor = torch.empty(shape, dtype=dtype)
        sink = _Locate(tensor)
        serialize.save_tensor(tensor, sink)
    except Exception:  # noqa: BLE001 - a layout torch cannot save here is not guessed
        return None
    return None if sink.raw is None else (sink.raw, sink.pos)


def guess(
    info: Any,
    chunk: tuple[tuple[int, ...], torch.dtype] | None,
    tensor_nbytes: int,
    whole: bool,
    max_block: int,
    confirm: Callable[[], ItemExtras],
) -> Guess | None:
    """The extras of stored item ``info`` as our writer would have recorded them, or None (not guessable).

    ``chunk``: the saved chunk's shape and dtype (None: not a tensor); ``tensor_nbytes``: bytes of the
    whole tensor (0 for a bytes item); ``whole``: the item is stored as it is (bytes, or compressed).
    """
    length = int(info.length)
    block = checksum_block_for(tensor_nbytes, max_block)
    if chunk is None:
        return Guess(None, length, block, b"", confirm) if whole else None
    shape, dtype = chunk
    nbytes = dtype.itemsize
    for n in shape:
        nbytes *= n
    if whole:
        return Guess(None, length, block, b"", confirm)
    if nbytes == 0 or not serialize.usable():  # torch.save would read (CRC32) every byte of the tensor
        return None
    framed = _framing(dtype, tuple(shape), storage_alignment())
    if framed is None or framed[1] != length:
        return None
    return Guess(framed[0], nbytes, block, b"", confirm)


def confirmed(guessed: ItemExtras, real: ItemExtras, what: str) -> ItemExtras:
    """``real`` (from the footer) if ``guessed`` placed and cut the item as it is stored; else GuessMiss."""
    same_block = real.block_size in (0, guessed.block_size)
    if real.raw_offset == guessed.raw_offset and real.checked_length == guessed.checked_length and same_block:
        return real
    raise GuessMiss(
        f"{what}: the index footer records raw offset {real.raw_offset}, {real.checked_length} checked bytes "
        f"in blocks of {real.block_size}; guessed {guessed.raw_offset}, {guessed.checked_length}, "
        f"{guessed.block_size}"
    )
