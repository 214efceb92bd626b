"""torch.save's framing, learned once per tensor layout and reused: the serializer runs per layout, not per item.

Each stored tensor is what ``torch.save`` writes for it: a zip archive of
~1.5 KiB of framing (a pickle of the rebuild arguments, byte order, version,
record headers, the central directory) around the raw bytes. For a plain
CPU tensor whose storage is exactly its bytes, and with the zip CRC32 off
(:mod:`dcp_cloud.format.serialize`), the framing depends only on the layout --
dtype, shape, strides, size and the storage alignment -- not on the values. Running torch's Python
pickler and zip writer for each of thousands of small tensors costs ~0.2 ms
apiece, more than everything else the writer does for them.

So the writer serializes the first tensors of each layout for real, and once
two saves of *different* values of one layout gave byte-identical framing,
writes later tensors of that layout as ``header + raw bytes + trailer``
directly: the bytes are exactly what torch.save writes, and stock
``torch.load`` reads them. A layout whose framing ever differs between two
saves is never reused; when the CRC-free writer is unavailable (torch.save's
CRC32 depends on the values) nothing is learned at all.
"""

from __future__ import annotations

import io
import threading
from typing import Any

import numpy as np
import torch

from . import serialize, torchprivate

#: A layout: everything torch.save's framing of a plain CPU tensor depends on.
Layout = tuple[Any, ...]

#: Most layouts remembered per process (each costs ~1.5 KiB).
MAX_LAYOUTS = 4096

_lock = threading.Lock()
_known: dict[Layout, tuple[bytes, bytes]] = {}
#: Framing of host copies of device tensors, from torch.save of an untouched tensor of the layout.
_synthetic: dict[Layout, tuple[bytes, bytes]] = {}
#: First sample of a layout not yet confirmed: (header, trailer, digest of the values); None: never reuse.
_pending: dict[Layout, tuple[bytes, bytes, bytes] | None] = {}


def storage_alignment() -> int:
    """torch.save's storage alignment now (a process setting; part of every layout)."""
    return torchprivate.storage_alignment()


def layout_of(tensor: torch.Tensor, alignment: int) -> Layout | None:
    """The layout of what the writer saves for ``tensor``, if its framing can be learned and reused.

    The writer saves the host copy of a tensor: detached (no autograd, no
    Python state), and a contiguous CPU view of a larger buffer (FSDP2's
    sharded parameters) as a tensor whose storage is exactly its bytes
    (:func:`.tensorbytes.host_tensor`). So a contiguous CPU ``torch.Tensor`` or
    ``nn.Parameter`` -- not quantized or nested, without the conj/neg bits
    that torch.save pickles -- has a layout, wherever its storage starts, and
    only while torch.save can be run without the zip CRC32.
    """
    if (
        (type(tensor) is not torch.Tensor and type(tensor) is not torch.nn.Parameter)
        or tensor.device.type != "cpu"
        or tensor.layout != torch.strided
        or tensor.is_quantized
        or tensor.is_nested
        or not tensor.is_contiguous()
        or not serialize.usable()
    ):
        return None
    nbytes = tensor.nbytes
    if nbytes == 0 or torchprivate.pickles_tensor_metadata(tensor):  # the conj / neg bits
        return None
    return (tensor.dtype, tuple(tensor.shape), tensor.stride(), nbytes, alignment)


def known(layout: Layout) -> tuple[bytes, bytes] | None:
    """``(header, trailer)`` of a confirmed layout."""
    return _known.get(layout)


def learn(layout: Layout, header: bytes, trailer: bytes, digest: bytes) -> None:
    """Record the framing of one real save of ``layout`` whose values hash to ``digest``."""
    with _lock:
        if layout in _known:
            return
        first = _pending.get(layout, ())
        if first is None:
            return
        if first == ():
            if len(_pending) < MAX_LAYOUTS:
                _pending[layout] = (header, trailer, digest)
            return
        if first[2] == digest:  # the same values again: proves nothing yet
            return
        if (first[0], first[1]) == (header, trailer) and len(_known) < MAX_LAYOUTS:
            _known[layout] = (header, trailer)
            del _pending[layout]
        else:
            _pending[layout] = None


def host_copy_frame(tensor: torch.Tensor, alignment: int) -> tuple[bytes, bytes] | None:
    """``(header, trailer)`` that torch.save writes around the raw bytes of the host copy of ``tensor``, a
    plain contiguous tensor on a device (what the writer saved for it before the ring: ``.to("cpu")``,
    same shape and strides, a storage of exactly its bytes, no Python state).

    Without the zip CRC32 (:mod:`.serialize`) the framing does not depend on the values, so it is taken
    from torch.save of an uninitialized host tensor of the same layout whose bytes are never touched
    (they are skipped by address, like the writer's tap skips them): no host copy of the tensor is made.
    """
    if not serialize.usable():
        return None
    layout = (tensor.dtype, tuple(tensor.shape), tensor.stride(), tensor.nbytes, alignment)
    with _lock:
        got = _known.get(layout) or _synthetic.get(layout)
    if got is not None:
        return got
    fake = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype)
    probe = _Probe(fake)
    serialize.save_tensor(fake, probe)
    if probe.raw is None:
        return None
    frame = (bytes(probe.parts[0]), bytes(probe.parts[1]))
    with _lock:
        if len(_synthetic) < MAX_LAYOUTS:
            _synthetic[layout] = frame
    return frame


class _Probe(io.RawIOBase):
    """A torch.save sink that keeps the bytes before and after ``tensor``'s raw bytes, and skips those."""

    def __init__(self, tensor: torch.Tensor) -> None:
        super().__init__()
        self._ptr, self._nbytes = tensor.data_ptr(), tensor.nbytes
        self.parts = (bytearray(), bytearray())
        self.raw: int | None = None

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        n = len(mv)
        if self.raw is None and n == self._nbytes and _address(mv) == self._ptr:
            self.raw = len(self.parts[0])
        else:
            part = self.parts[self.raw is not None]
            part += mv
        return n


def _address(mv: memoryview) -> int:
    return int(np.frombuffer(mv, dtype=np.uint8).ctypes.data) if len(mv) else 0


def forget() -> None:
    """Drop everything learned (tests)."""
    with _lock:
        _known.clear()
        _pending.clear()
        _synthetic.clear()
