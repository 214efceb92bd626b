"""The bytes of a CPU tensor as a memoryview, without a torch op.

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
"""

from __future__ import annotations

import ctypes

import torch

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
