"""Page-locking host memory in place, counted in the host's ledger of pinned memory (:mod:`.pinledger`)."""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch

from .pinledger import LEDGER, default_cap

log = logging.getLogger("dcp_cloud")

#: cudaHostRegisterPortable: the pinned pages count as pinned in every CUDA context.
_HOST_REGISTER_PORTABLE = 1


class PinCapError(RuntimeError):
    """Page-locking more memory would take this host past the cap on pinned memory (see :mod:`.pinledger`)."""


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
