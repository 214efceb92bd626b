"""The pinned ring device tensors pass through on their way to and from host memory, and the copy engines.

Copying a CUDA tensor into pageable host memory is slow (the driver stages
it through a small pinned buffer of its own, one copy at a time, and faults
fresh pages in on one thread); into page-locked memory it runs at the
link's speed, asynchronously. Pinning the destination of every save or load
is no answer either (``cudaHostRegister`` costs ~0.3 s per GiB). So every
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

A :class:`Mover` is how bytes move between a device and a ring chunk: on
CUDA, ``non_blocking`` copies on a side stream with an event per batch; on
the CPU (tests route CPU tensors through the same code with
:func:`route_cpu`) a plain copy, or with ``deferred=True`` a copy that runs
only when its ticket is waited for, so a consumer that forgot to wait reads
stale bytes and the test fails.

The ring is an optimization, so it degrades and never fails a save or a
load: where it cannot be set up (page-locking refused, the pinned memory
cap of :mod:`.pinledger` reached, a stream or event call failing before any
byte moved) :func:`device_path` answers None, the caller takes the plain
path that existed before the ring, and the process logs one warning naming
what failed and what it costs. ``DCP_CLOUD_CUDA_PATHS=off`` turns every
CUDA-specific path off the same way (:func:`cuda_paths_on`). A failure once
bytes are moving is a failure of the data: :func:`moving` raises it as
:class:`~dcp_cloud.errors.DeviceCopyError`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from ...errors import DcpCloudError, DeviceCopyError
from ...format.torchprivate import pickles_tensor_metadata
from .pinledger import LEDGER, default_cap

log = logging.getLogger("dcp_cloud")

MiB = 1 << 20
#: cudaHostRegisterPortable: the pinned pages count as pinned in every CUDA context.
_HOST_REGISTER_PORTABLE = 1

#: Device types whose tensors go through the ring (CUDA; tests add the CPU with :func:`route_cpu`).
_ROUTED: frozenset[str] = frozenset({"cuda"})
#: With the CPU routed: copies run when waited for (see the module docstring).
_DEFERRED = False
#: With the CPU routed: its ring is page-locked as a CUDA one is (tests of the pinning paths).
_PIN_CPU = False
#: The one switch: ``off`` (or 0 / false / no) turns every CUDA-specific path off (the ring, the feed, the
#: landing chunks, page-locked arenas, side streams); saves and loads take the plain paths.
SWITCH = "DCP_CLOUD_CUDA_PATHS"
_OFF = frozenset({"0", "off", "false", "no"})
#: What failed already in this process (one warning each).
_warned: set[str] = set()
#: Devices whose ring could not be made: not tried again until :func:`free_rings`.
_no_ring: set[tuple[str, int]] = set()


def cuda_paths_on() -> bool:
    """Whether the CUDA-specific paths are on (``DCP_CLOUD_CUDA_PATHS`` is not ``off``); read at every use."""
    return os.environ.get(SWITCH, "").strip().lower() not in _OFF


def degrade(what: str, cost: str, exc: BaseException | None = None) -> None:
    """Log, once per process for each ``what``, that an optimization could not be set up and what it costs."""
    if what in _warned:
        log.debug("%s failed again (%r); %s", what, exc, cost)
        return
    _warned.add(what)
    cause = f" ({type(exc).__name__}: {exc})" if exc is not None else ""
    log.warning(
        "%s failed%s; %s. Saves and loads go on without it (set %s=off to turn every CUDA-specific path "
        "off; see the troubleshooting page).",
        what,
        cause,
        cost,
        SWITCH,
    )


class PinCapError(RuntimeError):
    """Page-locking more memory would take this host past the cap on pinned memory (see :mod:`.pinledger`)."""


@contextlib.contextmanager
def moving(what: str) -> Iterator[None]:
    """Raise a failure of device copies under way (after the path was set up) as a DeviceCopyError."""
    try:
        yield
    except DcpCloudError:
        raise
    except Exception as exc:
        raise DeviceCopyError(
            f"{what} failed while bytes were moving ({type(exc).__name__}: {exc}); nothing of this save is "
            "committed, and a load's destination tensors are incomplete. A CUDA error here usually means the "
            f"device itself failed; if it recurs, {SWITCH}=off takes the plain copy paths"
        ) from exc


def routed(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s bytes go through the ring (it lives on a device)."""
    return tensor.device.type in _ROUTED


def plain(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s value is exactly its memory, in order: strided, contiguous, not quantized or
    nested, no lazy conjugate or negative bit (what the ring moves is bytes)."""
    return (
        tensor.layout == torch.strided
        and not tensor.is_quantized
        and not tensor.is_nested
        and tensor.is_contiguous()
        and not pickles_tensor_metadata(tensor)  # conj / neg bits
    )


@contextlib.contextmanager
def route_cpu(deferred: bool = False, pin: bool = False) -> Iterator[None]:
    """Route CPU tensors through the ring, as if they lived on a device (tests of the ring's logic); with
    ``pin``, a CPU ring is page-locked like a CUDA one (where the config pins)."""
    global _ROUTED, _DEFERRED, _PIN_CPU
    saved = _ROUTED, _DEFERRED, _PIN_CPU
    _ROUTED, _DEFERRED, _PIN_CPU = _ROUTED | {"cpu"}, deferred, pin
    try:
        yield
    finally:
        _ROUTED, _DEFERRED, _PIN_CPU = saved


def _host_register(ptr: int, nbytes: int) -> int:
    """cudaHostRegister (portable); the CUDA error code (tests replace it to refuse page-locking)."""
    return int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _HOST_REGISTER_PORTABLE))


def _host_unregister(ptr: int) -> int:
    return int(torch.cuda.cudart().cudaHostUnregister(ptr))


def pin_tensor(tensor: torch.Tensor, cap: int | None = None) -> Any:
    """Page-lock ``tensor``'s memory in place (exact size, unlike the caching pinned allocator's powers of
    two), unlocked when the tensor is freed. The one pin helper: staging arenas and ring chunks use it.

    The bytes count in the host's ledger of pinned memory (:mod:`.pinledger`) until they are unlocked;
    past ``cap`` (None: the default cap) it raises :class:`PinCapError` and pins nothing. Returns a
    callable that unlocks the memory early (once; the tensor's end then does nothing more).

    Through the CUDA runtime that ``torch.cuda.cudart()`` exposes, as torch's own private
    ``_pin_memory_utils`` (2.7+) does it: public, and present on every torch the package supports.
    """
    ptr, nbytes = tensor.data_ptr(), tensor.nbytes
    limit = default_cap() if cap is None else cap
    if not LEDGER.reserve(nbytes, limit):
        raise PinCapError(
            f"page-locking {nbytes} more bytes would take this host's pinned memory past its cap of {limit} "
            "bytes (StagingConfig.pinned_limit_bytes)"
        )
    try:
        err = _host_register(ptr, nbytes)
    except BaseException:
        LEDGER.release(nbytes)
        raise
    if err != 0:
        LEDGER.release(nbytes)
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with cudaError {err}")
    return weakref.finalize(tensor, _unpin, ptr, nbytes)


def _unpin(ptr: int, nbytes: int) -> None:
    try:
        err = _host_unregister(ptr)
        if err != 0:
            log.warning("cudaHostUnregister of pinned host memory failed with cudaError %d", err)
    finally:
        LEDGER.release(nbytes)


class Mover:
    """Copies between device tensors and host chunks, in order, with tickets to wait for."""

    def begin(self) -> None:
        """Order the copies after the work the caller's stream has queued so far."""

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def record(self) -> Any:
        """A ticket for every copy enqueued so far."""
        return None

    def wait(self, ticket: Any) -> None:
        """Block until the copies of ``ticket`` are done."""

    def publish(self) -> None:
        """Order the caller's stream after every copy enqueued so far (the copied data may be used)."""

    def synchronize(self) -> None:
        """Block until every copy is done."""


class DeferredMover(Mover):
    """CPU copies that run when their ticket is waited for (tests: a missing wait shows as stale bytes)."""

    def __init__(self) -> None:
        self._queue: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._done = 0
        self._lock = threading.Lock()

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        # Like a copy on a stream, it reads ``src`` when it runs: a source changed before the wait (training
        # let go too early) or a chunk reused before it (the ring) shows in the copied bytes.
        with self._lock:
            self._queue.append((dst, src))

    to_device = to_host

    def record(self) -> Any:
        with self._lock:
            return self._done + len(self._queue)

    def wait(self, ticket: Any) -> None:
        with self._lock:
            while self._done < ticket:
                dst, src = self._queue.pop(0)
                dst.copy_(src)
                self._done += 1

    def publish(self) -> None:
        self.synchronize()

    def synchronize(self) -> None:
        self.wait(self.record())


class CudaMover(Mover):
    """``non_blocking`` copies on a side stream of one device; tickets are events."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def begin(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)

    def record(self) -> Any:
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def wait(self, ticket: Any) -> None:
        if ticket is not None:
            ticket.synchronize()

    def publish(self) -> None:
        torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def synchronize(self) -> None:
        self.stream.synchronize()


def mover_for(device: torch.device) -> Mover:
    """The copy engine for tensors on ``device``."""
    if device.type == "cuda":
        return CudaMover(device)
    return DeferredMover() if _DEFERRED else Mover()


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
                    (cuda or _PIN_CPU) and pin,
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
