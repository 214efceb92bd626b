"""The bytes of a CPU tensor as a memoryview (or, strided, a numpy array) without a torch op, and copies
between CPU tensors made with them.

``tensor.reshape(-1).view(torch.uint8).numpy()`` costs three torch ops, and
each torch op releases the GIL and takes it back: with transfer threads busy
in Python (an SDK building requests, checksums of arriving bytes), taking it
back waits up to the interpreter's switch interval (5 ms). On the thread
that plans and feeds the transfers, that wait, per item, was most of the
cost of thousands of small items. Reading ``data_ptr()`` and ``nbytes`` and
wrapping the memory with ``PyMemoryView_FromMemory`` keeps the GIL
throughout.

The view does not keep the tensor alive: the caller holds the tensor for as
long as the view is used.

:func:`copy_same` and :func:`contiguous_copy` copy a tile or a piece between
its place in a larger tensor and a contiguous buffer through such views, on
the calling thread, where torch would run an OpenMP parallel region.
:func:`host_tensor` gives ``torch.save`` a CPU tensor whose storage is
exactly its bytes (what the writer serializes, compresses and hashes).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .torchprivate import pickles_tensor_metadata

_from_memory = ctypes.pythonapi.PyMemoryView_FromMemory
_from_memory.restype = ctypes.py_object
_from_memory.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)
_PYBUF_READ = 0x100
_PYBUF_WRITE = 0x200


def tensor_bytes(tensor: torch.Tensor, *, writable: bool = True) -> memoryview:
    """The ``nbytes`` bytes at ``tensor.data_ptr()`` (a contiguous CPU tensor) as a flat byte view."""
    nbytes = tensor.nbytes
    if nbytes == 0:
        return memoryview(bytearray(0))
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("tensor_bytes needs a contiguous CPU tensor")
    view: memoryview = _from_memory(tensor.data_ptr(), nbytes, _PYBUF_WRITE if writable else _PYBUF_READ)
    return view


def _raw(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s values are its memory as it is: a plain dense CPU tensor, not a subclass, not a
    lazily conjugated or negated view, not quantized."""
    return (
        type(tensor) is torch.Tensor
        and tensor.device.type == "cpu"
        and tensor.layout == torch.strided
        and not tensor.is_quantized
        and not pickles_tensor_metadata(tensor)  # a lazy conjugate or negative bit (see by_value)
    )


def by_value(data: Any) -> Any:
    """``data`` (what a save planner resolved for an item), a tensor with a lazy conjugate or negative bit
    copied into one without it: the memory of ``x.conj()`` holds ``x``, and a byte-precise read takes an
    item's memory as its values (torch.save would store the bit beside ``x``'s bytes, which only
    ``torch.load`` applies). Anything else is returned as it is."""
    if isinstance(data, torch.Tensor) and pickles_tensor_metadata(data):
        return data.resolve_conj().resolve_neg()
    return data


def values_of(resolve: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``resolve`` (a save planner's resolve_data, or the like) giving its tensors by value (:func:`by_value`)."""
    return lambda item: by_value(resolve(item))


def strided_bytes(tensor: torch.Tensor) -> np.ndarray | None:
    """The bytes of a CPU tensor of any strides as a numpy ``uint8`` array of shape ``tensor.shape +
    (element_size,)`` over its memory, without a torch op; None where those bytes are not its values (see
    :func:`_raw`) or may not be written through (a zero stride: several elements share memory), or there
    are none."""
    if not _raw(tensor) or tensor.numel() == 0:
        return None
    esize = tensor.element_size()
    shape, strides = tuple(tensor.shape), tuple(tensor.stride())
    if any(st <= 0 and n > 1 for n, st in zip(shape, strides, strict=True)):
        return None
    extent = (sum((n - 1) * st for n, st in zip(shape, strides, strict=True)) + 1) * esize
    memory = _from_memory(tensor.data_ptr(), extent, _PYBUF_WRITE)
    return np.ndarray(shape + (esize,), np.uint8, memory, 0, tuple(st * esize for st in strides) + (1,))


def copy_same(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Copy ``src`` into ``dst`` (CPU tensors of one dtype and shape, any layouts) on this thread, with numpy;
    False (nothing copied) where they do not qualify, for the caller to ``copy_``.

    ``Tensor.copy_`` of a large CPU tensor runs as an OpenMP parallel region: the pool's threads then spin
    waiting for the next one, taking the cores that the transfer threads receive bytes on (on a 2-core
    machine a tiled load spent a third of its CPU there). A copy of a tile or a piece is a few MiB that one
    thread copies at memory speed."""
    if dst.dtype != src.dtype or dst.shape != src.shape or dst.requires_grad:
        return False
    out, inp = strided_bytes(dst), strided_bytes(src)
    if out is None or inp is None:
        return False
    np.copyto(out, inp, casting="no")
    return True


def contiguous_copy(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor.contiguous()``, copied on this thread where :func:`copy_same` can (a plain CPU tensor)."""
    if tensor.is_contiguous() or not _raw(tensor):
        return tensor.contiguous()
    out = torch.empty(tensor.shape, dtype=tensor.dtype)
    if not copy_same(out, tensor.detach()):
        return tensor.contiguous()
    return out


def buffer_address(mv: memoryview) -> int:
    """The address of a flat byte view's first byte (0 for an empty one)."""
    return int(np.frombuffer(mv, dtype=np.uint8).ctypes.data) if len(mv) else 0


def host_tensor(tensor: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A CPU tensor whose storage is exactly its bytes (torch.save writes a tensor's whole
    storage), and whether it is a copy made here (a temporary) rather than the caller's memory.

    A contiguous CPU view into a larger buffer (FSDP2's sharded parameters,
    slices of a flat buffer) gets a storage that is a slice of the buffer's:
    the same memory, no copy. GPU tensors and non-contiguous views are copied.
    """
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        return host_tensor(tensor.to("cpu"))[0], True
    if not tensor.is_contiguous():
        return tensor.clone(memory_format=torch.contiguous_format), True
    storage = tensor.untyped_storage()
    if tensor.storage_offset() == 0 and storage.nbytes() == tensor.nbytes:
        return tensor, False
    start = tensor.storage_offset() * tensor.element_size()
    exact = storage[start : start + tensor.nbytes]
    if exact.data_ptr() != tensor.data_ptr() or exact.nbytes() != tensor.nbytes:  # not a view: never seen
        return tensor.clone(memory_format=torch.contiguous_format), True
    return torch.empty(0, dtype=tensor.dtype).set_(exact, 0, tensor.shape, tensor.stride()), False


def plain_and_exact(data: Any) -> bool:
    """A plain CPU tensor, not requiring grad, without Python state, whose storage is exactly its bytes."""
    return (
        type(data) is torch.Tensor
        and not data.requires_grad
        and data.device.type == "cpu"
        and not data.__dict__
        and data.storage_offset() == 0
        and data.is_contiguous()
        and data.untyped_storage().nbytes() == data.nbytes
    )
