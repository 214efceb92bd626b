"""Which tensors take the CUDA-specific copy paths, the switch that turns them off, and how they fail.

The CUDA-specific paths (the pinned rings of :mod:`.devicering`, the feed of
:mod:`.devicefeed`, the landing chunks of :mod:`.landing`, page-locked
staging arenas, side streams) are optimizations, so they degrade and never
fail a save or a load: where one cannot be set up (page-locking refused, the
pinned memory cap of :mod:`.pinledger` reached, a stream or event call
failing before any byte moved) the caller takes the plain path and the
process logs one warning naming what failed and what it costs
(:func:`degrade`). ``DCP_CLOUD_CUDA_PATHS=off`` turns every one of them off
the same way (:func:`cuda_paths_on`). A failure once bytes are moving is a
failure of the data: :func:`moving` raises it as
:class:`~dcp_cloud.errors.DeviceCopyError`.

Device tensors are routed through these paths (:func:`routed`) when their
bytes are exactly their memory (:func:`plain`); tests route CPU tensors
through the same code with :func:`route_cpu`.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

import torch

from ...errors import DcpCloudError, DeviceCopyError
from ...format.torchprivate import pickles_tensor_metadata

log = logging.getLogger("dcp_cloud")

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


def cpu_copies_deferred() -> bool:
    """With the CPU routed: whether its copies run only when waited for (see :mod:`.movers`)."""
    return _DEFERRED


def cpu_ring_pinned() -> bool:
    """With the CPU routed: whether its ring is page-locked as a CUDA one is (tests of the pinning paths)."""
    return _PIN_CPU
