"""Staging for ``dcp.async_save``: the state is copied into host buffers that outlive one save.

``dcp.async_save`` stages the state dict before it returns, so that training
may change its tensors while the upload runs. Torch's default stager (used
for any writer that is not an ``AsyncStager``) allocates fresh pageable
memory on every save. :class:`~dcp_cloud.CloudWriter` is an ``AsyncStager``
and stages into an arena of the process-wide pool of :mod:`.hostpool`:

* with CUDA, device tensors are copied into a page-locked arena with
  ``non_blocking=True`` on a side stream, with one synchronize at the end.
  The first save of a layout, whose arena is pinned in the background only
  after it, copies through the process's small pinned ring instead
  (:mod:`.ringstage`): device copies into one ring chunk overlap host
  threads copying the chunk before into the still pageable arena; later
  saves copy straight into the pinned arena. With ``pin_arenas=False``, or
  where an arena stays pageable, every save goes through the ring.
* a ring that cannot be made leaves device copies going straight to
  pageable memory. ``DCP_CLOUD_CUDA_PATHS=off`` turns all of it off: plain
  blocking copies into pageable arenas.

Without CUDA the same code copies into pageable memory.
"""

from __future__ import annotations

import copy
import io
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from ...format.torchprivate import dtensor_like, is_sharded_tensor
from .cudapaths import cuda_paths_on, degrade, moving, plain, routed
from .devicering import device_path
from .hostpool import POOL, Lease
from .ringstage import copy_through_ring
from .stagingconfig import StagingConfig

#: What staging without the ring costs.
_NO_RING_COST = "async_save copies device tensors straight into pageable memory (a slower first stall)"


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
