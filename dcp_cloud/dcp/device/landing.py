"""Where a load's bytes for device tensors land: pinned ring chunks, copied to the device as requests land.

A load into CUDA tensors used to read each item into a pageable temporary
of the whole tensor, copied to the device once the item was complete. Here
the load leases a few chunks of the process's pinned ring (see
:mod:`.devicering`) and uses them as bump regions: every request that holds
bytes of a device tensor reads them into a region, and when the request
lands (:meth:`Landing.move`) those bytes are copied to the tensor
asynchronously, on a side stream, while the next requests are read. A region
is used again once the copies out of it are done. The bytes in a region are
leased from the load's byte budget until their request lands, like any
temporary.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from ...format.tensorbytes import tensor_bytes
from .cudapaths import moving
from .devicering import Ring, Slot, device_path, ring_for
from .movers import Mover

#: Alignment of every allocation in a region (cache lines).
_ALIGN = 64
#: What a load into a device costs without the landing chunks (measured on an H200: see the GPU guide).
_NO_LANDING_COST = "loads into device tensors read each item into a host temporary, then copy it (serially)"


class DeviceSpan:
    """Bytes ``[at, at + length)`` of a device tensor's flat bytes, in place of a memoryview in a load
    item's fills (see :meth:`~dcp_cloud.dcp.load.loaditem.LoadItem.views`): the run gives it memory to land
    in with :meth:`Landing.place`."""

    __slots__ = ("at", "flat", "length")

    def __init__(self, flat: torch.Tensor, at: int, length: int) -> None:
        self.flat = flat
        self.at = at
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, key: slice) -> DeviceSpan:
        start, stop, _ = key.indices(self.length)
        return DeviceSpan(self.flat, self.at + start, max(0, stop - start))


class _Region:
    """One leased ring chunk: bytes handed out so far, allocations not yet moved, the last copy's ticket."""

    __slots__ = ("fill", "host", "outstanding", "slot", "ticket")

    def __init__(self, slot: Slot) -> None:
        self.slot = slot
        self.host = tensor_bytes(slot.tensor)
        self.fill = 0
        self.outstanding = 0
        self.ticket: Any = None


#: One landing: the region, the host bytes and the device bytes they are copied to.
Move = tuple[_Region, torch.Tensor, torch.Tensor]


class Landing:
    """``chunks`` leased ring chunks where a load's device bytes land (see the module docstring)."""

    def __init__(self, device: torch.device, ring: Ring, mover: Mover, chunks: int) -> None:
        self.device = device
        self.ring = ring
        self.mover = mover
        self._regions: deque[_Region] = deque(_Region(s) for s in ring.acquire_many(chunks))
        #: What a failed copy says it was doing.
        self._what = f"copying a load's bytes onto {device}"

    def place(self, span: DeviceSpan) -> tuple[memoryview, Move] | None:
        """Host memory for ``span`` and the copy to make when it has landed; None while no region has room
        (the caller lands requests in flight, or sends the one it builds, and asks again)."""
        n = span.length
        region = self._regions[-1]
        at = (region.fill + _ALIGN - 1) // _ALIGN * _ALIGN
        if at + n > self.ring.chunk_bytes:
            oldest = self._regions[0]
            if oldest.outstanding:
                return None
            if oldest.ticket is not None:
                with moving(self._what):
                    self.mover.wait(oldest.ticket)  # the copies out of it are done: use it again
            self._regions.rotate(-1)
            region, at = oldest, 0
            region.fill, region.ticket = 0, None
        region.fill = at + n
        region.outstanding += 1
        host = region.slot.tensor[at : at + n]
        return region.host[at : at + n], (region, host, span.flat[span.at : span.at + n])

    def place_all(
        self, views: list[Any], lease: Callable[[int], int], make_room: Callable[[], bool]
    ) -> tuple[list[memoryview], list[Move], int]:
        """Pinned memory for the device spans among ``views``, each leased from the load's budget with
        ``lease``; returns the views to read into, the copies to make when they land, and the bytes leased.
        While no region has room, ``make_room()`` lands (or sends) an earlier request of the load."""
        out: list[memoryview] = []
        moves: list[Move] = []
        leased = 0
        for view in views:
            if not isinstance(view, DeviceSpan):
                out.append(view)
                continue
            leased += lease(len(view))
            placed = self.place(view)
            while placed is None:
                if not make_room():
                    raise AssertionError("no room in the landing chunks for a request's device bytes")
                placed = self.place(view)
            out.append(placed[0])
            moves.append(placed[1])
        return out, moves, leased

    def move(self, moves: list[Move]) -> None:
        """Copy landed bytes to their device tensors (asynchronously); their regions may be reused once done."""
        if not moves:
            return
        with moving(self._what):
            for _region, host, dest in moves:
                self.mover.to_device(dest, host)
            ticket = self.mover.record()
        for region, _host, _dest in moves:
            region.outstanding -= 1
            region.ticket = ticket

    def publish(self) -> None:
        """Order the caller's stream after every copy so far (before a tensor goes to the planner)."""
        with moving(self._what):
            self.mover.publish()

    def forget(self, moves: list[Move]) -> None:
        """Drop allocations whose request will never land (a failed load)."""
        for region, _host, _dest in moves:
            region.outstanding -= 1

    def close(self) -> None:
        """Wait for every copy, and give the chunks back to the ring (also where the copies failed)."""
        regions, self._regions = self._regions, deque()
        try:
            with moving(self._what):
                self.mover.synchronize()
        finally:
            for region in regions:
                self.ring.release(region.slot)


def open_landing(device: torch.device, staging: Any, request_bytes: int, budget_bytes: int) -> Landing | None:
    """A landing for a load into ``device`` with ``staging``'s ring, or None where it cannot serve: the ring
    is off, has fewer than two chunks, or a chunk holds less than one request (``request_bytes``). It leases
    as many chunks as the load's byte budget (``budget_bytes``) fills, at least two."""
    ring = ring_for(device, staging, _NO_LANDING_COST)
    if ring is None or ring.chunks < 2 or ring.chunk_bytes < request_bytes:
        return None
    path = device_path(device, staging, _NO_LANDING_COST)
    if path is None:
        return None
    ring, mover = path
    chunks = min(ring.chunks, max(2, -(-budget_bytes // ring.chunk_bytes)))
    return Landing(device, ring, mover, chunks)
