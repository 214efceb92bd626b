"""Staging for ``dcp.async_save``: the state is copied into host buffers that outlive one save.

``dcp.async_save`` stages the state dict before it returns, so that training
may change its tensors while the upload runs. Torch's default stager (used
for any writer that is not an ``AsyncStager``) allocates fresh pageable
memory on every save. :class:`~dcp_cloud.CloudWriter` is an ``AsyncStager``
and stages into a process-wide :class:`HostPool` instead:

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
* with CUDA, slabs are page-locked (``cudaHostRegister``, exact sizes, in
  slab-sized chunks) and device tensors are copied with ``non_blocking=True``
  on a side stream, with one synchronize at the end. A new arena is pinned
  in a background thread after its first staging, while that save uploads,
  so the first save pays no pinning. The first save copies through the
  process's small pinned ring instead (:mod:`.ringstage`): device copies
  into one ring chunk overlap host threads copying the chunk before into
  the still pageable arena; later saves copy straight into the pinned arena.
  With ``pin_arenas=False`` arenas stay pageable and every save goes through
  the ring.
* pinning is an optimization: an arena that would take the host's pinned
  memory past ``StagingConfig.pinned_limit_bytes`` (all ranks of the host
  together, see :mod:`.pinledger`), or that the driver refuses to pin, stays
  pageable (its saves go through the ring), with one warning per process;
  a ring that cannot be made leaves device copies going straight to
  pageable memory, as before the ring. ``DCP_CLOUD_CUDA_PATHS=off`` turns
  all of it off: plain blocking copies into pageable arenas.

Without CUDA the same pool works with pageable memory.
"""

from __future__ import annotations

import copy
import io
import logging
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from ...config import cpu_share
from ...errors import ConfigError
from ...format.torchprivate import dtensor_like, is_sharded_tensor
from .cudapaths import cuda_paths_on, degrade, moving, plain, routed
from .devicering import device_path, free_rings
from .pinledger import LEDGER, default_cap
from .pinning import PinCapError, pin_tensor
from .ringstage import copy_through_ring

log = logging.getLogger("dcp_cloud")

MiB = 1024 * 1024
#: Alignment of every tensor inside a slab (any dtype, and cache-line friendly).
_ALIGN = 64
#: What a staging arena left pageable costs (measured on an H200, 4 GiB: see the GPU guide).
_PAGEABLE_COST = (
    "the arena stays pageable and every async_save of this layout copies through the pinned ring "
    "(about 1.8x the stall of a pinned arena)"
)
#: What staging without the ring costs.
_NO_RING_COST = "async_save copies device tensors straight into pageable memory (a slower first stall)"
#: Set when the driver refused to pin an arena: not asked again until :func:`free_staging_pool`.
_pin_refused = False


@dataclass(frozen=True)
class StagingConfig:
    """How a writer stages a state dict for ``dcp.async_save``."""

    #: Keep staging buffers in the process-wide pool between saves (and
    #: writers). Off: every save allocates its buffers and frees them after.
    pool: bool = True
    #: Most bytes of idle buffers the pool keeps after a save; ``None`` keeps
    #: one arena of the size of the state last staged.
    pool_bytes: int | None = None
    #: Page-lock pooled buffers for fast device-to-host copies; ``None``: when CUDA is available.
    pin_memory: bool | None = None
    #: Largest slab of one arena; a larger tensor gets a slab of its own size.
    slab_bytes: int = 256 * MiB
    #: Stage in a background thread: ``stage`` returns a Future, and
    #: ``dcp.async_save`` returns an ``AsyncSaveResponse`` whose
    #: ``staging_completion`` says when training may change the state again.
    background: bool = False
    #: Chunks of the process's pinned ring per device (see :mod:`.devicering`), which device tensors pass
    #: through: the first save of a layout into its arena, every synchronous save from a device, every load
    #: into one. ``0``: no ring (device copies go straight to pageable memory, as before the ring).
    ring_chunks: int = 4
    #: Bytes of one ring chunk. The ring is made at its first use with the sizes of the config in use then,
    #: and kept until ``free_staging_pool()``.
    ring_chunk_bytes: int = 64 * MiB
    #: Page-lock a new arena in the background after its first save (the next saves copy straight into it,
    #: as fast as the device copies). ``False``: arenas stay pageable and every save goes through the ring
    #: (a device copy plus a host copy each time, and no ``cudaHostRegister`` of the arena).
    pin_arenas: bool = True
    #: Host threads copying ring chunks into an arena (the first save of a layout faults its pages in on
    #: them); ``None``: this rank's share of the host's CPUs (CPUs / ``LOCAL_WORLD_SIZE``), at most 16.
    copy_threads: int | None = None
    #: Most bytes of page-locked memory that the staging arenas and rings of every dcp_cloud process on
    #: this host hold together (counted across processes, see the GPU guide). ``None``: half the host's
    #: memory, or of the container's memory limit where that is lower. Past it, arenas stay pageable (their
    #: saves go through the ring) and a ring that does not fit is not made, with one warning per process.
    pinned_limit_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.pool_bytes is not None and self.pool_bytes < 0:
            raise ConfigError(f"pool_bytes must be >= 0 or None, got {self.pool_bytes}")
        if self.slab_bytes < MiB:
            raise ConfigError(f"slab_bytes must be >= 1 MiB, got {self.slab_bytes}")
        if self.background and not async_save_takes_futures():
            raise ConfigError(
                f"StagingConfig(background=True) needs a dcp.async_save that accepts a staging Future "
                f"(torch's AsyncSaveResponse), which torch {torch.__version__} lacks: upgrade torch or "
                "leave background off (staging then copies before async_save returns)"
            )
        if self.ring_chunks < 0:
            raise ConfigError(f"ring_chunks must be >= 0, got {self.ring_chunks}")
        if self.ring_chunk_bytes < MiB:
            raise ConfigError(f"ring_chunk_bytes must be >= 1 MiB, got {self.ring_chunk_bytes}")
        if self.copy_threads is not None and self.copy_threads < 1:
            raise ConfigError(f"copy_threads must be >= 1 or None, got {self.copy_threads}")
        if self.pinned_limit_bytes is not None and self.pinned_limit_bytes < 0:
            raise ConfigError(f"pinned_limit_bytes must be >= 0 or None, got {self.pinned_limit_bytes}")

    @property
    def host_threads(self) -> int:
        """Host threads copying ring chunks into arenas."""
        return self.copy_threads or default_copy_threads()


#: Most host-copy threads by default: on an H200 host (16 CPUs, 4 GiB state) the first stall's staging
#: took 0.61 s with 8 threads and 0.35 s with 16 (faulting in a fresh arena's pages bounds it).
MAX_COPY_THREADS = 16


def default_copy_threads() -> int:
    """This rank's share of the CPUs it may run on (torchrun's ``LOCAL_WORLD_SIZE`` ranks share the host),
    between 1 and :data:`MAX_COPY_THREADS`."""
    return min(MAX_COPY_THREADS, cpu_share())


def async_save_takes_futures() -> bool:
    """Whether this torch's ``dcp.async_save`` accepts a Future from ``stage`` and returns an AsyncSaveResponse."""
    from torch.distributed.checkpoint import state_dict_saver

    return hasattr(state_dict_saver, "AsyncSaveResponse")


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


def _collect(obj: Any, out: list[torch.Tensor]) -> None:
    """Append every plain tensor of ``obj`` that staging copies (DTensors by their local shard)."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        with torch.no_grad():  # the local shard itself, not an autograd view of it
            out.append(obj.to_local())
    elif isinstance(obj, torch.Tensor) and not is_sharded_tensor(obj):
        out.append(obj)
    elif isinstance(obj, dict):
        for value in obj.values():
            _collect(value, out)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _collect(value, out)


def _rebuild(obj: Any, staged: Callable[[], torch.Tensor]) -> Any:
    """``obj`` with every collected tensor replaced by the next staged one (same order as :func:`_collect`)."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        return dtensor_like(staged(), obj)
    if isinstance(obj, torch.Tensor):
        if is_sharded_tensor(obj):
            return copy.deepcopy(obj)  # legacy ShardedTensor: a copy on its own device
        return staged()
    if isinstance(obj, dict):
        return {k: _rebuild(v, staged) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rebuild(v, staged) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_rebuild(v, staged) for v in obj)
    if isinstance(obj, (int, float, str, bytes, bool)) or obj is None:
        return obj
    if isinstance(obj, io.BytesIO):
        return io.BytesIO(obj.getvalue())
    return copy.deepcopy(obj)


def _copy_through_rings(
    sources: list[torch.Tensor], dests: list[torch.Tensor], config: StagingConfig
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Copy the contiguous device sources through their device's ring (see :mod:`.ringstage`); returns the
    sources and destinations left to copy."""
    by_device: dict[torch.device, list[int]] = {}
    for i, src in enumerate(sources):
        if routed(src) and src.nbytes and plain(src):
            by_device.setdefault(src.device, []).append(i)
    done: set[int] = set()
    for device, indices in by_device.items():
        path = device_path(device, config, _NO_RING_COST)
        if path is None:
            continue
        ring, mover = path
        with torch.no_grad(), moving(f"staging {len(indices)} tensors of {device} through the pinned ring"):
            copy_through_ring(
                [sources[i] for i in indices], [dests[i] for i in indices], ring, mover, config.host_threads
            )
        done.update(indices)
    if not done:
        return sources, dests
    left = [i for i in range(len(sources)) if i not in done]
    return [sources[i] for i in left], [dests[i] for i in left]


def _side_stream(device: torch.device) -> Any:
    """A stream ordered after ``device``'s current one, or None (the CUDA paths off, or it cannot be made)."""
    if not cuda_paths_on():
        return None
    try:
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))  # everything training queued is in the copy
    except Exception as exc:  # noqa: BLE001 - an optimization: blocking copies on the current stream
        degrade(f"setting up a copy stream for {device}", "staging copies block on the current stream", exc)
        return None
    return side


def _copy_all(sources: list[torch.Tensor], dests: list[torch.Tensor]) -> None:
    """Copy every source into its destination; device tensors non-blocking on a side stream, one sync
    (blocking copies on the current stream where no side stream can be had)."""
    on_device = [i for i, s in enumerate(sources) if s.device.type == "cuda"]
    with torch.no_grad():
        if on_device:
            device = sources[on_device[0]].device
            side = _side_stream(device)
            with moving(f"staging {len(on_device)} tensors of {device}"):
                if side is None:
                    for i in on_device:
                        dests[i].copy_(sources[i])
                else:
                    with torch.cuda.stream(side):
                        for i in on_device:
                            dests[i].copy_(sources[i], non_blocking=True)
        for i, src in enumerate(sources):
            if src.device.type != "cuda":
                dests[i].copy_(src)
        if on_device and side is not None:
            with moving(f"staging {len(on_device)} tensors of {device}"):
                side.synchronize()


def stage(state_dict: dict[str, Any], config: StagingConfig) -> tuple[dict[str, Any], Lease]:
    """A training-safe copy of ``state_dict`` in pooled host memory, and the lease of that memory.

    Tensors (and DTensors' local shards) are copied into one arena;
    immutable values are shared; other objects are deep-copied.
    """
    sources: list[torch.Tensor] = []
    _collect(state_dict, sources)
    sizes = tuple(int(t.numel()) * t.element_size() for t in sources)
    pin = (config.pin_memory if config.pin_memory is not None else torch.cuda.is_available()) and cuda_paths_on()
    arena = POOL.acquire(sizes, config)
    lease = Lease(arena, config)
    try:
        dests = [
            view.view(src.dtype).view(src.shape) if src.numel() else torch.empty(src.shape, dtype=src.dtype)
            for view, src in zip(arena.views(), sources, strict=False)
        ]
        if arena.pinned:  # straight into page-locked memory: as fast as the device copies
            _copy_all(sources, dests)
        else:  # a pageable arena (the first save of a layout): device tensors through the pinned ring
            _copy_all(*_copy_through_rings(sources, dests, config))
        order = iter(dests)
        staged = _rebuild(state_dict, lambda: next(order))
    except BaseException:
        lease.release()
        raise
    if pin and config.pool and config.pin_arenas:
        arena.pin_in_background(config.pinned_limit_bytes)  # while this save uploads; the next copies into it
    return staged, lease


_BACKGROUND: ThreadPoolExecutor | None = None
_BACKGROUND_LOCK = threading.Lock()


def stage_in_background(state_dict: dict[str, Any], config: StagingConfig) -> Future[tuple[dict[str, Any], Lease]]:
    """:func:`stage` in the process's one staging thread.

    Device copies there wait for the work the caller's stream has queued so
    far, so the caller may go on queueing work; it must not change the state
    until the Future is done.
    """
    global _BACKGROUND
    with _BACKGROUND_LOCK:
        if _BACKGROUND is None:
            _BACKGROUND = ThreadPoolExecutor(1, thread_name_prefix="dcp_cloud-stage")
        executor = _BACKGROUND
    event = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        event = torch.cuda.Event()
        event.record()

    def run() -> tuple[dict[str, Any], Lease]:
        if event is not None:
            event.synchronize()
        return stage(state_dict, config)

    return executor.submit(run)
