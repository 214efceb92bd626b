"""How a writer stages a state dict for ``dcp.async_save``: :class:`StagingConfig` and its defaults."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...config import cpu_share
from ...errors import ConfigError

MiB = 1024 * 1024


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
    #: into one. ``0``: no ring (device copies go straight to pageable memory).
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


#: Most host-copy threads by default (faulting in a fresh arena's pages bounds the first save's staging;
#: the benchmarks page has the measurements).
MAX_COPY_THREADS = 16


def default_copy_threads() -> int:
    """This rank's share of the CPUs it may run on (torchrun's ``LOCAL_WORLD_SIZE`` ranks share the host),
    between 1 and :data:`MAX_COPY_THREADS`."""
    return min(MAX_COPY_THREADS, cpu_share())


def async_save_takes_futures() -> bool:
    """Whether this torch's ``dcp.async_save`` accepts a Future from ``stage`` and returns an AsyncSaveResponse."""
    from torch.distributed.checkpoint import state_dict_saver

    return hasattr(state_dict_saver, "AsyncSaveResponse")
