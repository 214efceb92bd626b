"""The process-wide pool of host arenas that ``dcp.async_save`` stages into, and the leases on them.

* an *arena* is a few large host slabs laid out for one state's tensors
  (sizes in order, 64-byte aligned); a later save of a state with the same
  tensor sizes reuses it, whatever writer stages it (users build a new writer
  for every step);
* an arena is *leased* from staging until the save that staged it has written
  its data (or, where another process writes it, until the staged tensors are
  gone); a save staged while the last one still uploads gets a second arena,
  so bytes in flight are never overwritten;
* the pool keeps at most ``StagingConfig.pool_bytes`` of idle arenas (default:
  the size of the state last staged) and :func:`free_staging_pool` drops them;
* with CUDA, a new arena is page-locked (``cudaHostRegister``, exact sizes,
  in slab-sized chunks) in a background thread after its first staging,
  while that save uploads (:meth:`Arena.pin_in_background`);
* pinning is an optimization: an arena that would take the host's pinned
  memory past ``StagingConfig.pinned_limit_bytes`` (all ranks of the host
  together, see :mod:`.pinledger`), or that the driver refuses to pin, stays
  pageable (its saves go through the ring), with one warning per process.

Without CUDA the same pool works with pageable memory.
"""

from __future__ import annotations

import threading
import weakref

import torch

from .cudapaths import degrade
from .devicering import free_rings
from .pinledger import LEDGER, default_cap
from .pinning import PinCapError, pin_tensor
from .stagingconfig import StagingConfig

#: Alignment of every tensor inside a slab (any dtype, and cache-line friendly).
_ALIGN = 64
#: What a staging arena left pageable costs (measured on an H200, 4 GiB: see the GPU guide).
_PAGEABLE_COST = (
    "the arena stays pageable and every async_save of this layout copies through the pinned ring "
    "(about 1.8x the stall of a pinned arena)"
)
#: Set when the driver refused to pin an arena: not asked again until :func:`free_staging_pool`.
_pin_refused = False


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class Arena:
    """Host slabs laid out for tensors of the given byte sizes, in order."""

    def __init__(self, sizes: tuple[int, ...], slab_bytes: int) -> None:
        self.sizes = sizes
        self.places: list[tuple[int, int]] = []
        slab_sizes: list[int] = []
        fill = 0
        for size in sizes:
            step = _aligned(size)
            if not slab_sizes or (fill + step > slab_bytes and fill > 0):
                slab_sizes.append(0)
                fill = 0
            self.places.append((len(slab_sizes) - 1, fill))
            fill += step
            slab_sizes[-1] = fill
        self.slabs = [torch.empty(max(n, 1), dtype=torch.uint8) for n in slab_sizes]
        self.nbytes = sum(s.numel() for s in self.slabs)
        self.pinned = False
        self._pinning: threading.Thread | None = None

    def views(self) -> list[torch.Tensor]:
        """One byte view per tensor, in order."""
        return [self.slabs[s].narrow(0, off, size) for (s, off), size in zip(self.places, self.sizes, strict=False)]

    def pin_in_background(self, cap: int | None) -> None:
        """Page-lock every slab from a background thread (the next save copies into pinned memory), within
        the host's ``cap`` on pinned memory; where that fails the arena stays pageable (see the module
        docstring)."""
        global _pin_refused
        if self.pinned or self._pinning is not None or _pin_refused:
            return

        def pin_all() -> None:
            global _pin_refused
            unpins = []
            try:
                limit = default_cap() if cap is None else cap
                if not LEDGER.fits(self.nbytes, limit):
                    raise PinCapError(
                        f"page-locking this arena's {self.nbytes} bytes would take the host's pinned memory "
                        f"past its cap of {limit} bytes (StagingConfig.pinned_limit_bytes)"
                    )
                for slab in self.slabs:
                    unpins.append(pin_tensor(slab, cap))
                self.pinned = True
            except Exception as exc:  # noqa: BLE001 - pageable memory still works, only slower
                for unpin in unpins:  # all or nothing: a partly pinned arena holds pinned bytes for no gain
                    unpin()
                if isinstance(exc, PinCapError):  # tried again for later saves: the host's pinned bytes vary
                    self._pinning = None
                else:
                    _pin_refused = True  # the driver said no: not asked again until free_staging_pool()
                degrade("page-locking an async_save staging arena", _PAGEABLE_COST, exc)

        self._pinning = threading.Thread(target=pin_all, name="dcp_cloud-pin", daemon=True)
        self._pinning.start()

    def wait_pinned(self) -> None:
        if self._pinning is not None:
            self._pinning.join()


class HostPool:
    """Arenas kept between saves, one process-wide instance (:data:`POOL`). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[Arena] = []
        self._leased = 0

    def acquire(self, sizes: tuple[int, ...], config: StagingConfig) -> Arena:
        """An arena for ``sizes``, reused when an idle one has exactly that layout."""
        if config.pool:
            with self._lock:
                for i, arena in enumerate(self._idle):
                    if arena.sizes == sizes:
                        del self._idle[i]
                        self._leased += arena.nbytes
                        break
                else:
                    arena = None
            if arena is not None:
                arena.wait_pinned()
                return arena
        arena = Arena(sizes, config.slab_bytes)
        with self._lock:
            self._leased += arena.nbytes
        return arena

    def release(self, arena: Arena, config: StagingConfig) -> None:
        """Give a leased arena back: kept for the next save within ``config.pool_bytes``, else freed."""
        with self._lock:
            self._leased -= arena.nbytes
            if not config.pool:
                return
            keep = arena.nbytes if config.pool_bytes is None else config.pool_bytes
            if arena.nbytes > keep:
                return
            self._idle.insert(0, arena)
            held = 0
            kept = []
            for idle in self._idle:  # newest first
                if held + idle.nbytes <= keep:
                    kept.append(idle)
                    held += idle.nbytes
            self._idle = kept

    def clear(self) -> int:
        """Drop every idle arena; returns the bytes freed (leased arenas are freed when released)."""
        with self._lock:
            freed = sum(a.nbytes for a in self._idle)
            self._idle = []
        return freed

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return sum(a.nbytes for a in self._idle)

    @property
    def leased_bytes(self) -> int:
        with self._lock:
            return self._leased


#: The process-wide pool every writer stages into.
POOL = HostPool()


def free_staging_pool() -> int:
    """Free the host buffers kept for staging between saves; returns the bytes freed.

    Buffers of a save still in flight are freed once it finishes. The pinned
    rings that device tensors pass through are freed too (made again at the
    next save or load from or into a device), and page-locking that failed
    is tried again.
    """
    global _pin_refused
    _pin_refused = False
    return POOL.clear() + free_rings()


class Lease:
    """One staged state's arena; released once, explicitly or when the staged tensors are gone."""

    def __init__(self, arena: Arena, config: StagingConfig) -> None:
        self._finalizer = weakref.finalize(self, POOL.release, arena, config)

    def release(self) -> None:
        self._finalizer()
