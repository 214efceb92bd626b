"""The pinned ring device tensors pass through on their way to and from host memory.

Copying a CUDA tensor into pageable host memory is slow (the driver stages
it through a small pinned buffer of its own, one copy at a time, and faults
fresh pages in on one thread); into page-locked memory it runs at the
link's speed, asynchronously. Pinning the destination of every save or load
is no answer either (``cudaHostRegister`` takes time per byte locked). So every
process keeps, per device, a small :class:`Ring` of page-locked chunks
(``StagingConfig.ring_chunks`` x ``ring_chunk_bytes``, allocated at first
use, freed by ``free_staging_pool()``), and:

* the first ``async_save`` of a layout copies the state through it into a
  fresh arena (:mod:`.ringstage`): device copies of one chunk overlap host
  threads copying the chunk before it into the arena;
* a synchronous save from a device streams each item through one chunk,
  double-buffered (:mod:`.devicefeed`): while one half is hashed and
  written, the next is copied off the device;
* a load into a device lands request bodies in a chunk and copies them to
  the device while the next requests are read (:mod:`.landing`).

The ring is an optimization (see :mod:`.cudapaths`): where it cannot be set
up, :func:`device_path` answers None and the caller takes the plain path,
with one warning per process naming what failed and what it costs.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from .cudapaths import cpu_ring_pinned, cuda_paths_on, degrade
from .movers import Mover, mover_for
from .pinning import pin_tensor

#: Devices whose ring could not be made: not tried again until :func:`free_rings`.
_no_ring: set[tuple[str, int]] = set()


class Slot:
    """One chunk of a ring: ``tensor`` (uint8), and the ticket of device copies still reading or writing it."""

    __slots__ = ("fence", "index", "mover", "tensor")

    def __init__(self, index: int, tensor: torch.Tensor) -> None:
        self.index = index
        self.tensor = tensor
        self.fence: Any = None
        self.mover: Mover | None = None


class Ring:
    """``chunks`` host chunks of ``chunk_bytes`` for one device, page-locked with ``pin``. Thread-safe.

    A user leases whole chunks (:meth:`acquire`) and gives each back
    (:meth:`release`), with the ticket of device copies that may still use
    it: the next lease of that chunk waits for them first. A user that
    already holds a chunk should not block for another (``block=False``)
    unless it can make progress alone, so two users never wait for each other.
    """

    def __init__(self, device: torch.device, chunks: int, chunk_bytes: int, pin: bool, cap: int | None = None) -> None:
        self.device = device
        self.chunk_bytes = chunk_bytes
        self.pinned = pin
        self._slots = []
        for i in range(chunks):
            tensor = torch.empty(chunk_bytes, dtype=torch.uint8)
            if pin:
                pin_tensor(tensor, cap)
            self._slots.append(Slot(i, tensor))
        self._free = list(self._slots)
        self._cond = threading.Condition()
        #: Most chunks ever leased at once (tests, statistics).
        self.peak_leased = 0

    @property
    def chunks(self) -> int:
        return len(self._slots)

    @property
    def nbytes(self) -> int:
        return self.chunk_bytes * len(self._slots)

    @property
    def leased(self) -> int:
        with self._cond:
            return len(self._slots) - len(self._free)

    def acquire(self, block: bool = True) -> Slot | None:
        """A free chunk (waiting for one with ``block``), its earlier device copies done."""
        with self._cond:
            while not self._free:
                if not block:
                    return None
                self._cond.wait()
            slot = self._free.pop(0)
            self.peak_leased = max(self.peak_leased, len(self._slots) - len(self._free))
        if slot.fence is not None and slot.mover is not None:
            slot.mover.wait(slot.fence)
        slot.fence = slot.mover = None
        return slot

    def acquire_many(self, count: int) -> list[Slot]:
        """``count`` chunks at once (waiting until that many are free together: a user that holds several
        chunks never waits for more)."""
        count = min(count, len(self._slots))
        with self._cond:
            while len(self._free) < count:
                self._cond.wait()
            slots, self._free = self._free[:count], self._free[count:]
            self.peak_leased = max(self.peak_leased, len(self._slots) - len(self._free))
        for slot in slots:
            if slot.fence is not None and slot.mover is not None:
                slot.mover.wait(slot.fence)
            slot.fence = slot.mover = None
        return slots

    def release(self, slot: Slot, mover: Mover | None = None, fence: Any = None) -> None:
        """Give ``slot`` back; ``fence``: the ticket (of ``mover``) of copies that may still use it."""
        slot.mover, slot.fence = mover, fence
        with self._cond:
            self._free.append(slot)
            self._cond.notify_all()


_rings: dict[tuple[str, int], Ring] = {}
_rings_lock = threading.Lock()


def ring_for(device: torch.device, config: Any, cost: str = "device copies go to pageable memory") -> Ring | None:
    """The process's ring for ``device`` (made with ``config``'s sizes at first use), or None where the ring
    is off: ``ring_chunks=0``, a CUDA device with page-locking or the CUDA paths off (a pageable ring buys
    nothing), or the ring could not be made (pinned memory refused or over its cap: one warning per
    process, ``cost`` saying what the caller does instead; not tried again until :func:`free_rings`)."""
    if config.ring_chunks <= 0 or not cuda_paths_on():
        return None
    cuda = device.type == "cuda"
    pin = config.pin_memory if config.pin_memory is not None else torch.cuda.is_available()
    if cuda and not pin:
        return None
    try:
        index = device.index if device.index is not None else (torch.cuda.current_device() if cuda else 0)
    except Exception as exc:  # noqa: BLE001 - no usable device context: the plain path finds out for itself
        degrade(f"finding the current {device.type} device for the pinned ring", cost, exc)
        return None
    key = (device.type, index)
    with _rings_lock:
        ring = _rings.get(key)
        if ring is None and key not in _no_ring:
            size = config.ring_chunks * config.ring_chunk_bytes
            try:
                ring = Ring(
                    torch.device(device.type, index),
                    config.ring_chunks,
                    config.ring_chunk_bytes,
                    (cuda or cpu_ring_pinned()) and pin,
                    getattr(config, "pinned_limit_bytes", None),
                )
            except Exception as exc:  # noqa: BLE001 - an optimization: the plain path goes on
                _no_ring.add(key)
                what = f"making the pinned ring for {device.type}:{index} ({size >> 20} MiB)"
                degrade(what, cost, exc)
                return None
            _rings[key] = ring
        return ring


def device_path(device: torch.device, config: Any, cost: str) -> tuple[Ring, Mover] | None:
    """The ring of ``device`` and a copy engine ordered after the caller's stream, or None: the caller takes
    the plain path, where the ring is off or either part cannot be set up (one warning per process naming
    what failed, ``cost`` saying what the plain path costs). Nothing has moved yet when this fails."""
    ring = ring_for(device, config, cost)
    if ring is None:
        return None
    try:
        mover = mover_for(device)
        mover.begin()
    except Exception as exc:  # noqa: BLE001 - an optimization: the plain path goes on
        degrade(f"setting up the copy stream for {device}", cost, exc)
        return None
    return ring, mover


def free_rings() -> int:
    """Drop every ring (chunks still leased are freed when given back); returns the bytes dropped. A ring that
    could not be made is tried again at its next use."""
    with _rings_lock:
        freed = sum(r.nbytes for r in _rings.values())
        _rings.clear()
        _no_ring.clear()
    return freed


def ring_bytes() -> int:
    """Bytes of the rings this process holds."""
    with _rings_lock:
        return sum(r.nbytes for r in _rings.values())
