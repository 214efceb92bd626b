"""A synchronous save's device tensors, on their way to the object streams through one pinned ring chunk.

Without a feed, ``dcp.save`` of a state on a device copies each tensor into
fresh pageable memory (``.to("cpu")``, serially, with nothing else running)
and then hashes and writes that copy. Here one ring chunk (see :mod:`.devicering`)
is split in two halves: while the writer hashes and writes the bytes of one
half (the host copy that the write uses anyway), the next bytes are copied
off the device into the other. Items are resolved a little ahead of the one
being written (:class:`Resolver`) so that small tensors share a half and the
copy of the next item's bytes starts while this one is written.

The two halves are counted in the transfer engine's byte budget for as long
as the feed is open, so the peak host memory of a save stays within
``TransferConfig.memory_budget``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ...format import framing, serialize
from ...format.tensorbytes import tensor_bytes
from ...transfer.budget import ByteBudget
from ...transfer.upload import ObjectWriter
from .cudapaths import moving, plain, routed
from .devicering import Ring, device_path
from .movers import Mover
from .ringstage import flat_bytes

MiB = 1 << 20
#: Items resolved ahead of the one being written, at most (their data is held until written).
LOOKAHEAD = 64
#: Smallest half worth a feed: below it (a tiny memory budget) device items are written without a feed.
MIN_PIECE = MiB
#: What a synchronous save from a device costs without the feed (measured on an H200: see the GPU guide).
_NO_FEED_COST = "synchronous saves copy each device tensor to pageable memory first (.to('cpu'), serially)"


def feedable(data: Any) -> bool:
    """Whether ``data`` (what the planner resolved for an item) goes through the feed: a plain, contiguous
    tensor on a device, whose host copy torch.save would write with framing that does not depend on the
    values (see :mod:`dcp_cloud.format.framing`)."""
    return (
        isinstance(data, torch.Tensor)
        and routed(data)
        and type(data) in (torch.Tensor, torch.nn.Parameter)
        and data.nbytes > 0
        and plain(data)
        and serialize.usable()
    )


def piece_bytes(chunk_bytes: int, budget: ByteBudget, part_size: int) -> int:
    """Bytes of one half: at most half a ring chunk and one part, and small enough that the two halves
    leave room in the budget for a pending and a held part buffer (so a write never waits for budget the
    feed holds); 0 where that is under :data:`MIN_PIECE`."""
    piece = min(chunk_bytes // 2, part_size, (budget.capacity - 2 * part_size) // 2)
    return piece if piece >= MIN_PIECE else 0


@dataclass
class _Entry:
    """One tensor queued for the feed: its bytes on the device, and how many of them are on their way."""

    tensor: torch.Tensor
    src: torch.Tensor
    issued: int = 0


@dataclass
class _Batch:
    """The bytes copied into one half: ``(entry, offset in the half, bytes)`` in order, and their ticket."""

    half: int
    ticket: Any
    pieces: list[tuple[_Entry, int, int]] = field(default_factory=list)
    taken: int = 0
    waited: bool = False


class SaveFeed:
    """Device tensors' bytes, in the order they were added, through two halves of one ring chunk."""

    def __init__(self, device: torch.device, ring: Ring, mover: Mover, piece: int, budget: ByteBudget) -> None:
        #: The device of every tensor this feed takes.
        self.device = device
        slot = ring.acquire()
        assert slot is not None
        self._ring, self._slot, self._mover, self._budget = ring, slot, mover, budget
        self.piece = piece
        budget.acquire(2 * piece)
        self._halves = [slot.tensor[:piece], slot.tensor[piece : 2 * piece]]
        self._host = [tensor_bytes(h, writable=False) for h in self._halves]
        self._free: deque[int] = deque([0, 1])
        self._queue: deque[_Entry] = deque()  # entries with bytes not yet issued
        self._issued: deque[_Batch] = deque()
        self._order: deque[_Entry] = deque()  # entries not yet consumed, in order
        self.more: Callable[[], bool] = lambda: False
        self._closed = False
        #: What a failed copy says it was doing.
        self._what = f"copying a synchronous save's tensors off {device}"

    def add(self, tensor: torch.Tensor) -> None:
        """Queue ``tensor``'s bytes (consumed with :meth:`pieces`, in the order added)."""
        entry = _Entry(tensor, flat_bytes(tensor))
        self._queue.append(entry)
        self._order.append(entry)

    def _fill(self) -> None:
        """Copy the next queued bytes into every free half (resolving items ahead to fill one up)."""
        with moving(self._what):
            self._fill_halves()

    def _fill_halves(self) -> None:
        while self._free:
            half = self._free[0]
            pieces: list[tuple[_Entry, int, int]] = []
            fill = 0
            while fill < self.piece:
                if not self._queue and not self.more():
                    break
                if not self._queue:
                    continue
                entry = self._queue[0]
                take = min(entry.src.numel() - entry.issued, self.piece - fill)
                self._mover.to_host(
                    self._halves[half][fill : fill + take], entry.src[entry.issued : entry.issued + take]
                )
                pieces.append((entry, fill, take))
                entry.issued += take
                fill += take
                if entry.issued == entry.src.numel():
                    self._queue.popleft()
            if not pieces:
                return
            self._free.popleft()
            self._issued.append(_Batch(half, self._mover.record(), pieces))

    def pieces(self, tensor: torch.Tensor) -> Iterator[memoryview]:
        """The host bytes of ``tensor`` (the next tensor added and not yet consumed), in order. Each view is
        valid until the next is asked for."""
        entry = self._order.popleft()
        if entry.tensor is not tensor:
            raise AssertionError("device items consumed out of the order they were queued in")
        left = entry.src.numel()
        while left:
            if not self._issued:
                self._fill()
            batch = self._issued[0]
            owner, at, n = batch.pieces[batch.taken]
            assert owner is entry
            if not batch.waited:
                with moving(self._what):
                    self._mover.wait(batch.ticket)
                batch.waited = True
            yield self._host[batch.half][at : at + n]
            left -= n
            batch.taken += 1
            if batch.taken == len(batch.pieces):  # the half is written: copy the next bytes into it
                self._issued.popleft()
                self._free.append(batch.half)
                self._fill()

    def close(self) -> None:
        """Wait for copies in flight, give the chunk back to the ring and the halves to the budget."""
        if self._closed:
            return
        self._closed = True
        try:
            with moving(self._what):
                self._mover.wait(self._mover.record())
        finally:  # a chunk whose copies failed is given back all the same (the next lease waits on nothing)
            self._ring.release(self._slot)
            self._budget.release(2 * self.piece)


class Resolver:
    """The items of a save in write order, each resolved once; once a feed is open, up to
    :data:`LOOKAHEAD` items ahead of the one written, their device tensors queued on the feed.

    ``open_feed(first)`` makes the feed for the device of the first feedable tensor (or None: device
    items are then written without one); ``frame_of(tensor)`` is the torch.save framing of a tensor's host
    copy (None: that tensor is written without the feed).
    """

    def __init__(
        self,
        order: list[Any],
        resolve: Callable[[Any], Any],
        resolved: dict[Any, tuple[Any, bytes | None]],
        open_feed: Callable[[torch.Tensor], SaveFeed | None],
        frame_of: Callable[[torch.Tensor], tuple[bytes, bytes] | None],
    ) -> None:
        self._order = order
        self._resolve = resolve
        self._resolved = resolved
        self._open_feed = open_feed
        self._frame_of = frame_of
        self._next = 0
        self._ahead: deque[tuple[Any, Any, bytes | None, Any]] = deque()
        self.feed: SaveFeed | None = None
        self._no_feed = False

    def _one(self) -> tuple[Any, Any, bytes | None, Any]:
        item = self._order[self._next]
        self._next += 1
        data, digest = self._resolved.pop(item.index, (None, None))
        if data is None:
            data = self._resolve(item)
        frame = None
        if not self._no_feed and feedable(data):
            frame = self._frame_of(data)
            if frame is not None and self.feed is None:
                self.feed = self._open_feed(data)
                if self.feed is None:
                    self._no_feed = True
                else:
                    self.feed.more = self._ahead_one
            if self.feed is None or data.device != self.feed.device:
                frame = None
            if frame is not None:
                assert self.feed is not None
                self.feed.add(data)
        return item, data, digest, frame

    def _ahead_one(self) -> bool:
        if len(self._ahead) >= LOOKAHEAD or self._next >= len(self._order):
            return False
        self._ahead.append(self._one())
        return True

    def take(self, item: Any) -> tuple[Any, bytes | None, tuple[bytes, bytes] | None]:
        """``item``'s data, its precomputed digest, and the framing of its host copy where its bytes come
        through :attr:`feed` (None: written without the feed)."""
        got, data, digest, frame = self._ahead.popleft() if self._ahead else self._one()
        if got is not item:
            raise AssertionError("items taken out of their write order")
        return data, digest, frame

    def close(self) -> None:
        if self.feed is not None:
            self.feed.close()


def save_resolver(
    order: list[Any],
    resolve: Callable[[Any], Any],
    resolved: dict[Any, tuple[Any, bytes | None]],
    staging: Any,
    budget: ByteBudget,
    part_size: Callable[[], int],
    alignment: int,
) -> Resolver:
    """The :class:`Resolver` of one rank's save: its feed opens at the first feedable device tensor, where a
    ring is on and the budget leaves room for two halves. ``alignment``: torch.save's storage alignment (0:
    no learned framing, as with compression: every item is written without a feed). ``part_size()``: the largest
    part of the save's objects (asked once, when a feed opens)."""

    def open_feed(first: torch.Tensor) -> SaveFeed | None:
        if not alignment:
            return None
        path = device_path(first.device, staging, _NO_FEED_COST)
        if path is None:
            return None
        ring, mover = path
        piece = piece_bytes(ring.chunk_bytes, budget, part_size())
        return SaveFeed(first.device, ring, mover, piece, budget) if piece else None

    def frame_of(tensor: torch.Tensor) -> tuple[bytes, bytes] | None:
        return framing.host_copy_frame(tensor, alignment) if alignment else None

    return Resolver(order, resolve, resolved, open_feed, frame_of)


def write_fed(
    stream: ObjectWriter, tensor: torch.Tensor, hasher: Any, feed: SaveFeed, frame: tuple[bytes, bytes]
) -> tuple[int, int]:
    """Write a device tensor as torch.save writes its host copy, its bytes coming off the device through
    ``feed``: each piece is hashed and copied into the part buffers while the next is copied off the device.
    Returns the offset of the raw bytes in what was written, and their length."""
    header, trailer = frame
    stream.write(header)
    for view in feed.pieces(tensor):
        if hasher is not None:
            hasher.update(view)
        stream.write(view)
    stream.write(trailer)
    return len(header), tensor.nbytes


__all__ = ["Resolver", "SaveFeed", "feedable", "piece_bytes", "save_resolver", "write_fed"]
